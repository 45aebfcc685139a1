"""Which implementation a kernel entry point runs: the fused Triton kernel, its plain-torch reference, or (while
``torch.compile`` traces) its custom op.

Every entry point in :mod:`bcg.ops.kernels` takes ``impl="fused" | "torch"``; the models pass their own setting
(``Engine(kernels=...)`` reaches them through :meth:`bcg.models.base.CausalLM.set_kernels`), so there is no process
default. ``"fused"`` runs the Triton kernel for CUDA tensors and the reference for any other device, so one setting
serves the CPU tests and the GPU alike; traced, it is the kernel's ``torch.ops.bcg`` op on every device
(:mod:`bcg.ops.kernels.library`), whose CPU kernel is the reference, so a CPU trace holds the ops a GPU trace holds.
"""

from __future__ import annotations

import functools
import importlib.util
from contextvars import ContextVar
from typing import Literal

import torch
from torch import Tensor

__all__ = ["PDL_MAX_TOKENS", "KernelImpl", "KernelPath", "fused_available", "kernel_path", "num_sms", "pdl_for",
           "pdl_launch", "use_fused"]

KernelImpl = Literal["fused", "torch"]
KernelPath = Literal["torch", "triton", "op"]
IMPLS: tuple[str, ...] = ("fused", "torch")

# Programmatic dependent launch (where it is on: bcg.ops.kernels.triton_utils) took 1-14% off every model's 16- and
# 64-token prefills on the H200 and added 2-4% to three of four at 256 tokens, where kernels run several waves of
# programs and the next kernel's early programs hold SMs: the runner launches a forward's kernels with it up to here.
PDL_MAX_TOKENS = 64
_PDL_LAUNCH: ContextVar[bool] = ContextVar("bcg_pdl_launch", default=True)


class pdl_for:  # lower case: used as a context manager, like contextlib's
    """Inside the block (a forward of ``num_tokens`` rows: its eager run, capture or replay) bcg's kernels launch with
    programmatic dependent launch only if ``num_tokens <= PDL_MAX_TOKENS``; outside any such block they use it
    wherever it is on. A graph keeps what its capture launched with. A class rather than a generator: it is entered
    on every replay, on the host's path to the launch (0.8 µs against 1.9 on the development CPU).

    Example:
        >>> with pdl_for(256):
        ...     pdl_launch()
        False
        >>> pdl_launch()
        True
    """

    __slots__ = ("_enabled", "_token")

    def __init__(self, num_tokens: int) -> None:
        self._enabled = num_tokens <= PDL_MAX_TOKENS

    def __enter__(self) -> None:
        self._token = _PDL_LAUNCH.set(self._enabled)

    def __exit__(self, *exc: object) -> None:
        _PDL_LAUNCH.reset(self._token)


def pdl_launch() -> bool:
    """Whether a launch here may use programmatic dependent launch (see :func:`pdl_for`)."""
    return _PDL_LAUNCH.get()


@functools.cache
def _probe_triton() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent; the reference path still works
        return False
    return True


@torch.compiler.assume_constant_result  # dynamo cannot trace find_spec: it calls this once and bakes the answer
def triton_importable() -> bool:
    """Whether ``triton`` can be imported (it ships with torch's CUDA wheels, not with the CPU ones)."""
    return _probe_triton()


def fused_available(device: torch.device | str) -> bool:
    """Whether the fused kernels run on ``device``: a CUDA device with Triton importable.

    Example:
        >>> fused_available("cpu")
        False
    """
    return torch.device(device).type == "cuda" and triton_importable()


def use_fused(impl: str, x: Tensor) -> bool:
    """Whether an entry point called eagerly with ``impl`` on ``x`` runs its fused kernel.

    Raises:
        RuntimeError: ``"fused"`` was asked for a CUDA tensor but Triton cannot be imported.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown kernels implementation {impl!r}; expected one of {', '.join(IMPLS)}")
    if impl == "torch" or not x.is_cuda:
        return False
    if not triton_importable():
        raise RuntimeError(
            "kernels='fused' needs Triton for CUDA tensors, and it cannot be imported; install the triton that "
            "matches your torch, or use kernels='torch' (Engine(kernels='torch'), impl='torch')"
        )
    return True


def kernel_path(impl: str, x: Tensor) -> KernelPath:
    """What an entry point called with ``impl`` on ``x`` runs: ``"torch"`` (the reference, traced as plain ops when
    compiled), ``"triton"`` (the launcher, eager on CUDA) or ``"op"`` (the kernel's custom op, while dynamo traces
    the fused path on any device: opaque to the compiler, with a fake kernel for its shapes).

    Eager calls never go through the op: the dispatcher round trip would cost host time on every call.

    Example:
        >>> kernel_path("fused", torch.zeros(2)), kernel_path("torch", torch.zeros(2))
        ('torch', 'torch')

    Raises:
        RuntimeError: ``"fused"`` was asked for a CUDA tensor but Triton cannot be imported.
    """
    if torch.compiler.is_compiling() and impl == "fused":
        use_fused(impl, x)  # the same checks: a CUDA trace needs Triton for the op's CUDA kernel
        return "op"
    return "triton" if use_fused(impl, x) else "torch"


@functools.cache
def num_sms(device: torch.device) -> int:
    """The CUDA device's streaming multiprocessors (what the split matmuls size their grids by)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
