# No ``from __future__ import annotations``: torch.library reads the op schemas from real annotations.
"""Variable-length causal attention written into a given buffer, with soft-capping, a left window and sinks.

:func:`varlen_attention` runs bcg's Triton kernel (:mod:`bcg.ops.kernels.triton_attention`) on CUDA and
FlashAttention's reference in plain torch (:func:`bcg.ops.flash_reference.reference_flash_varlen`) everywhere else.
It is what an attention island needs that torch 2.11's FlashAttention lacks: the result goes straight into ``out``
(no copy after the kernel), and gemma2's soft-capping is one more switch of the same kernel.

The contract (both implementations):

* q/out ``(total_q, num_heads, head_dim)``, k/v ``(total_k, num_kv_heads, head_dim)``, fp16/bf16, last dims
  contiguous; consecutive query heads share a K/V head (GQA); head_dim a multiple of 8, at most 256.
* ``cu_seqlens_q/k`` int32 ``(num_seqs + 1,)`` on q's device; ``max_seqlen_q/k`` host upper bounds of the lengths
  (nothing is read back to the host, so a graph may capture the call).
* causal, bottom-right aligned per sequence (queries are the last rows of their keys: a cached prefix comes first);
  ``window_left`` ``w`` keeps keys ``i - w .. i`` of query ``i``; ``softcap`` ``c`` caps the scaled scores as
  ``c * tanh(s / c)``; ``sinks`` are fp32 per-head logits of a value-less softmax column.
* empty sequences are fine (the padded rows of a full bucket), whatever ``max_seqlen_q`` is: unlike FlashAttention-2
  there is no one-query GQA path that reshapes q. A row that sees no key gets 0; rows of no sequence keep ``out``'s
  values, unless ``zero_tail``: then the rows past the last sequence get 0 in the same launch.
* ``kv_slots`` (int32/int64, contiguous): key ``j`` of sequence ``s`` is row ``kv_slots[cu_seqlens_k[s] + j]`` of
  k/v, which are then a KV pool's layer (any number of rows): attention straight from the pool, no gather. Slots
  outside every sequence are never read.
* ``kv_base`` (int64 ``(num_seqs,)``), with ``kv_slots``: a promise per sequence that its slots run up by one from
  ``kv_base[s]`` (``-1``: no promise). The kernel then reads that sequence's keys by address, without loading its
  slots; the reference reads through the slots either way, so a broken promise shows as a difference between them.
  Alone: key ``j`` of sequence ``s`` is row ``kv_base[s] + j`` of k/v (a pool's layer), for every non-empty sequence
  (a whole-step graph whose batch's requests each hold one run of slots): the kernel's one key loop, no slot loads.

Registered as ``torch.ops.bcg.varlen_attention_`` (mutating ``out``): the reference on every device, the Triton
kernel on CUDA, a fake kernel for tracing; :func:`varlen_attention` calls it while torch.compile traces and the two
implementations directly otherwise (a trip through the dispatcher costs host time at every island).
"""

from typing import Optional

import torch
from torch import Tensor

from bcg.ops.flash_reference import check_varlen_inputs, reference_flash_varlen
from bcg.ops.kernels.dispatch import use_fused

__all__ = ["varlen_attention", "varlen_attention_reference"]


