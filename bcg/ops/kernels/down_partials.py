"""A down projection that leaves its split-K partials to the next kernel: one GEMM launch, no reduce kernel.

At a few dozen rows the down projection reads its whole weight for little work, so cuBLAS splits K and adds a reduce
kernel. The kernel after it, the next layer's residual add + RMSNorm (:func:`~bcg.ops.kernels.fused_add_rms_norm`),
reads the projection's output row by row anyway: :func:`down_partials` hands it :data:`NUM_SPLITS` fp32 partials
instead, one per slice of K, from one batched GEMM over views of the activation and the weight (``torch.bmm`` with
``out_dtype=float32``: no copy, no reduce), and the add + norm kernel sums them in order as it reads them. The sum is
rounded once, into the residual, where the two-step path rounds the projection and then the sum.

On the H200 (round 17, ``benchmarks/down_partials.py``, device time in a CUDA graph) the batched GEMM with four
splits took 0.55-0.78x of ``F.linear``'s GEMM and reduce on the llama-dense, Llama-3.2-1B and Qwen3-0.6B down
projections at 16-256 rows (llama-dense at 64 rows: 3.7 against 6.4 µs), for 0.2-7 MB more read by the add + norm.
Above :data:`MAX_ROWS` it was not measured, so the projection stays one ``F.linear`` there.

:func:`num_splits` is the one predicate: where it says 0 (``BCG_DOWN_PARTIALS=off``, more rows, a K that does not
split into aligned slices, fp32, a ``torch.compile`` trace, or a torch without ``bmm``'s ``out_dtype`` on CUDA) the
caller runs the projection as before. On a CPU the partials are an fp32 ``bmm`` of the same views, so the CPU tests run
the same wiring.
"""

from __future__ import annotations

import torch
from torch import Tensor

from bcg import env
from bcg.ops.kernels.dispatch import kernel_path

__all__ = ["MAX_ROWS", "NUM_SPLITS", "down_partials", "num_splits", "split_views"]

NUM_SPLITS = 4  # the fastest of 2/4/8 at 64-256 rows on all three shapes, within 10% of 8 at 16 rows
MAX_ROWS = 256  # measured up to here
_HALF = (torch.bfloat16, torch.float16)
_ALIGN = 8  # elements: each slice of a bf16 row starts 16 bytes apart, as cuBLAS's fast kernels want
# torch.bmm(..., out_dtype=) (bf16 in, fp32 out) on CUDA: the overload exists from torch 2.9.
_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def num_splits(x: Tensor, weight: Tensor, impl: str) -> int:
    """How many split-K partials :func:`down_partials` of ``x @ weight.T`` makes, or 0: run the projection as one
    output instead (see the module doc for when).

    Example:
        >>> x, w = torch.randn(64, 2816, dtype=torch.bfloat16), torch.randn(1024, 2816, dtype=torch.bfloat16)
        >>> num_splits(x, w, "fused"), num_splits(x, w, "torch"), num_splits(x.float(), w.float(), "fused")
        (4, 0, 0)
    """
    if not env.DOWN_PARTIALS or impl != "fused" or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0:
        return 0
    if x.dtype not in _HALF or weight.dtype != x.dtype:  # measured on bf16; fp32 keeps its one GEMM
        return 0
    k = weight.shape[1]
    if k % (NUM_SPLITS * _ALIGN) or not x.is_contiguous() or not weight.is_contiguous():
        return 0
    path = kernel_path(impl, x)
    if path == "op" or (path == "triton" and not _HAS_OUT_DTYPE):
        return 0
    return NUM_SPLITS


def split_views(x: Tensor, weight: Tensor, splits: int) -> tuple[Tensor, Tensor]:
    """``x`` ``(M, K)`` and ``weight`` ``(N, K)`` as ``splits`` slices of K, in place: ``(S, M, K/S)`` and
    ``(S, K/S, N)``, whose batched product is the partials."""
    m, k = x.shape
    ks = k // splits
    return x.as_strided((splits, m, ks), (ks, k, 1)), weight.as_strided((splits, ks, weight.shape[0]), (ks, 1, k))


def down_partials(x: Tensor, weight: Tensor, splits: int, impl: str = "fused") -> Tensor:
    """``(splits, M, N)`` fp32 partials of ``x @ weight.T``, one per slice of K (their sum is the projection); for
    :func:`~bcg.ops.kernels.fused_add_rms_norm` to sum. Ask :func:`num_splits` first.

    Example:
        >>> x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
        >>> torch.allclose(down_partials(x, w, 4).sum(0), x.float() @ w.float().T, atol=1e-4)
        True
    """
    xs, ws = split_views(x, weight, splits)
    if kernel_path(impl, x) == "torch":  # the CPU stand-in: exact fp32 partials of the same views
        return torch.bmm(xs.float(), ws.float())
    return torch.bmm(xs, ws, out_dtype=torch.float32)
