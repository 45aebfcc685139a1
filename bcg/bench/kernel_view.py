"""The per-kernel view of one profiled prefill: how many kernels ran, how many the host launched one by one, kernels
a layer, and the kernels by name, costliest first (``benchmarks/device_bound.py`` prints it per model and length)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bcg.bench.timing import sync
from bcg.bench.trace import Kernel, innermost, is_launch, kernels_from_events

__all__ = ["eager_ops", "kernel_view", "profile_kernels"]


def kernel_view(kernels: Sequence[Kernel], num_layers: int, eager_ops: dict[str, int]) -> dict[str, Any]:
    """The per-kernel view of one profiled prefill: counts, kernels a layer, the kernels by name (count, total µs,
    share of the summed kernel time), costliest first, and the kernels the host launched one by one, by the op
    that launched them (``eager_ops``), most first.

    Example::

        >>> view = kernel_view([Kernel("gemm", "aten::mm", 3.0), Kernel("gemm", "aten::mm", 5.0),
        ...                     Kernel("norm", "", 2.0)], num_layers=2, eager_ops={"aten::mm": 1})
        >>> view["kernels"], view["kernels_per_layer"], view["by_name"][0], view["eager_by_op"]
        (3, 1.5, {'name': 'gemm', 'count': 2, 'us': 8.0, 'share': 0.8}, [{'op': 'aten::mm', 'count': 1}])
    """
    count: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for k in kernels:
        count[k.name] += 1
        us[k.name] += k.device_us
    total = sum(us.values())
    by_name = [{"name": n, "count": count[n], "us": us[n], "share": us[n] / total if total else None}
               for n in sorted(us, key=lambda n: (-us[n], n))]
    eager = sum(eager_ops.values())
    return {"kernels": len(kernels), "eager_kernels": eager, "kernels_per_layer": len(kernels) / num_layers,
            "eager_per_layer": eager / num_layers, "kernel_ms": total / 1e3, "by_name": by_name,
            "eager_by_op": [{"op": op, "count": c} for op, c in sorted(eager_ops.items(), key=lambda x: (-x[1], x[0]))]}


def eager_ops(events: Sequence[Any]) -> dict[str, int]:
    """The host's launch calls (kernels, copies, memsets; a graph launch is not one) by the innermost aten op around
    each: on CUDA, what the islands and the eager code launched one by one."""
    from torch.autograd import DeviceType

    ops = [(float(e.time_range.start), float(e.time_range.end), e.name) for e in events
           if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    launches = [float(e.time_range.start) for e in events if is_launch(e.name)]
    return dict(Counter(op or "(no aten op)" for op in innermost(ops, launches)))


def profile_kernels(fn: Callable[[], Any], device: torch.device, num_layers: int) -> dict[str, Any]:
    """:func:`kernel_view` of one call of ``fn`` (after one unprofiled call). On a CPU every op is eager."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    events = prof.events()
    kernels = kernels_from_events(events, cuda).kernels
    return kernel_view(kernels, num_layers, eager_ops(events) if cuda else dict(Counter(k.name for k in kernels)))
