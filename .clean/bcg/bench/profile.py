"""Measuring one eager forward for the predictions, unprofiled: its host times.

Nothing here captures a graph or compiles. :func:`host_times` times ``Engine.prefill`` of a prompt on an eager
engine, and inside it ``runner.forward`` with every island call timed on the host
(:func:`bcg.islands.observing_islands` runs each one), and the load of the batch into its fields (the eager work
before a replay), for the live attention and for the static attention ``full`` captures (:class:`FullStep`).
:mod:`bcg.bench.profiled` then profiles the same forwards. Host times come first: once loaded, the profiler slows
later host work (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bcg.bench.engines import one_batch
from bcg.bench.predict import HostTimes
from bcg.bench.timing import Marks, sync
from bcg.islands import observing_islands
from bcg.tensors import tensor_leaves

__all__ = ["MIN_RUNS", "REPEATABLE", "SETTLED", "FullStep", "IslandTimer", "host_times", "settled", "spread"]


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

    def __init__(self, repeats: int = 0) -> None:
        self.us: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, float] = {}
        self.repeats = repeats
        self.steady_us: dict[str, tuple[float, float, float]] = {}  # name -> spread of the back-to-back calls

    def __call__(self, fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        if name not in self.bytes:
            self.bytes[name] = float(sum(t.numel() * t.element_size() for t in tensor_leaves((args, kwargs))))
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            self.us[name] += (time.perf_counter() - t0) * 1e6
            self.calls[name] += 1
        if self.repeats and name in REPEATABLE and name not in self.steady_us:
            self.steady_us[name] = _steady_us(fn, args, kwargs, self.repeats)
        return out


STEADY_REPEATS = 10  # back-to-back calls of a repeatable island (a few ms of an analyze run in all)
# Islands that give the same result when called again on the same arguments (they read their inputs and overwrite
# their output, or return a new tensor), so their host cost can be measured by calling them back to back.
REPEATABLE = frozenset({"attention_island", "select_topk"})


def _steady_us(fn: Callable, args: tuple, kwargs: dict, repeats: int) -> tuple[float, float, float]:
    """Host µs of ``fn`` called ``repeats`` more times back to back, no sync (:func:`spread`): the island as a replay
    runs it, between graph launches, rather than among an eager forward's launches (which slowed the same island by
    half to twice on the H200, most where the kernels around it are Triton's)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        samples.append((time.perf_counter() - t0) * 1e6)
    return spread(samples)


