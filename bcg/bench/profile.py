"""Measuring one eager forward for the predictions: its host times unprofiled, then its kernels profiled.

Nothing here captures a graph or compiles. :func:`host_times` times ``runner.forward`` of an eager engine with every
island call timed on the host (:func:`bcg.islands.observing_islands` runs each one), ``Engine.prefill`` of the same
prompt, and the load of the batch into its fields (the eager work before a replay), for the live attention and for
the static attention ``full`` captures (:class:`FullStep`). :func:`profiled_forward` then profiles one forward with
every island call annotated (:mod:`bcg.bench.trace` reads the annotations back), and the same step run under the
static attention: where that run fails, or calls an island, ``full`` cannot capture the model. Host times come
first: once loaded, the profiler slows later host work (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from bcg.bench.engines import one_batch
from bcg.bench.forecast import Profiled
from bcg.bench.predict import HostTimes
from bcg.bench.quiet_profiler import quiet_profile
from bcg.bench.timing import Marks, sync
from bcg.bench.trace import ForwardTrace, combine_traces, island_label, kernels_from_events
from bcg.errors import first_line
from bcg.islands import observing_islands
from bcg.tensors import tensor_leaves

__all__ = ["FullStep", "IslandTimer", "host_times", "profiled_forward", "spread"]


class FullStep:
    """The step backend ``full`` would capture at ``bucket``, run eagerly on an eager engine's model: the batch staged
    into the static attention's fields (request slots, key capacity) and the step run under its forward context.

    Example::

        step = FullStep(eager_engine, bucket=512)
        step.run(batch)              # the kernels a full graph of bucket 512 would hold, or the error it would hit
    """

    def __init__(self, eng: Any, bucket: int) -> None:
        from bcg.runtime.backends.full import FullBackend
        from bcg.runtime.runner.inputs import StaticInputs

        runner, mc = eng.runner, eng.model.config
        # The engine's resolved config names its own attention backend; the full step attends with the static one.
        config = dataclasses.replace(eng.config, attention_backend=None)
        attention = FullBackend.make_attention(eng.kv_pool, config, eng.device, eng.dtype)
        self.step, self.bucket = runner.step, bucket
        self.inputs = StaticInputs(attention, runner.inputs.live_attention, eng.kv_pool, [bucket], mc.hidden_size,
                                   mc.vocab_size, eng.config.max_logit_rows, eng.device, eng.dtype)

    def load(self, batch: Any) -> Any:
        return self.inputs.load(batch, self.bucket)

    def run(self, batch: Any) -> None:
        from bcg.ops.context import forward_context

        loaded = self.load(batch)
        with forward_context(loaded.context):
            self.step(*self.inputs.step_args(self.bucket))


class IslandTimer:
    """An island observer (:func:`bcg.islands.observing_islands`) that runs each island call, adding its host time
    (``us``) and counting it (``calls``) by island name, and keeps each island's argument bytes of its first call.

    Example::

        timer = IslandTimer()
        with observing_islands(timer):
            eng.runner.forward(batch)
        timer.us["attention_island"] / timer.calls["attention_island"]     # host µs per call
    """

    def __init__(self) -> None:
        self.us: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, float] = {}

    def __call__(self, fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        if name not in self.bytes:
            self.bytes[name] = float(sum(t.numel() * t.element_size() for t in tensor_leaves((args, kwargs))))
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.us[name] += (time.perf_counter() - t0) * 1e6
            self.calls[name] += 1


def _host_samples(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    sync(device)
    return samples


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of ``samples``: the value a prediction uses and the bounds of its
    interval.

    Example::

        >>> spread([1.0, 2.0, 3.0, 4.0, 100.0])
        (3.0, 2.0, 4.0)
    """
    xs = list(samples)
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[0], q[2]


def host_times(eng: Any, prompt: torch.Tensor, runs: int, warmup: int, full: FullStep | None = None) -> HostTimes:
    """The :class:`~bcg.bench.predict.HostTimes` of ``prompt``'s eager forward on ``eng`` (an eager engine),
    ``runs`` timed after ``warmup`` untimed, at the median of the runs, with the same at their lower and upper
    quartile as ``low`` and ``high``; ``full`` also times the load into the static attention's fields.

    Example::

        with engine_for(spec, "eager") as eng:
            host = host_times(eng, prompt, runs=20, warmup=5)
        host.forward_ms, host.island_us["attention_island"], host.high.forward_ms
    """
    device = eng.device
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            walls, hosts, islands = [], [], []
            calls: dict[str, int] = {}
            timer = IslandTimer()
            for i in range(warmup + runs):
                timer.us.clear()
                timer.calls.clear()
                marks = Marks(device, capacity=2)
                marks.mark()
                t0 = time.perf_counter()
                with observing_islands(timer):
                    eng.runner.forward(batch)
                host_us = (time.perf_counter() - t0) * 1e6
                marks.mark()
                wall = marks.deltas_ms()[0]
                if i >= warmup:
                    walls.append(wall)
                    hosts.append(host_us)
                    islands.append(dict(timer.us))
                    calls = dict(timer.calls)
            load = _host_samples(lambda: eng.runner.inputs.load_live(batch), device, max(runs, 5))
            full_load = None
            if full is not None:
                try:
                    full_load = _host_samples(lambda: full.load(batch), device, max(runs, 5))
                except Exception:  # full cannot stage this batch: its forecast says why (profiled_forward)
                    full_load = None
        prefill, pre, post = _prefill(eng, prompt, runs, warmup)
    finally:
        eng.kv_pool.free(slots)
    per_call = {n: spread([run.get(n, 0.0) / max(c, 1) for run in islands]) for n, c in calls.items()}
    cols = [spread(walls), spread([h / 1e3 for h in hosts]), spread(prefill), spread(load),
            spread(full_load) if full_load else (None, None, None), spread(pre), spread(post)]
    out = [HostTimes(num_tokens=prompt.numel(), forward_ms=cols[0][i], host_ms=cols[1][i], prefill_ms=cols[2][i],
                     load_us=cols[3][i], full_load_us=cols[4][i], island_us={n: v[i] for n, v in per_call.items()},
                     island_calls=calls, island_bytes=dict(timer.bytes), prefill_pre_us=cols[5][i],
                     prefill_post_us=cols[6][i]) for i in range(3)]
    out[0].low, out[0].high = out[1], out[2]
    return out[0]


