"""``bcg analyze --validate``: build every predicted variant for real, measure it, and put it next to its prediction.

Each variant's engine is built as ``bcg bench`` builds it (:func:`~bcg.bench.engines.engine_for`: capture ceiling and
ladder of the run, its kernels and compiler), its build time and resident graph memory are read from its telemetry,
and one request's prefill is timed at every length (under each ``--cpu-cores`` count too, pinned). For the first
breakable variant the replay of the representative length is also timed step by step, which gives the island share
``p`` of a replay as measured. A variant that cannot be built is recorded with its reason, so a wrong availability
prediction shows.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg.bench import amdahl
from bcg.bench.cores import pinned
from bcg.bench.engines import BuildRecord, EngineSpec, engine_for, make_prompts, one_batch
from bcg.bench.timing import Marks, sync, time_fn
from bcg.bench.variants import parse_variant

__all__ = ["Measured", "errors", "measure_variants", "replay_breakdown", "time_prefills"]


@dataclass
class Measured:
    """One variant built and timed: available or why not, prefill ms per length (and per core count), whether each
    length replayed a graph, its build time and resident graph memory, (breakable backends) its replay's steps at the
    representative length and at the shortest, and the timings left out because they measured the eager fallback
    (``fallbacks``, by ``"<length>"`` or ``"<length>@<cores>"``)."""

    variant: str
    available: bool
    error: str | None = None
    ms: dict[int, float] = field(default_factory=dict)
    graph_used: dict[int, bool] = field(default_factory=dict)
    by_cores: dict[int, dict[int, float]] = field(default_factory=dict)
    build_ms: float | None = None
    graph_memory_bytes: int | None = None
    num_segments: int | None = None
    num_breaks: int | None = None
    replay: dict[str, Any] | None = None
    replay_short: dict[str, Any] | None = None  # the same at the shortest length (the host-bound end)
    fallbacks: dict[str, str] = field(default_factory=dict)  # "<length>" or "<length>@<cores>": why it ran eagerly


def prompt_for(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    """The prompt every measurement of ``length`` tokens uses, predicted or measured (as ``bcg bench``'s)."""
    return make_prompts([length], vocab_size, seed + length)[0]


def measure_variants(spec: EngineSpec, variants: Sequence[str], lengths: Sequence[int], length: int, runs: int,
                     warmup: int, seed: int, cores: Sequence[int | None] = (None,)) -> dict[str, Measured]:
    """Builds, measures and frees each variant in turn (see the module doc); returns them by name.

    Under a core count, a variant that runs dynamo (``tc_piecewise``, ``compile=``) is built again inside the pinned
    block: dynamo guards on torch's thread count, so an engine compiled with the process's threads fails its guard
    under fewer, recompiles at every replay and falls back to eager. A timing during which any prefill that should
    have replayed its graph ran eagerly is recorded as that fallback (``fallbacks``), never as the variant's latency.

    Example::

        got = measure_variants(cfg.engine_spec(), ["breakable", "full"], [64, 512], 512, runs=20, warmup=5, seed=0)
        got["full"].ms[512], got["breakable"].graph_memory_bytes
    """
    out: dict[str, Measured] = {}
    for variant in variants:
        record = BuildRecord(variant)
        with engine_for(spec, variant, record) as eng:
            if eng is None:
                out[variant] = Measured(variant, False, record.error)
                continue
            m = Measured(variant, True, build_ms=record.build_ms, graph_memory_bytes=record.graph_memory_bytes,
                         num_segments=record.num_segments, num_breaks=record.num_breaks)
            vocab = eng.model.config.vocab_size
            with torch.inference_mode():
                for n in lengths:
                    m.graph_used[n] = all(b.graph_used for b in eng.prefill([prompt_for(vocab, n, seed)]).batches)
            prompts = {n: prompt_for(vocab, n, seed) for n in {*lengths, length}}
            m.ms, fell = time_prefills(eng, {n: prompts[n] for n in lengths}, runs, warmup)
            m.fallbacks.update({f"{n}": why for n, why in fell.items()})
            if not _runs_dynamo(variant):
                for k in (k for k in cores if k is not None):
                    with pinned(k):
                        _store(m, k, *time_prefills(eng, {length: prompts[length]}, runs, warmup))
            if parse_variant(variant).backend == "breakable":  # its replay step by step: where the time goes
                m.replay = replay_breakdown(eng, prompts[length], runs, warmup)
                if min(lengths) != length:
                    m.replay_short = replay_breakdown(eng, prompts[min(lengths)], runs, warmup)
        if _runs_dynamo(variant) and m.available:
            for k in (k for k in cores if k is not None):
                _measure_rebuilt(spec, variant, m, k, prompt_for(vocab, length, seed), length, runs, warmup)
        out[variant] = m
    return out


def _runs_dynamo(variant: str) -> bool:
    """Whether the variant's engine runs torch.compile (whose guards read torch's thread count)."""
    v = parse_variant(variant)
    return v.backend == "tc_piecewise" or v.compile is not None


def _store(m: Measured, cores: int, timed: dict[int, float], fell: dict[int, str]) -> None:
    m.by_cores[cores] = timed
    m.fallbacks.update({f"{n}@{cores}": why for n, why in fell.items()})


def _measure_rebuilt(spec: EngineSpec, variant: str, m: Measured, cores: int, prompt: torch.Tensor, length: int,
                     runs: int, warmup: int) -> None:
    """Builds ``variant`` again pinned to ``cores`` (so its compile sees that thread count) and times ``length``."""
    record = BuildRecord(variant)
    with pinned(cores), engine_for(spec, variant, record) as eng:
        if eng is None:
            m.fallbacks[f"{length}@{cores}"] = f"could not be built on {cores} cores: {record.error}"
            m.by_cores[cores] = {}
            return
        _store(m, cores, *time_prefills(eng, {length: prompt}, runs, warmup))


def time_prefills(eng: Any, prompts: dict[int, torch.Tensor], runs: int, warmup: int
                  ) -> tuple[dict[int, float], dict[int, str]]:
    """The median prefill ms of each prompt (by length), and for each length where a prefill that should replay a
    graph ran eagerly instead (a failed replay, a disabled bucket) why: such a timing measures the eager fallback, so
    it is left out of the first dict.

    Example::

        ms, fell = time_prefills(eng, {512: prompt}, runs=10, warmup=3)
        ms.get(512), fell.get(512)       # e.g. 3.52, None
    """
    timed: dict[int, float] = {}
    fell: dict[int, str] = {}
    for n, prompt in prompts.items():
        bucket, _ = eng.runner.choose(n)
        eager: list[str] = []

        def run(p: torch.Tensor = prompt, expected: bool = bucket is not None, eager: list[str] = eager) -> None:
            for b in eng.prefill([p]).batches:
                if (expected and not b.graph_used) or b.reason == "replay_failed":
                    eager.append(b.reason)

        with torch.inference_mode():
            ms = time_fn(run, eng.device, runs=runs, warmup=warmup).median_ms
        if eager:
            fell[n] = (f"{len(eager)} of {runs + warmup} prefills of {n} tokens ran eagerly instead of replaying "
                       f"({eager[0]}); their timing is the eager fallback's, not this backend's")
        else:
            timed[n] = ms
    return timed, fell


def errors(predicted: dict[str, dict[int, float]], measured: dict[str, Measured]) -> dict[str, dict[int, float]]:
    """``predicted / measured - 1`` per variant and length, where both exist."""
    out: dict[str, dict[int, float]] = {}
    for name, by_len in predicted.items():
        m = measured.get(name)
        if m is None or not m.available:
            continue
        out[name] = {n: amdahl.prediction_error(ms, m.ms[n]) for n, ms in by_len.items() if m.ms.get(n)}
    return out


def replay_breakdown(eng: Any, prompt: torch.Tensor, runs: int, warmup: int) -> dict[str, Any]:
    """Times each step of one bucket's breakable replay (islands grouped by name), the host time to launch the
    replay, and the eager work around it; the measured ``p`` is the islands' share of the replay."""
    from bcg.graph import EagerStep

    runner, device = eng.runner, eng.device
    bucket, reason = runner.choose(prompt.numel())
    if bucket is None:
        return {"bucket": None, "note": f"a {prompt.numel()}-token batch does not replay a graph ({reason})"}
    batch, slots = one_batch(eng, prompt)
    try:
        with torch.inference_mode():
            outside = time_fn(lambda: _enter_exit(runner, batch), device, runs=runs, warmup=warmup)
            with runner.replay_context(batch) as (bucket, handle):
                steps = list(handle.steps)
                whole = time_fn(handle.replay, device, runs=runs, warmup=warmup)
                host_ms = _host_launch_ms(handle.replay, device, runs, warmup)
                per_run: list[list[float]] = []
                for i in range(warmup + runs):
                    marks = Marks(device, capacity=len(steps) + 1)
                    marks.mark()
                    for step in steps:
                        step() if isinstance(step, EagerStep) else step.replay()
                        marks.mark()
                    if i >= warmup:
                        per_run.append(marks.deltas_ms())
    finally:
        eng.kv_pool.free(slots)
    is_island = [isinstance(s, EagerStep) for s in steps]
    seg = statistics.median(sum(d for d, isl in zip(run, is_island) if not isl) for run in per_run)
    names: dict[str, list[int]] = defaultdict(list)
    for idx, step in enumerate(steps):
        if is_island[idx]:
            names[step.name].append(idx)
    islands = [{"name": name, "count": len(idxs),
                "ms": statistics.median(sum(run[i] for i in idxs) for run in per_run)} for name, idxs in names.items()]
    isl = sum(i["ms"] for i in islands)
    for i in islands:
        i["share"] = i["ms"] / (seg + isl) if seg + isl > 0 else None
    islands.sort(key=lambda i: -i["ms"])
    return {
        "bucket": bucket, "num_segments": len(steps) - sum(is_island), "num_breaks": sum(is_island),
        "segments_ms": seg, "islands_ms": isl, "outside_ms": outside.median_ms, "replay_ms": whole.median_ms,
        "replay_host_ms": host_ms, "host_over_device": host_ms / whole.median_ms,
        "p": amdahl.island_fraction(isl, seg + isl) if seg + isl > 0 else None, "islands": islands,
    }


def _host_launch_ms(fn: Any, device: torch.device, runs: int, warmup: int) -> float:
    """Median host time for ``fn`` to return from an idle device, not waiting for it."""
    samples = []
    for i in range(warmup + runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(samples)


def _enter_exit(runner: Any, batch: Any) -> None:
    # Loading the static buffers and setting the context: the eager work around a replay.
    with runner.replay_context(batch):
        pass