def _steady_islands(eng: Any, prompt: torch.Tensor, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Each repeatable island's host µs per call, back to back (:func:`_steady_us`), in one more prefill of ``prompt``
    that nothing else is timed in (the repeats would tax the forward's own times)."""
    timer = IslandTimer(repeats=repeats)
    with torch.inference_mode(), observing_islands(timer):
        eng.prefill([prompt])
    sync(eng.device)
    return timer.steady_us


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


# Host times stop early once their spread says more runs would not move the median: after MIN_RUNS timed runs of
# each series, when every wall-time series' interquartile range is within SETTLED of its median.
MIN_RUNS = 5
SETTLED = 0.02


def settled(samples: Sequence[float], min_runs: int | None = None, within: float | None = None) -> bool:
    """Whether ``samples`` are enough: at least ``min_runs`` (default :data:`MIN_RUNS`), their interquartile range
    within ``within`` (default :data:`SETTLED`) of their median (the interval a prediction takes from them is then
    that narrow).

    Example::

        >>> settled([10.0, 10.1, 9.9, 10.0, 10.05]), settled([10.0, 12.0, 9.0, 10.0, 11.0]), settled([10.0, 10.0])
        (True, False, False)
    """
    if len(samples) < (MIN_RUNS if min_runs is None else min_runs):
        return False
    median, low, high = spread(samples)
    return median > 0 and (high - low) <= (SETTLED if within is None else within) * median


def _agree(last_two: Sequence[float]) -> bool:
    """Two warm-up runs within :data:`SETTLED` of each other: a size's one-time costs are behind it."""
    return len(last_two) == 2 and abs(last_two[1] - last_two[0]) <= SETTLED * max(last_two[0], 1e-12)


class _Timed:
    """``runner.forward`` wrapped for :func:`host_times`: on an observed call every island call is timed and the
    forward is marked on the device (its wall time from an idle device, and its host time); on every call the clock
    is read as it enters and leaves (the engine's work before and after it)."""

    def __init__(self, forward: Callable[[Any], Any], device: torch.device, timer: IslandTimer) -> None:
        self.forward, self.device, self.timer = forward, device, timer
        self.observed = False
        self.enter = self.leave = 0.0
        self.wall_ms = self.host_us = 0.0

    def __call__(self, batch: Any) -> Any:
        if not self.observed:
            self.enter = time.perf_counter()
            try:
                return self.forward(batch)
            finally:
                self.leave = time.perf_counter()
        self.timer.us.clear()
        self.timer.calls.clear()
        marks = Marks(self.device, capacity=2)
        self.enter = time.perf_counter()  # the engine's work before the forward ends here, not after the sync
        marks.mark()  # syncs first: the forward starts from an idle device
        start = time.perf_counter()
        try:
            with observing_islands(self.timer):
                return self.forward(batch)
        finally:
            self.leave = time.perf_counter()
            marks.mark()
            self.wall_ms, self.host_us = marks.deltas_ms()[0], (self.leave - start) * 1e6


def host_times(eng: Any, prompt: torch.Tensor, runs: int, warmup: int, full: FullStep | None = None) -> HostTimes:
    """The :class:`~bcg.bench.predict.HostTimes` of ``prompt``'s eager forward on ``eng`` (an eager engine),
    at the median of the timed runs, with the same at their lower and upper quartile as ``low`` and ``high``;
    ``full`` also times the load into the static attention's fields.

    One loop of ``Engine.prefill`` calls times everything: after at most ``warmup`` untimed ones (fewer once two in a
    row took times within :data:`SETTLED` of each other: the one-time costs of a new size are paid), each call is
    observed (each island call timed, the forward marked on the device: the forward's wall and host time, the
    islands') and gives the prefill's wall time and the engine's work before and after the forward too, taxed by the
    island timer's clock reads (about a µs an island call, tens of µs in an eager forward of milliseconds; plain calls
    of their own for them doubled the runs). At most ``runs`` timed runs, fewer once every series has settled
    (:func:`settled`).

    Example::

        with engine_for(spec, "eager") as eng:
            host = host_times(eng, prompt, runs=20, warmup=5)
        host.forward_ms, host.island_us["attention_island"], host.high.forward_ms
    """
    device, runner = eng.device, eng.runner
    timer = IslandTimer()
    timed = _Timed(runner.forward, device, timer)
    walls, hosts, islands, prefill, pre, post = [], [], [], [], [], []
    calls: dict[str, int] = {}
    warm: list[float] = []
    runner.forward = timed
    try:
        with torch.inference_mode():
            for _ in range(warmup + max(runs, 1)):
                warming = len(warm) < warmup and not _agree(warm[-2:])
                timed.observed = not warming
                marks = Marks(device, capacity=2)
                marks.mark()
                t0 = time.perf_counter()
                eng.prefill([prompt])
                t1 = time.perf_counter()
                marks.mark()
                wall = marks.deltas_ms()[0]
                if warming:
                    warm.append(wall)
                    continue
                walls.append(timed.wall_ms)
                hosts.append(timed.host_us / 1e3)
                islands.append(dict(timer.us))
                calls = dict(timer.calls)
                prefill.append(wall)
                pre.append((timed.enter - t0) * 1e6)
                post.append((t1 - timed.leave) * 1e6)
                if len(prefill) >= runs or (settled(walls) and settled(prefill)):
                    break
    finally:
        del runner.forward  # the class's method again
    load, full_load = _loads(eng, prompt, max(runs, 5), full)
    per_call = {n: spread([run.get(n, 0.0) / max(c, 1) for run in islands]) for n, c in calls.items()}
    # A repeatable island at its back-to-back cost: what a replay pays (an eager forward's taxes it).
    per_call.update({n: t for n, t in _steady_islands(eng, prompt, STEADY_REPEATS).items() if n in per_call})
    cols = [spread(walls), spread(hosts), spread(prefill), spread(load),
            spread(full_load) if full_load else (None, None, None), spread(pre), spread(post)]
    out = [HostTimes(num_tokens=prompt.numel(), forward_ms=cols[0][i], host_ms=cols[1][i], prefill_ms=cols[2][i],
                     load_us=cols[3][i], full_load_us=cols[4][i], island_us={n: v[i] for n, v in per_call.items()},
                     island_calls=calls, island_bytes=dict(timer.bytes), prefill_pre_us=cols[5][i],
                     prefill_post_us=cols[6][i], runs=len(prefill), warmups=len(warm)) for i in range(3)]
    out[0].low, out[0].high = out[1], out[2]
    return out[0]


def _loads(eng: Any, prompt: torch.Tensor, reps: int, full: FullStep | None) -> tuple[list[float], list[float] | None]:
    """Host µs of loading the batch into the live attention's fields, and into the static attention's (None when
    ``full`` is None or cannot stage the batch)."""
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            load = _host_samples(lambda: eng.runner.inputs.load_live(batch), eng.device, reps)
            full_load = None
            if full is not None:
                try:
                    full_load = _host_samples(lambda: full.load(batch), eng.device, reps)
                except Exception:  # full cannot stage this batch: its forecast says why (bcg.bench.profiled)
                    full_load = None
    finally:
        eng.kv_pool.free(slots)
    return load, full_load


