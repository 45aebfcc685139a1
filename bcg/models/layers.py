"""Building blocks shared by the model zoo: RMSNorm, rotary embedding and the SwiGLU MLP.

Everything here is capturable: fixed shapes, no host reads, no data-dependent control flow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_HAS_FUSED_RMS_NORM = hasattr(F, "rms_norm")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale.

    Example:
        >>> norm = RMSNorm(16)
        >>> norm(torch.randn(3, 4, 16)).shape
        torch.Size([3, 4, 16])
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if _HAS_FUSED_RMS_NORM:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Fallback mirrors the fused kernel: reduce in fp32, scale in the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (non-interleaved "rotate half" layout, as in Llama/Qwen).

    ``forward(positions)`` turns an int tensor of positions into ``cos, sin`` of shape
    ``(T, 1, head_dim)`` on the device (``sin`` with its first half negated, see :func:`rotate`), so it can sit
    inside a captured graph: nothing is read back to the host and no table is sized by the largest position seen.

    Example:
        >>> rope = RotaryEmbedding(16)
        >>> cos, sin = rope(torch.arange(5))
        >>> apply_rotary(torch.randn(5, 4, 16), cos, sin).shape
        torch.Size([5, 4, 16])
    """

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device: torch.device) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` in fp32 on its device.

        Needed after ``to_empty`` (meta init) and after a model-wide ``.to(bf16)``, which would
        otherwise leave the frequencies empty or rounded.
        """
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        sin = angles.sin()
        # The sign of rotate-half folded into sin once per forward (first half negated): every layer's rotation
        # then swaps the halves with one cat instead of a negation and a cat. Exact: only signs move.
        sin[..., : self.head_dim // 2].neg_()
        return angles.cos(), sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(T, heads, head_dim)`` by the angles behind ``cos``/``sin``, in fp32.

    Non-interleaved "rotate half" RoPE: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``.
    ``sin`` comes from :class:`RotaryEmbedding` with that minus sign folded into its first half, so the halves
    only swap. The math runs in fp32 (angles at large positions lose too much in bf16): a half-precision ``x``
    times the fp32 angles promotes exactly, the same numbers as casting ``x`` first with one kernel fewer.
    ``x`` may be a strided view (q and k heads side by side in a fused projection). The result stays fp32, so
    a caller that copies it anyway (a bridge buffer) casts in that copy.

    Example:
        >>> cos, sin = RotaryEmbedding(8)(torch.zeros(2, dtype=torch.long))
        >>> x = torch.randn(2, 1, 8)
        >>> torch.equal(rotate(x, cos, sin), x)  # position 0 is the identity
        True
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rotate`, cast back to ``x.dtype``.

    Example:
        >>> cos, sin = RotaryEmbedding(8)(torch.arange(3))
        >>> apply_rotary(torch.randn(3, 2, 8, dtype=torch.bfloat16), cos, sin).dtype
        torch.bfloat16
    """
    return rotate(x, cos, sin).to(x.dtype)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    Example:
        >>> mlp = SwiGLUMLP(64, 128)
        >>> mlp(torch.randn(3, 64)).shape
        torch.Size([3, 64])
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # One (2I, H) matmul instead of two (I, H) ones: fewer launches in a launch-bound prefill.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
