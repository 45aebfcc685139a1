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
    ``(T, 1, head_dim)`` on the device, so it can sit inside a captured graph: nothing is read back
    to the host and no table is sized by the largest position seen.

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
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(T, heads, head_dim)`` by the angles behind ``cos``/``sin``.

    The math runs in fp32 (angles at large positions lose too much in bf16) and the result is cast
    back to ``x.dtype``. ``x`` may be a strided view (e.g. q and k heads side by side in a fused projection).

    Example:
        >>> cos, sin = RotaryEmbedding(8)(torch.zeros(2, dtype=torch.long))
        >>> x = torch.randn(2, 1, 8)
        >>> torch.equal(apply_rotary(x, cos, sin), x)  # position 0 is the identity
        True
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)  # negation is exact in any dtype
    # A half-precision x times the fp32 cos/sin promotes to fp32 exactly: the same numbers as casting x first,
    # one kernel fewer (the layer stack is launch-bound at short prompts, so kernels count).
    return (x * cos + rotated * sin).to(x.dtype)


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