def _prefill(eng: Any, prompt: torch.Tensor, runs: int, warmup: int) -> tuple[list[float], list[float], list[float]]:
    """(wall ms, µs before, µs after the forward) of each timed ``Engine.prefill`` of ``prompt``: the runner's
    ``forward`` is wrapped with two clock reads for the measurement and given back after."""
    runner, device = eng.runner, eng.device
    forward = runner.forward
    enter: list[float] = []
    leave: list[float] = []

    def timed(batch: Any) -> Any:
        enter.append(time.perf_counter())
        try:
            return forward(batch)
        finally:
            leave.append(time.perf_counter())

    walls, pre, post = [], [], []
    runner.forward = timed
    try:
        for i in range(warmup + runs):
            marks = Marks(device, capacity=2)
            marks.mark()
            t0 = time.perf_counter()
            eng.prefill([prompt])
            t1 = time.perf_counter()
            marks.mark()
            wall = marks.deltas_ms()[0]
            if i >= warmup:
                walls.append(wall)
                pre.append((enter[-1] - t0) * 1e6)
                post.append((t1 - leave[-1]) * 1e6)
    finally:
        del runner.forward  # the class's method again
    return walls, pre, post


@contextmanager
def _annotated() -> Iterator[list[str]]:
    """Every island call of the block inside a profiler range named :func:`~bcg.bench.trace.island_label`; yields
    the names called, in order."""
    from torch.profiler import record_function

    names: list[str] = []

    def call(fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        with record_function(island_label(name, len(names))):
            names.append(name)
            return fn(*args, **kwargs)

    with observing_islands(call):
        yield names


def _profile(fn: Callable[[], Any], device: torch.device) -> tuple[ForwardTrace, float | None, list[str]]:
    """Runs ``fn`` once under the profiler: its trace, its activation peak in bytes, the islands it called."""
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with quiet_profile(activities=activities, profile_memory=not cuda) as prof, _annotated() as names:
        fn()
        sync(device)
    events = prof.events()
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else _cpu_peak(events)
    return kernels_from_events(events, cuda), float(peak) if peak is not None else None, names


def _cpu_peak(events: Any) -> float | None:
    """The most CPU memory the profiled block held above where it started, from the profiler's allocation events."""
    # An op's allocations are its own and its children's: each op counts what it holds net of its children (its
    # self memory), and frees outside any op are "[memory]" events of their own.
    deltas = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in events if str(e.device_type).endswith("CPU"))
    if not any(d for _, d in deltas):
        return None
    held = peak = 0.0
    for _, delta in deltas:
        held += delta
        peak = max(peak, held)
    return peak


def profiled_forward(eng: Any, prompt: torch.Tensor, host: HostTimes, bucket: int, repeats: int = 3) -> Profiled:
    """``repeats`` profiled eager forwards of ``prompt`` on ``eng``, and as many of the step ``full`` would capture
    at ``bucket`` run eagerly (its error, when it fails, is why ``full`` cannot capture this model); each kernel's
    device time is the median over the profiles, its lowest and highest bound the interval
    (:func:`~bcg.bench.trace.combine_traces`), so no single noisy forward decides a prediction.

    Example::

        p = profiled_forward(eng, prompt, host, bucket=512)
        len(p.trace.kernels), p.trace_high.device_us, p.full_error
    """
    device = eng.device
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            eng.runner.forward(batch)
            runs = [_profile(lambda: eng.runner.forward(batch), device) for _ in range(max(repeats, 1))]
            trace, low, high = combine_traces([r[0] for r in runs])
            profiled = Profiled(prompt.numel(), trace, host, activation_bytes=_max_peak(r[1] for r in runs),
                                trace_low=low, trace_high=high)
            try:
                step = FullStep(eng, bucket)
                step.run(batch)
                fulls = [_profile(lambda: step.run(batch), device) for _ in range(max(repeats, 1))]
                profiled.full_trace, profiled.full_trace_low, profiled.full_trace_high = combine_traces(
                    [r[0] for r in fulls])
                profiled.full_activation_bytes = _max_peak(r[1] for r in fulls)
                profiled.full_islands = list(dict.fromkeys(n for r in fulls for n in r[2]))
            except Exception as e:  # what full's capture would hit: the forecast reports it
                profiled.full_error = first_line(e)
    finally:
        eng.kv_pool.free(slots)
    return profiled


def _max_peak(peaks: Iterable[float | None]) -> float | None:
    known = [p for p in peaks if p is not None]
    return max(known) if known else None
