"""Launch helpers shared by the Triton kernels: block sizes, warps, and launches that skip empty grids.

Block sizes are fixed functions of the shapes (no autotuning: a tuner benchmarks, which syncs the host and cannot
run inside a CUDA graph capture, and its pick could differ between runs). Importing this module needs Triton.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from bcg import env
from bcg.ops.kernels.dispatch import pdl_launch

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) has no libdevice; compiled kernels use it for the
# accurate fp32 exp/sin/cos that torch's CUDA kernels use (tl.exp is ex2.approx for fp32). Read when this module
# is imported, like triton.jit reads the same switch when it decorates.
INTERPRETING: bool = bool(triton.knobs.runtime.interpret)
_ACCURATE_MATH = tl.constexpr(not INTERPRETING)


def _pdl() -> bool:
    """Programmatic dependent launch where this machine runs it (compiled kernels on sm_90+), unless ``BCG_PDL=0``;
    ``BCG_PDL=1`` on a GPU that cannot run it is said once."""
    if env.PDL is False or INTERPRETING:
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        if env.PDL:
            logging.getLogger(__name__).warning("bcg: BCG_PDL is set but programmatic dependent launch needs an sm_90 "
                                                "or newer GPU; bcg's kernels launch as usual")
        return False
    return True


# Programmatic dependent launch (on by default where it runs; BCG_PDL=0 turns it off): each kernel waits at
# grid_dependency() for the kernel before it, and is launched so that it may start while that one finishes. Read
# once, at import, like the interpreter switch: the kernels compile with it.
PDL: bool = _pdl()
_PDL = tl.constexpr(PDL)
LAUNCH_OPTIONS: dict[str, Any] = {"launch_pdl": True} if PDL else {}
_NO_OPTIONS: dict[str, Any] = {}


def launch_options() -> dict[str, Any]:
    """The options of a launch here: PDL where it is on, unless the forward is too large for it (``pdl_for``)."""
    return LAUNCH_OPTIONS if pdl_launch() else _NO_OPTIONS


@triton.jit
def grid_dependency():
    """The first statement of every bcg kernel. Under programmatic dependent launch the kernel may start before the
    one before it has finished: it waits here until that one's writes are visible, and lets the kernel after it be
    launched (which waits the same way). Without PDL, nothing."""
    if _PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def row_block(n_cols: int) -> int:
    """The power-of-two block that holds a whole row of ``n_cols`` elements (masked past the end)."""
    if n_cols > 65536:
        raise ValueError(f"rows of {n_cols} elements exceed the 65536 one program keeps in registers")
    return max(16, triton.next_power_of_2(n_cols))


def row_warps(block: int) -> int:
    """Warps for a program that works on ``block`` elements: about 8-16 elements per thread."""
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def rows_2d(t: Tensor, write: bool = False) -> Tensor:
    """``t`` as ``(rows, last_dim)``: itself when already 2-D (no dispatcher call: launches are host-bound), else a
    view; an input that cannot be viewed is copied, an output raises rather than being written into a copy."""
    if t.dim() == 2:
        return t
    return t.view(-1, t.shape[-1]) if write else t.reshape(-1, t.shape[-1])


def k_split(tiles: int, steps: int, num_sms: int, split: int | None = None, programs_per_sm: int = 2,
           min_k_iters: int = 4) -> tuple[int, int]:
    """``(split_k, k_iters)`` for a split-K launch of ``tiles`` output tiles over ``steps`` K steps: K split until
    about ``programs_per_sm`` programs run per SM (at few rows the weight read takes the time, and it needs every SM),
    each split at least ``min_k_iters`` steps long, and no split left empty; ``split`` asks for a count instead.

    Example::

        >>> k_split(tiles=16, steps=44, num_sms=132)
        (11, 4)
    """
    split = split or max(1, min(triton.cdiv(programs_per_sm * num_sms, tiles), steps // min_k_iters))
    k_iters = triton.cdiv(steps, min(split, steps))
    return triton.cdiv(steps, k_iters), k_iters


def launch_rows(kernel: Any, n_rows: int, *args: Any, **meta: Any) -> None:
    """Launch ``kernel`` with one program per row; nothing is launched for zero rows (an empty grid is an error)."""
    if n_rows > 0:
        kernel[(n_rows,)](*args, **meta, **launch_options())


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> Any:
    """Launch ``kernel`` on ``grid`` unless the grid is empty; returns what Triton's launch returns (the compiled
    kernel), or None."""
    if all(g > 0 for g in grid):
        return kernel[grid](*args, **meta, **launch_options())
    return None


# Triton's interpreter multiplies bf16 tiles wrongly (3.7: off by orders of magnitude; fp16 is right), so there the
# operands of dot() go to fp32 first: each product of two bf16 or fp16 values is exact in fp32, as in the tensor
# cores' MMA with its fp32 accumulator, so an interpreted kernel still checks the compiled one's arithmetic.
_DOT_IN_FP32 = tl.constexpr(INTERPRETING)


@triton.jit
def dot(a, b, acc):
    """``acc + a @ b`` with an fp32 accumulator: the tensor cores' MMA where compiled (see ``_DOT_IN_FP32``)."""
    if _DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def exp_f32(x):
    """``exp`` in fp32, correctly rounded to within CUDA's ``expf`` (libdevice) where compiled."""
    if _ACCURATE_MATH:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def cos_f32(x):
    """``cos`` in fp32 (libdevice's, as CUDA's ``cosf``, where compiled)."""
    if _ACCURATE_MATH:
        return libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def sin_f32(x):
    """``sin`` in fp32 (libdevice's, as CUDA's ``sinf``, where compiled)."""
    if _ACCURATE_MATH:
        return libdevice.sin(x)
    else:
        return tl.sin(x)
