"""FlashAttention's variable-length forward in plain torch, with the kernel's contract: the CPU stand-in for it.

:func:`reference_flash_varlen` computes what ``aten._flash_attention_forward`` (FlashAttention-2's
``mha_varlen_fwd``) computes on packed ``(tokens, heads, head_dim)`` tensors, and refuses what it refuses, so the
varlen attention backend's host logic runs on a CPU exactly as it calls the kernel on a GPU (:func:`bcg.ops.flash.
flash_varlen` sends CPU tensors here). The contract, as the kernel's entry point enforces or assumes it:

* q/k/v fp16 or bf16, one dtype; ``cu_seqlens_q/k`` int32, contiguous, ``(batch + 1,)`` each, batch > 0, on q's
  device; the last dim of q/k/v/out contiguous; head_dim a multiple of 8 and at most 256; k/v
  ``(total_k, num_kv_heads, head_dim)`` with num_kv_heads dividing num_heads (GQA: consecutive query heads share a
  K/V head); ``out`` q's shape and dtype. Violations raise RuntimeError, as the kernel's checks do.
* ``max_seqlen_q/k`` are host upper bounds. A sequence longer than its bound is not checked by the kernel (its rows
  past the bound are silently left unwritten); here it raises, through a device-side assert that a graph captures.
* ``max_seqlen_q == 1`` turns causal off (one query sees all its keys either way). With GQA, no window and
  head_dim % 8 == 0, the kernel then reshapes q to ``(batch, num_kv_heads, groups, head_dim)``: it assumes every
  sequence has exactly one query and ignores ``cu_seqlens_q``. A batch with an empty sequence fails that reshape
  with "shape '[...]' is invalid for input of size N"; the same reshape runs here.
* ``softcap`` ``c`` (flash-attn's, and the Triton kernel's: torch's aten op has none) caps the scaled scores as
  ``c * tanh(s / c)`` before the mask and the softmax (gemma2's attention logit soft-capping). ``sinks`` (the Triton
  kernel's, gpt-oss's) join every row's softmax as one more column per head with no value.
* causal and windows are aligned bottom-right: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sees
  key ``j`` iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right`` (causal: right = 0; -1: unbounded).
* a row that sees no key gets 0 and a log-sum-exp of +inf; rows past the last sequence are not written (a fresh
  output holds NaN there, like uninitialized memory); ``max_seqlen_k == 0`` zeroes the whole output.

Two extensions of bcg's Triton kernel, off by default (FlashAttention has neither): ``kv_slots`` reads key ``j`` of
sequence ``s`` from row ``kv_slots[cu_seqlens_k[s] + j]`` of k/v (a KV pool's layer; the slots outside every sequence
are never read, so they may index anything in range and the rows they name may hold NaN), and ``zero_tail`` writes
0 into the rows past the last sequence.

Everything runs on the device with shapes fixed by the arguments (no host read), so it can be captured in a graph
as the kernel can. It is O(total_q * total_k) memory: a reference for tests and the CPU, never a fast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["check_varlen_inputs", "reference_flash_varlen"]

_HALF = (torch.float16, torch.bfloat16)


def reference_flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, *, is_causal: bool, scale: float | None = None, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float | None = None, sinks: Tensor | None = None, out: Tensor | None = None,
    kv_slots: Tensor | None = None, zero_tail: bool = False,
) -> tuple[Tensor, Tensor]:
    """FlashAttention-2's varlen forward: ``(out, lse)``, ``lse`` fp32 ``(num_heads, total_q)``.

    Args:
        q: ``(total_q, num_heads, head_dim)``; k, v: ``(total_k, num_kv_heads, head_dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on q's device.
        max_seqlen_q, max_seqlen_k: host ints, upper bounds of the sequence lengths.
        is_causal: bottom-right causal mask per sequence.
        scale: softmax scale (default ``head_dim ** -0.5``).
        window_size_left, window_size_right: FlashAttention's local window (-1: unbounded).
        softcap: caps the scaled scores as ``softcap * tanh(scores / softcap)`` (None or 0: no cap, as flash-attn).
        sinks: ``(num_heads,)`` logits of a value-less softmax column per head (the returned lse includes it).
        out: written in place when given (the in-place op's form); rows outside every sequence keep their values.
        kv_slots: int32/int64 ``(total_k,)``: key ``i`` of the packed sequences is row ``kv_slots[i]`` of k/v,
            which may then have any number of rows (a pool layer, gathered here in plain torch).
        zero_tail: rows past the last sequence get 0 (their lse stays NaN) instead of keeping ``out``'s values.

    Example:
        >>> q = torch.randn(3, 4, 16, dtype=torch.bfloat16)
        >>> kv = torch.randn(3, 2, 16, dtype=torch.bfloat16)
        >>> cu = torch.tensor([0, 2, 3], dtype=torch.int32)
        >>> o, lse = reference_flash_varlen(q, kv, kv, cu, cu, 2, 2, is_causal=True)
        >>> o.shape, lse.shape
        (torch.Size([3, 4, 16]), torch.Size([4, 3]))
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, out, softcap, sinks, kv_slots)
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if max_seqlen_q == 1:
        is_causal = False  # the kernel drops it: one query sees every key of its sequence either way
    if is_causal:
        window_size_right = 0
    swapped = (max_seqlen_q == 1 and num_heads > num_kv_heads and window_size_left < 0 and window_size_right < 0
               and head_dim % 8 == 0)
    if swapped:
        # The kernel's single-query GQA path: q viewed as (batch, kv heads, groups, head_dim), which holds only when
        # every sequence has exactly one query (cu_seqlens_q is then ignored); anything else fails right here.
        q.reshape(batch_size, num_kv_heads, num_heads // num_kv_heads, head_dim)
        cu_seqlens_q = torch.arange(batch_size + 1, device=q.device, dtype=torch.int32)
    _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if kv_slots is not None:
        k, v = _gather_slots(k, v, kv_slots, cu_seqlens_k)
    if window_size_left >= max_seqlen_k:
        window_size_left = -1
    if window_size_right >= max_seqlen_k:
        window_size_right = -1
    total_k = k.shape[0]
    _check_bounds(cu_seqlens_q, total_q, max_seqlen_q, "q")
    _check_bounds(cu_seqlens_k, total_k, max_seqlen_k, "k")

    if max_seqlen_k == 0:  # the kernel does not launch: zeros and +inf
        result = out if out is not None else torch.empty_like(q)
        return result.zero_(), torch.full((num_heads, total_q), math.inf, device=q.device)
    seq_q, pos_q, len_q, covered = _positions(cu_seqlens_q, total_q, batch_size)
    seq_k, pos_k, len_k, _ = _positions(cu_seqlens_k, total_k, batch_size)
    diagonal = (len_k - len_q)[seq_q.clamp(0, batch_size - 1)] + pos_q  # bottom-right aligned key of each query
    visible = covered[:, None] & (seq_q[:, None] == seq_k[None, :])
    if window_size_right >= 0:
        visible &= pos_k[None, :] <= (diagonal + window_size_right)[:, None]
    if window_size_left >= 0:
        visible &= pos_k[None, :] >= (diagonal - window_size_left)[:, None]

    group = num_heads // num_kv_heads
    qh = q.float().transpose(0, 1)  # (heads, total_q, head_dim)
    kh = k.float().transpose(0, 1).repeat_interleave(group, 0)
    vh = v.float().transpose(0, 1).repeat_interleave(group, 0)
    logits = (qh @ kh.transpose(1, 2)) * (scale if scale is not None else head_dim ** -0.5)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # (heads, total_q); -inf where a row sees nothing
    seen = visible.any(-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float()[:, None])  # a row that sees no key still gets 0: exp(-inf - s)
    probs = torch.where(seen[:, None], torch.exp(logits - lse[..., None]), 0.0)
    result = (probs @ vh).transpose(0, 1).to(q.dtype)
    lse = torch.where(seen, lse, math.inf)
    lse = torch.where(covered, lse, math.nan)  # rows of no sequence: never written
    if zero_tail:  # rows past the last sequence are written, with 0
        result = torch.where((seq_q == batch_size)[:, None, None], 0.0, result)
        covered = covered | (seq_q == batch_size)
    if out is None:
        return torch.where(covered[:, None, None], result, math.nan), lse
    out.copy_(torch.where(covered[:, None, None], result, out))
    return out, lse


def _gather_slots(k: Tensor, v: Tensor, kv_slots: Tensor, cu_k: Tensor) -> tuple[Tensor, Tensor]:
    """The keys/values ``kv_slots`` names, packed; those outside every sequence are zeroed (the kernel never reads
    them, and a NaN there would reach real rows through a zero weight). Slots out of range fail a device assert."""
    torch._assert_async(((kv_slots >= 0) & (kv_slots < k.shape[0])).all(),
                        f"kv_slots must index rows of k/v (0 .. {k.shape[0] - 1})")
    slots = kv_slots.long().clamp(0, k.shape[0] - 1)
    _, _, _, is_key = _positions(cu_k, slots.numel(), cu_k.numel() - 1)
    is_key = is_key[:, None, None]
    return (torch.where(is_key, k.index_select(0, slots), 0.0).to(k.dtype),
            torch.where(is_key, v.index_select(0, slots), 0.0).to(v.dtype))


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """RuntimeError(message) unless ``ok``; a message that formats values is a callable, made only on failure (an
    island checks its inputs at every layer, and formatting devices and shapes would cost more than the checks)."""
    if not ok:
        raise RuntimeError(message if isinstance(message, str) else message())


def check_varlen_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        out: Tensor | None, softcap: float | None = None, sinks: Tensor | None = None,
                        kv_slots: Tensor | None = None) -> None:
    """Every check of the contract that reads no device value (dtypes, devices, layouts, shapes); RuntimeError with
    the kernel's message where it has one. A Triton kernel with the same contract runs it before launching.

    Example:
        >>> q = torch.zeros(2, 4, 12, dtype=torch.bfloat16)
        >>> check_varlen_inputs(q, q, q, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 2]), None)
        Traceback (most recent call last):
        ...
        RuntimeError: cu_seqlens_k must have dtype int32
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, out, softcap, sinks, kv_slots)
    _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> None:
    """The kernel's shape checks, in its order."""
    batch_size = cu_q.numel() - 1
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    _require(batch_size > 0, "batch size must be positive")
    _require(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    _require(num_heads % num_kv_heads == 0, "Number of heads in key/value must divide number of heads in query")
    _require(head_dim % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
    _require(k.shape == (total_k, num_kv_heads, head_dim) and k.shape == v.shape,
             lambda: f"key and value must have shape (total_k, num_heads_k, head_size) = ({total_k}, "
             f"{num_kv_heads}, {head_dim}), got {tuple(k.shape)} and {tuple(v.shape)}")
    _require(cu_k.shape == (batch_size + 1,),
             lambda: f"cu_seqlens_k must have shape (batch_size + 1) = ({batch_size + 1},), got {tuple(cu_k.shape)}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, out: Tensor | None,
                  softcap: float | None, sinks: Tensor | None, kv_slots: Tensor | None = None) -> None:
    """The kernel entry point's dtype, device, layout and rank checks (its messages, where it has one)."""
    _require(q.dtype in _HALF, lambda: f"FlashAttention only support fp16 and bf16 data type (got {q.dtype})")
    _require(k.dtype == q.dtype, "query and key must have the same dtype")
    _require(v.dtype == q.dtype, "query and value must have the same dtype")
    _require(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _require(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for name, t in (("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _require(t.device == q.device, lambda name=name, t=t: f"{name} must be on {q.device} like q, got {t.device}")
    _require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
             lambda: f"varlen q/k/v must be (tokens, heads, head_dim), got {q.dim()}/{k.dim()}/{v.dim()} dims")
    for t in (q, k, v):
        _require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _require(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _require(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _require(cu_q.dim() == 1, lambda: f"cu_seqlens_q must be 1-D (batch_size + 1), got shape {tuple(cu_q.shape)}")
    _require(softcap is None or softcap >= 0, lambda: f"softcap must be positive (0 or None: no cap), got {softcap}")
    if sinks is not None:
        _require(tuple(sinks.shape) == (q.shape[1],) and sinks.device == q.device,
                 lambda: f"sinks must be one logit per query head, ({q.shape[1]},) on {q.device}, got "
                 f"{tuple(sinks.shape)} on {sinks.device}")
    if kv_slots is not None:
        _require(kv_slots.dtype in (torch.int32, torch.int64) and kv_slots.dim() == 1 and kv_slots.is_contiguous()
                 and kv_slots.device == q.device,
                 lambda: f"kv_slots must be a contiguous 1-D int32/int64 tensor of slots on {q.device}, got "
                 f"{kv_slots.dtype} {tuple(kv_slots.shape)} on {kv_slots.device}")
    if out is not None:
        _require(out.dtype == q.dtype, "Output must have the same dtype as inputs")
        _require(out.device == q.device, lambda: f"out must be on {q.device} like q, got {out.device}")
        _require(out.stride(-1) == 1, "Output tensor must have contiguous last dimension")
        _require(out.shape == q.shape,
                 lambda: f"out must have shape (total_q, num_heads, head_size) = {tuple(q.shape)}, got "
                 f"{tuple(out.shape)}")


def _check_bounds(cu: Tensor, total: int, max_seqlen: int, which: str) -> None:
    """What the kernel assumes of the sequence table and never checks (breaking it gives unwritten rows or reads
    out of bounds): non-decreasing, inside the packed tensor, no sequence longer than the bound. Device-side
    asserts: nothing is read back to the host, and a captured graph checks again at each replay."""
    lens = cu.diff()
    torch._assert_async((cu[0] >= 0) & (lens >= 0).all(),
                        f"cu_seqlens_{which} must be non-decreasing from a non-negative start")
    torch._assert_async(cu[-1] <= total, f"cu_seqlens_{which} ends past the {total} rows of {which}")
    torch._assert_async((lens <= max_seqlen).all(),
                        f"a sequence of cu_seqlens_{which} is longer than max_seqlen_{which}={max_seqlen}: the kernel "
                        f"would leave its rows past that bound unwritten; pass the longest sequence (or more)")


def _positions(cu: Tensor, total: int, batch_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of a packed tensor: its sequence (-1 before the first, ``batch_size`` past the last), its position
    in it, every sequence's length, and whether the row belongs to a sequence."""
    cu = cu.long()
    rows = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu, rows, right=True) - 1
    covered = (seq >= 0) & (seq < batch_size)
    seq = torch.where(covered, seq, torch.where(seq < 0, -1, batch_size))
    pos = rows - cu[seq.clamp(0, batch_size - 1)]
    return seq, pos, cu.diff(), covered
