"""Profiling the eager forwards for the predictions: every size's kernels, in as few profiler sessions as it takes.

:func:`profile_settings` profiles, for every kernels setting's eager engine and every size, the eager forward with
every island call annotated (:mod:`bcg.bench.trace` reads the annotations back) and the same step run under the
static attention (``full``'s graph: where that run fails, or calls an island, ``full`` cannot capture the model), each
:data:`PROFILE_REPEATS` times, all in one profiler session: each forward runs inside its own range
(:func:`~bcg.bench.kineto.forward_label`) and :func:`~bcg.bench.kineto.split_forwards` cuts the session's records
into forwards. A size whose profiles disagree (another kernel sequence, or a device time more than
:data:`PROFILE_AGREE` apart) gets profiled again, up to :data:`PROFILE_MAX` times, in a second session; each kernel's
device time is then the median over a size's profiles and their range its interval
(:func:`~bcg.bench.trace.combine_traces`). Starting and stopping the profiler and reading its records is most of what
a profile costs, so one session for everything is much of the difference; the records are read with the garbage
collector held off (:func:`bcg.collector.held`), which halves the reading.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bcg.bench.engines import one_batch
from bcg.bench.forecast import Profiled
from bcg.bench.kineto import cpu_peak_bytes, forward_label, profile_events, split_forwards
from bcg.bench.predict import HostTimes
from bcg.bench.profile import FullStep
from bcg.bench.quiet_profiler import quiet_profile
from bcg.bench.timing import sync
from bcg.bench.trace import ForwardTrace, combine_traces, island_label, kernels_from_events
from bcg.collector import held
from bcg.errors import first_line
from bcg.islands import observing_islands

__all__ = ["PROFILE_AGREE", "PROFILE_MAX", "PROFILE_REPEATS", "agree", "profile_settings", "profile_sizes"]

PROFILE_REPEATS = 2  # profiles of each forward in the first session
PROFILE_MAX = 3  # at most, for a forward whose first profiles disagree
PROFILE_AGREE = 0.02  # two profiles agree when their device times are this close (and their kernels the same)
NOT_PROFILED = "the full step was not profiled: no full variant runs these kernels"


def agree(traces: list[ForwardTrace], within: float | None = None) -> bool:
    """Whether ``traces`` are the same kernels with device times within ``within`` (default
    :data:`PROFILE_AGREE`) of each other: more profiles would not move the median much.

    Example::

        >>> from bcg.bench.trace import Kernel
        >>> t = [ForwardTrace([Kernel("mm", "aten::mm", us)]) for us in (10.0, 10.1)]
        >>> agree(t), agree([*t, ForwardTrace([Kernel("mm", "aten::mm", 12.0)])])
        (True, False)
    """
    if len({tuple(k.name for k in t.kernels) for t in traces}) > 1:
        return False
    totals = [t.device_us for t in traces]
    within = PROFILE_AGREE if within is None else within
    return max(totals) - min(totals) <= within * max(max(totals), 1e-9)


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


class _Run:
    """One profiled forward: its range's tag, the islands it called, its activation peak on CUDA."""

    def __init__(self, tag: str) -> None:
        self.tag, self.islands, self.peak = tag, [], None

    def __call__(self, device: torch.device, fn: Callable[..., Any], *args: Any) -> None:
        from torch.profiler import record_function

        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with record_function(forward_label(self.tag)), _annotated() as names:
            fn(*args)
            sync(device)  # the forward's kernels end inside its range
        self.islands = names
        if cuda:
            self.peak = float(torch.cuda.max_memory_allocated(device) - base)


# One profiler session's work: per kernels setting, its eager engine, the prompt of each size and the profiles of each
Jobs = dict[str, tuple[Any, dict[int, torch.Tensor], dict[int, int]]]
# One profiled run: its trace, its activation peak, the islands it called
Got = tuple[ForwardTrace, float | None, list[str]]


