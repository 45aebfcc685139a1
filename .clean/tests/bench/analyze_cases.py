"""Synthetic inputs of the prediction model with answers known by hand: profiler events, traces of a forward with
attention islands, host times and machine costs (shared by the tests/bench/test_analyze_*.py files)."""

from __future__ import annotations

from types import SimpleNamespace

from bcg.bench.forecast import Profiled
from bcg.bench.machine import MachineCosts
from bcg.bench.predict import HostTimes
from bcg.bench.trace import ForwardTrace, IslandCall, Kernel


def event(name: str, device: str, start: float, end: float, id_: int = 0, linked: int = 0, thread: int = 1):
    """A stand-in for one torch.profiler FunctionEvent."""
    return SimpleNamespace(name=name, device_type=f"DeviceType.{device}", id=id_, linked_correlation_id=linked,
                           time_range=SimpleNamespace(start=start, end=end), thread=thread)


def costs(**changes: float) -> MachineCosts:
    """Round numbers: a 10 µs eager launch, 1 µs per graph kernel (a 2 µs tiny kernel, so graphs save 1 µs a kernel),
    a 5 µs graph launch, 3 µs per break and 4 µs per piece, 1 KiB per node and 64 KiB per graph."""
    base = dict(device="cuda", emulated=False, eager_launch_us=10.0, eager_kernel_us=10.0, graph_kernel_us=1.0,
                graph_launch_us=5.0, graph_launch_per_node_us=0.0, break_us=3.0, piece_us=4.0, capture_per_node_us=12.0,
                capture_per_graph_us=100.0, graph_node_bytes=1024.0, graph_bytes=65536.0, tiny_kernel_us=2.0,
                guard_us=20.0, guard_per_param_us=0.5)
    base.update(changes)
    return MachineCosts(**base)


def layer_trace(num_layers: int = 2, mm_us: float = 20.0, pointwise_us: float = 3.0, attention_us: float = 8.0,
                with_kv_write: bool = True) -> ForwardTrace:
    """A forward of ``num_layers`` layers: per layer a norm and a rotary pointwise kernel, a qkv matmul, the K/V write
    (two index_copy_), the attention island's one kernel, then an output matmul and a residual add; a copy first
    (the batch's upload) and an LM-head matmul last. Host times increase by one per kernel."""
    kernels: list[Kernel] = []
    calls: list[IslandCall] = []
    t = [0.0]

    def add(name: str, op: str, us: float, island: str | None = None, copy: bool = False) -> None:
        t[0] += 1.0
        kernels.append(Kernel(name, op, us, island, copy, t[0]))

    add("Memcpy HtoD", "aten::copy_", 1.0, copy=True)
    for layer in range(num_layers):
        add("rms", "aten::mul", pointwise_us)
        add("gemm", "aten::mm", mm_us)
        add("rope", "aten::add", pointwise_us)
        if with_kv_write:
            add("index_copy", "aten::index_copy_", 1.0)
            add("index_copy", "aten::index_copy_", 1.0)
        t[0] += 0.5
        calls.append(IslandCall("attention_island", layer, t[0]))
        add("flash_fwd", "aten::_flash_attention_forward", attention_us, f"attention_island#{layer}")
        add("gemm", "aten::mm", mm_us)
        add("add", "aten::add", pointwise_us)
    add("gemm", "aten::mm", mm_us)
    return ForwardTrace(kernels, calls)


def host(n: int = 64, island_us: float = 30.0, prefill_ms: float = 1.5, forward_ms: float = 1.0,
         load_us: float = 20.0, calls: int = 2) -> HostTimes:
    return HostTimes(num_tokens=n, forward_ms=forward_ms, host_ms=0.9 * forward_ms, prefill_ms=prefill_ms,
                     load_us=load_us, full_load_us=load_us + 5.0, island_us={"attention_island": island_us},
                     island_calls={"attention_island": calls}, island_bytes={"attention_island": 1000.0 * n})


def profiled(n: int = 64, **trace: float) -> Profiled:
    t = layer_trace(**trace)
    full = ForwardTrace([k if k.island is None else Kernel(k.name, k.op, k.device_us, None, host_us=k.host_us)
                         for k in t.kernels])
    return Profiled(n, t, host(n), full_trace=full, activation_bytes=1e6 * n / 64, full_activation_bytes=2e6 * n / 64)
