"""The fusion rule: which profiled kernels a compiler (Inductor) would fuse, and what the fused kernel costs.

A compiled variant's graphs run :func:`fuse` of the eager kernels: each run of fusible kernels (pointwise, reductions,
indexing) between matmul-like ones becomes one kernel costing its longest member plus :data:`FUSION_REST` of the
others. `bcg analyze` checks it against the fused kernels' own timings (``fusion_check``) and, on a GPU, ``--validate``.
"""

from __future__ import annotations

from collections.abc import Sequence

from bcg.bench.trace import Kernel

__all__ = ["FUSION_REST", "fuse", "is_fusible"]

# A fused group of memory-bound kernels costs its longest member plus this share of the others: the group reads and
# writes its tensors once, not once per op. A calibration constant, checked by `bcg analyze --validate` on a GPU.
FUSION_REST = 0.3
# Ops and kernels Inductor leaves as they are (library matmuls, attention, sorts, data-dependent shapes).
_EXTERN_OPS = ("mm", "matmul", "linear", "conv", "attention", "flash", "efficient", "cudnn", "sort", "topk",
               "nonzero", "unique", "histc", "bincount", "embedding_bag")
_EXTERN_KERNELS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "flash", "fmha", "sm90", "sm80", "sm100")


def is_fusible(k: Kernel) -> bool:
    """Whether a compiler would fuse ``k`` with its neighbours: a pointwise, reduction or indexing op (not a copy,
    a matmul, attention, a sort, or a kernel launched outside any op, such as a Triton kernel).

    Example::

        >>> is_fusible(Kernel("vectorized_elementwise_kernel", "aten::mul", 2.0))
        True
        >>> is_fusible(Kernel("sm90_xmma_gemm", "aten::mm", 9.0))
        False
    """
    if k.is_copy or not k.op:
        return False
    op, name = k.op.lower(), k.name.lower()
    return not any(e in op for e in _EXTERN_OPS) and not any(e in name for e in _EXTERN_KERNELS)


def fuse(kernels: Sequence[Kernel], rest: float = FUSION_REST) -> list[Kernel]:
    """``kernels`` as a compiler would launch them: each run of fusible kernels becomes one kernel costing its
    longest member plus ``rest`` of the others; the others stay as they are.

    Example::

        >>> ks = [Kernel("mul", "aten::mul", 2.0), Kernel("add", "aten::add", 4.0), Kernel("gemm", "aten::mm", 9.0)]
        >>> [(k.name, k.device_us) for k in fuse(ks, rest=0.5)]
        [('fused(2)', 5.0), ('gemm', 9.0)]
    """
    out: list[Kernel] = []
    group: list[Kernel] = []

    def flush() -> None:
        if not group:
            return
        longest = max(k.device_us for k in group)
        total = sum(k.device_us for k in group)
        out.append(Kernel(f"fused({len(group)})", "fused", longest + rest * (total - longest), group[0].island,
                          host_us=group[0].host_us))
        group.clear()

    for k in kernels:
        if is_fusible(k):
            group.append(k)
        else:
            flush()
            out.append(k)
    flush()
    return out