def _session(jobs: Jobs, full_errors: dict[str, dict[int, str] | None], seconds: dict[str, float]
             ) -> dict[tuple[str, str, int], list[Got]]:
    """One profiler session for every setting of ``jobs``: per size, as many profiled eager forwards as asked and as
    many of the full step (sizes in ``full_errors[setting]`` skip it, and so does a setting whose ``full_errors`` is
    None; a size whose full step fails gets its error there). Returns the runs by (setting, "eager" or "full",
    size); adds to ``seconds`` the time spent running the session ("run"; of it, starting and stopping the profiler:
    "start", "stop") and reading its records ("read")."""
    from torch.profiler import ProfilerActivity

    devices = {eng.device for eng, _, _ in jobs.values()}
    cuda = any(d.type == "cuda" for d in devices)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runs: dict[tuple[str, str, int], list[_Run]] = {}
    for d in devices:
        sync(d)
    t0 = time.perf_counter()
    with quiet_profile(activities=activities, profile_memory=not cuda) as prof, torch.inference_mode():
        t_in = time.perf_counter()
        for setting, (eng, prompts, counts) in jobs.items():
            _profile_engine(setting, eng, prompts, counts, full_errors.get(setting), runs)
        t_out = time.perf_counter()
    t1 = time.perf_counter()
    with held():  # hundreds of thousands of records, none garbage: a collection would walk the heap again and again
        by_tag = split_forwards(profile_events(prof))
        out = {key: [(kernels_from_events(by_tag.get(run.tag, []), cuda),
                      run.peak if cuda else cpu_peak_bytes(by_tag.get(run.tag, [])), run.islands) for run in rs]
               for key, rs in runs.items()}
    for name, dt in (("run", t1 - t0), ("start", t_in - t0), ("stop", t1 - t_out), ("read", time.perf_counter() - t1)):
        seconds[name] = seconds.get(name, 0.0) + dt
    return out


def _profile_engine(setting: str, eng: Any, prompts: dict[int, torch.Tensor], counts: dict[int, int],
                    full_errors: dict[int, str] | None, runs: dict[tuple[str, str, int], list[_Run]]) -> None:
    """One setting's part of a session (:func:`_session`): its runs added to ``runs`` (no full step where
    ``full_errors`` is None)."""
    device = eng.device
    for n, count in counts.items():
        batch, slots = one_batch(eng, prompts[n])
        try:
            for r in range(count):
                run = _Run(f"{setting}/eager:{n}#{r}")
                run(device, eng.runner.forward, batch)
                runs.setdefault((setting, "eager", n), []).append(run)
            if full_errors is None or n in full_errors:
                continue
            try:
                step = FullStep(eng, n)
                step.run(batch)  # its first run stages the static fields: outside every range
                for r in range(count):
                    run = _Run(f"{setting}/full:{n}#{r}")
                    run(device, step.run, batch)
                    runs.setdefault((setting, "full", n), []).append(run)
            except Exception as e:  # what full's capture would hit: the forecast reports it
                full_errors[n] = first_line(e)
                runs.pop((setting, "full", n), None)
        finally:
            eng.kv_pool.free(slots)


def profile_sizes(eng: Any, prompts: dict[int, torch.Tensor], hosts: dict[int, HostTimes],
                  repeats: int = PROFILE_REPEATS, most: int = PROFILE_MAX, warm: bool = False,
                  seconds: dict[str, float] | None = None) -> dict[int, Profiled]:
    """The :class:`~bcg.bench.forecast.Profiled` forward of every size in ``prompts`` on ``eng`` (an eager engine
    whose host times ``hosts`` holds): :func:`profile_settings` for one engine.

    Example::

        ps = profile_sizes(eng, {64: prompt64, 512: prompt512}, hosts)
        len(ps[512].trace.kernels), ps[512].trace_high.device_us, ps[512].full_error
    """
    return profile_settings({"": (eng, prompts, hosts)}, repeats, most, warm, seconds)[""]