def varlen_attention_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, out: Tensor, scale: Optional[float] = None,
                               softcap: Optional[float] = None, window_left: Optional[int] = None,
                               sinks: Optional[Tensor] = None, kv_slots: Optional[Tensor] = None,
                               zero_tail: bool = False, kv_base: Optional[Tensor] = None) -> None:
    """The plain-torch implementation of :func:`varlen_attention` (any device; O(total_q * total_k) memory); it
    reads every key through ``kv_slots`` (``kv_base`` alone: through the slots it names, up to ``max_seqlen_k`` a
    sequence)."""
    if kv_base is not None and kv_slots is None:
        kv_slots = _base_slots(kv_base, cu_seqlens_k, max_seqlen_k)
    # FlashAttention's contract differs in two corners this op does not have: a bound of one query takes its
    # one-query GQA reshape (2 is the same upper bound for causal rows), and a key bound of 0 zeroes every row.
    reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 2), max(max_seqlen_k, 1),
                           is_causal=True, scale=scale, softcap=softcap, sinks=sinks, out=out,
                           window_size_left=-1 if window_left is None else window_left, kv_slots=kv_slots,
                           zero_tail=zero_tail)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, out: Tensor, *, scale: Optional[float] = None,
                     softcap: Optional[float] = None, window_left: Optional[int] = None,
                     sinks: Optional[Tensor] = None, kv_slots: Optional[Tensor] = None, zero_tail: bool = False,
                     kv_base: Optional[Tensor] = None, impl: str = "fused") -> Tensor:
    """Causal varlen attention written into ``out`` (returned); the contract is the module's.

    Args:
        q, k, v, out: packed ``(tokens, heads, head_dim)``; ``out`` q's shape and dtype.
        cu_seqlens_q, cu_seqlens_k: int32 cumulative lengths, one entry more than sequences, on q's device.
        max_seqlen_q, max_seqlen_k: host upper bounds of the query and key lengths.
        scale: softmax scale (default ``head_dim ** -0.5``).
        softcap: scores capped as ``softcap * tanh(score / softcap)`` after scaling (None: no cap).
        window_left: query ``i`` sees keys ``i - window_left .. i`` (None: all before it).
        sinks: ``(num_heads,)`` fp32 sink logits (None: none).
        kv_slots: int32/int64 slot of each packed key in k/v (None: key ``i`` is row ``i``); k/v then a pool layer.
        zero_tail: write 0 into the rows past the last sequence (else they keep ``out``'s values).
        kv_base: int64 ``(num_seqs,)``: with ``kv_slots``, each sequence's first slot where its slots run up by one,
            else -1; alone, the row each sequence's keys run up from (the module's contract).
        impl: ``"fused"`` (Triton on CUDA, the reference elsewhere) or ``"torch"`` (the reference).

    Example:
        >>> q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
        >>> kv = torch.randn(5, 2, 16, dtype=torch.bfloat16)
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> out = torch.zeros_like(q)
        >>> varlen_attention(q, kv, kv, cu, cu, 3, 3, out, softcap=50.0, window_left=1) is out
        True
        >>> pool = torch.cat([kv.flip(0), torch.full((1, 2, 16), float("nan"), dtype=torch.bfloat16)])
        >>> slots = torch.tensor([4, 3, 2, 1, 0, 5])          # key i at pool row 4 - i; the last (unused) is NaN
        >>> pooled = varlen_attention(q, pool, pool, cu, cu, 3, 3, torch.zeros_like(q), kv_slots=slots)
        >>> torch.equal(pooled, varlen_attention(q, kv, kv, cu, cu, 3, 3, torch.zeros_like(q)))
        True
    """
    fused = use_fused(impl, q)
    if fused:  # the reference checks the same itself
        check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, out, softcap, sinks, kv_slots)
    if kv_base is not None:
        _check_kv_base(kv_base, kv_slots, cu_seqlens_q)
    if torch.compiler.is_compiling():
        torch.ops.bcg.varlen_attention_(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, scale,
                                        softcap, window_left, sinks, kv_slots, zero_tail, kv_base)
    elif fused:
        _triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, scale, softcap, window_left,
                sinks, kv_slots, zero_tail, kv_base)
    else:
        varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, scale,
                                   softcap, window_left, sinks, kv_slots, zero_tail, kv_base)
    return out


def _check_kv_base(kv_base: Tensor, kv_slots: Optional[Tensor], cu_seqlens_q: Tensor) -> None:
    """Shapes only (its values are the device's: no read back, so a capture may hold the call)."""
    num_seqs = cu_seqlens_q.numel() - 1
    if kv_base.dtype != torch.int64 or kv_base.dim() != 1 or kv_base.numel() != num_seqs \
            or not kv_base.is_contiguous() or kv_base.device != cu_seqlens_q.device:
        raise ValueError(f"kv_base must be a contiguous 1-D int64 tensor of one entry per sequence ({num_seqs}) on "
                         f"the cumulative lengths' device; got {kv_base.dtype}, shape {tuple(kv_base.shape)} on "
                         f"{kv_base.device}")


def _base_slots(kv_base: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int) -> Tensor:
    """The slots ``kv_base`` alone stands for, for the reference: key ``j`` of sequence ``s`` at ``kv_base[s] + j``,
    over ``num_seqs * max_seqlen_k`` packed keys (a bound known on the host: nothing read back); keys past the last
    sequence get slot 0, which the reference never reads."""
    num_seqs = kv_base.numel()
    cu = cu_seqlens_k.long()
    keys = torch.arange(num_seqs * max(max_seqlen_k, 1), device=cu.device)
    seq = torch.searchsorted(cu[1:], keys, right=True).clamp(max=num_seqs - 1)
    return torch.where(keys < cu[-1], kv_base[seq] + keys - cu[seq], 0)


def _triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
            max_seqlen_k: int, out: Tensor, scale: Optional[float], softcap: Optional[float],
            window_left: Optional[int], sinks: Optional[Tensor], kv_slots: Optional[Tensor] = None,
            zero_tail: bool = False, kv_base: Optional[Tensor] = None) -> None:
    from bcg.ops.kernels import triton_attention

    triton_attention.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, scale,
                                      softcap, window_left, sinks, kv_slots=kv_slots, zero_tail=zero_tail,
                                      kv_base=kv_base)


# --- torch.library op: what torch.compile traces (opaque; writes ``out``). ---
@torch.library.custom_op("bcg::varlen_attention_", mutates_args=("out",))
def _varlen_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, out: Tensor, scale: Optional[float],
                         softcap: Optional[float], window_left: Optional[int], sinks: Optional[Tensor],
                         kv_slots: Optional[Tensor] = None, zero_tail: bool = False,
                         kv_base: Optional[Tensor] = None) -> None:
    varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, scale, softcap,
                               window_left, sinks, kv_slots, zero_tail, kv_base)


_varlen_attention_op.register_kernel("cuda")(_triton)


@_varlen_attention_op.register_fake
def _varlen_attention_fake(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, out: Tensor, scale: Optional[float],
                           softcap: Optional[float], window_left: Optional[int], sinks: Optional[Tensor],
                           kv_slots: Optional[Tensor] = None, zero_tail: bool = False,
                           kv_base: Optional[Tensor] = None) -> None:
    return None
