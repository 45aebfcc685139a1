"""The fused kernels as ``torch.ops.bcg.*`` custom ops: one op per kernel, the same op on every device.

Each op is defined once with :func:`kernel_op`: its plain-torch reference is the kernel of every device (the CPU
included), its Triton launcher overrides that on CUDA, and a fake kernel gives ``torch.compile`` its output shapes
and strides without running anything. The entry points in :mod:`bcg.ops.kernels` call the op only while dynamo
traces (:func:`bcg.ops.kernels.dispatch.kernel_path`); eager code calls the launcher or the reference directly,
because a trip through the dispatcher and the Python ``custom_op`` wrapper costs tens of microseconds of host time on
every call (an RMSNorm of 4 rows on the development CPU: 98 us through the op, 34 us for its body) and the eager and
benchmark paths call these kernels per layer per forward. A graph replay pays nothing either way; compiled code
calls the op, but the graph backends run compiled code only at capture.

The ops are ``torch.library.custom_op`` everywhere, not ``triton_op``: a ``triton_op`` needs Triton importable where
it is defined, and the CPU machines, which trace and check these ops in CI, have none; one definition keeps the graph
the CPU traces the graph the GPU runs. Inductor calls a custom op as an opaque kernel, which is what it should do
with these (their roundings are the eager code's, see each module's notes).

Every op returns new tensors except ``fused_add_rms_norm_``, which writes its inputs in place: a decoder layer's
residual stream is an input of the compiled layer, and a functional op there would cost Inductor two more copies of
it per layer. Ops that write their inputs are fragile under Inductor (its ``auto_functionalized`` decomposition
asserts on some input layouts: a copy of a layer input redirected into a fresh tensor and then written), so every
entry point whose results go to new or redirected tensors traces a functional op and copies into the ``out=``
tensors, which Inductor removes where they are fresh.

Example:
    >>> import torch
    >>> from bcg.ops import kernels
    >>> sorted(KERNEL_OPS)[:3]
    ['add_rms_norm', 'clamped_swiglu', 'expert_order']
    >>> torch.ops.bcg.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KERNEL_OPS", "KernelOp", "kernel_op"]


@dataclass(frozen=True)
class KernelOp:
    """One registered kernel op: its ``torch.ops.bcg`` name, what it writes, and its three implementations
    (``reference``: every device; ``triton``: CUDA; ``fake``: shapes only). Tests read these to check each op and to
    run the Triton implementation under Triton's interpreter."""

    name: str
    mutates_args: tuple[str, ...]
    reference: Callable[..., Any]
    triton: Callable[..., Any]
    fake: Callable[..., Any]

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        """``torch.ops.bcg.<name>``."""
        return getattr(torch.ops.bcg, self.name)


# name -> its definition, in registration order.
KERNEL_OPS: dict[str, KernelOp] = {}


def kernel_op(name: str, *, mutates_args: tuple[str, ...], reference: Callable[..., Any],
              triton: Callable[..., Any], fake: Callable[..., Any]) -> KernelOp:
    """Registers ``torch.ops.bcg.<name>``: ``reference`` on every device, ``triton`` on CUDA, ``fake`` for tracing.

    The schema is read from ``reference``'s annotations, so its module must not use ``from __future__ import
    annotations``; ``triton`` and ``fake`` take the same arguments. ``triton`` imports its launcher when called, so
    a machine without Triton can define (and trace, and run on the CPU) every op.

    Example::

        kernel_op("rms_norm", mutates_args=(), reference=_rms_norm_reference, triton=_rms_norm_triton,
                  fake=lambda x, weight, eps: torch.empty_like(x))
    """
    if name in KERNEL_OPS:
        raise ValueError(f"bcg::{name} is registered twice")
    op = torch.library.custom_op(f"bcg::{name}", reference, mutates_args=mutates_args)
    op.register_kernel("cuda")(triton)
    op.register_fake(fake)
    spec = KernelOp(name, tuple(mutates_args), reference, triton, fake)
    KERNEL_OPS[name] = spec
    return spec