def profile_settings(jobs: dict[str, tuple[Any, dict[int, torch.Tensor], dict[int, HostTimes]]],
                     repeats: int = PROFILE_REPEATS, most: int = PROFILE_MAX, warm: bool = False,
                     seconds: dict[str, float] | None = None, full: Collection[str] | None = None
                     ) -> dict[str, dict[int, Profiled]]:
    """Per kernels setting of ``jobs`` (its eager engine, a prompt per size, the host times of each size), the
    :class:`~bcg.bench.forecast.Profiled` forward of every size, from ``repeats`` profiles each, and up to ``most``
    where they disagree (see the module doc), every setting in the same sessions. ``warm`` first runs each size once
    unprofiled, for an engine that has not run them yet (a size's first forward pays one-time costs that are no part
    of its kernels' times). ``seconds`` gets the time spent running the profiled forwards ("run", of which "start"
    and "stop": the profiler's own) and reading their records ("read") added. ``full`` names the settings whose full
    step is profiled (None: every one); the others' ``full_error`` says it was not (no ``full`` variant runs them).

    Example::

        ps = profile_settings({"torch": (eng, prompts, hosts), "fused": (fused_eng, prompts, fused_hosts)})
        ps["fused"][512].trace.device_us
    """
    if warm:
        for eng, prompts, _ in jobs.values():
            _warm(eng, prompts)
    full_errors: dict[str, dict[int, str] | None] = {s: {} if full is None or s in full else None for s in jobs}
    seconds = {} if seconds is None else seconds
    got = _session({s: (eng, prompts, {n: max(repeats, 1) for n in prompts}) for s, (eng, prompts, _) in jobs.items()},
                   full_errors, seconds)
    again = {s: {n: most - repeats for n in prompts if most > repeats and not all(
        agree([r[0] for r in got[(s, kind, n)]]) for kind in ("eager", "full") if got.get((s, kind, n)))}
        for s, (_, prompts, _) in jobs.items()}
    if any(again.values()):
        more = {s: (jobs[s][0], jobs[s][1], counts) for s, counts in again.items() if counts}
        for key, rs in _session(more, full_errors, seconds).items():
            got.setdefault(key, []).extend(rs)
    return {s: {n: _profiled(s, n, prompts[n], hosts[n], got, full_errors[s]) for n in prompts}
            for s, (_, prompts, hosts) in jobs.items()}


def _profiled(setting: str, n: int, prompt: torch.Tensor, host: HostTimes,
              got: dict[tuple[str, str, int], list[Got]], full_errors: dict[int, str] | None) -> Profiled:
    """One size's :class:`~bcg.bench.forecast.Profiled` from its runs in ``got``."""
    if full_errors is None:
        full_errors = {n: NOT_PROFILED}
    eager = got[(setting, "eager", n)]
    trace, low, high = combine_traces([r[0] for r in eager])
    p = Profiled(prompt.numel(), trace, host, activation_bytes=_max_peak(r[1] for r in eager),
                 trace_low=low, trace_high=high, profiles=len(eager))
    full = got.get((setting, "full", n))
    if n in full_errors or not full:
        p.full_error = full_errors.get(n, "the step full would capture left no profile")
    else:
        p.full_trace, p.full_trace_low, p.full_trace_high = combine_traces([r[0] for r in full])
        p.full_activation_bytes = _max_peak(r[1] for r in full)
        p.full_islands = list(dict.fromkeys(i for r in full for i in r[2]))
    return p


def _warm(eng: Any, prompts: dict[int, torch.Tensor]) -> None:
    with torch.inference_mode():
        for prompt in prompts.values():
            batch, slots = one_batch(eng, prompt)
            try:
                eng.runner.forward(batch)
            finally:
                eng.kv_pool.free(slots)
    sync(eng.device)


def _max_peak(peaks: Any) -> float | None:
    known = [p for p in peaks if p is not None]
    return max(known) if known else None
