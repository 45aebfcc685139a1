"""Which implementation a kernel entry point runs: the fused Triton kernel or its plain-torch reference.

Every entry point in :mod:`bcg.ops.kernels` takes ``impl=None | "fused" | "torch"``. ``None`` means the process
default, set with :func:`set_kernels` (or for a block with :func:`use_kernels`; ``BCG_KERNELS=torch`` in the
environment changes the initial default, a debug switch). ``"fused"`` runs the Triton kernel for CUDA tensors and
the reference for any other device, so one setting serves the CPU tests and the GPU alike. The default is a plain
module global rather than a ``ContextVar`` so that dynamo can trace (and guard on) it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor

__all__ = ["KernelImpl", "fused_available", "get_kernels", "set_kernels", "use_fused", "use_kernels"]

KernelImpl = Literal["fused", "torch"]
IMPLS: tuple[str, ...] = ("fused", "torch")


def _checked(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernels implementation {impl!r}; expected one of {', '.join(IMPLS)}")
    return impl


_DEFAULT: str = _checked(os.environ.get("BCG_KERNELS", "fused"))


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


def set_kernels(impl: KernelImpl) -> None:
    """Set the process default of every entry point called with ``impl=None``.

    Example:
        >>> set_kernels("torch"); get_kernels()
        'torch'
        >>> set_kernels("fused")
    """
    global _DEFAULT
    _DEFAULT = _checked(impl)


def get_kernels() -> str:
    """The process default implementation (``"fused"`` unless changed)."""
    return _DEFAULT


@contextmanager
def use_kernels(impl: KernelImpl) -> Iterator[None]:
    """Run the block with ``impl`` as the process default (not thread-local: meant for tests and benchmarks).

    Example:
        >>> with use_kernels("torch"):
        ...     get_kernels()
        'torch'
    """
    previous = get_kernels()
    set_kernels(impl)
    try:
        yield
    finally:
        set_kernels(previous)  # type: ignore[arg-type]


def use_fused(impl: str | None, x: Tensor) -> bool:
    """Whether an entry point called with ``impl`` on ``x`` runs its fused kernel.

    Raises:
        RuntimeError: ``"fused"`` was asked for a CUDA tensor but Triton cannot be imported.
    """
    impl = _DEFAULT if impl is None else _checked(impl)
    if impl == "torch" or not x.is_cuda:
        return False
    if not triton_importable():
        raise RuntimeError(
            "kernels='fused' needs Triton for CUDA tensors, and it cannot be imported; install the triton that "
            "matches your torch, or use kernels='torch' (set_kernels('torch'), BCG_KERNELS=torch)"
        )
    return True
