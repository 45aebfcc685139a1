"""The load experiment of ``bcg load``: an open-loop stream of requests through :meth:`Engine.submit
<bcg.runtime.engine.Engine.submit>`, per backend and offered rate, timed from each request's scheduled arrival.

For every variant (built one at a time, as ``bcg bench`` builds them) a warm-up runs first, reported on its own
(:class:`Warmup`): a burst of the workload's first requests, then one forward of every bucket and one of the whole
token budget (the eager path past the largest bucket), so no path is first used inside a measured window for want
of warming; a forward in a window on a path that had not run before it is counted (``cold_forwards``, with the
worst time to first token of its requests), so a first-use stall shows as one. Then each rate's workload
(:mod:`bcg.bench.workload`, the same requests at the same times for every variant) is submitted on schedule from
this thread while the engine's scheduler serves it, after a garbage collection. A request's time to first token runs
from its scheduled arrival (so a late submission counts against the engine, as it would for a client) to the moment
its logits were complete (the engine's own stamp, ``RequestResult.completed_at``: no done-callback in the
measurement). A variant falls behind a rate when a request has waited ``max_wait`` seconds without an answer:
that rate stops there (its numbers are over the requests answered, marked), and its higher rates are skipped, so a
run takes at most about ``duration + 2 * max_wait`` seconds per rate and variant, plus the builds.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bcg.bench.engines import BuildRecord, engine_for
from bcg.bench.timing import gc_pauses
from bcg.bench.workload import Workload, make_workload, read_trace
from bcg.errors import first_line

__all__ = ["LoadResult", "LoadRow", "Warmup", "measure_rate", "run_load"]


@dataclass
class LoadRow:
    """One variant at one offered rate.

    Attributes:
        backend: the variant name; rate: offered requests per second; duration_s: the arrival window.
        submitted / completed / failed / unanswered: requests sent, answered, failed by the engine, and left without
            an answer when the variant fell behind (cancelled or failed by close).
        fell_behind: a request waited ``max_wait`` seconds; skipped: not run, a lower rate fell behind.
        ttft_ms / queue_ms: percentiles (``p50``, ``p90``, ``p99``, ``mean``, ``max``) over answered requests: from
            scheduled arrival to the answer, and from submission to the first forward holding the request.
        tokens_per_s / requests_per_s: prompt tokens and requests answered per second of the run (first arrival to
            last answer): the offered load below saturation, the variant's capacity above it.
        cached_share: of the answered prompts' tokens, the share read from the prefix cache.
        graph_share: of the forwards that served them, the share that replayed a graph; mean_batch_tokens: their size.
        cold_forwards: forwards of the window on a path (a bucket's graph, or eager at a size class) that had not run
            before the window; cold_ttft_ms_max: the worst time to first token of the requests they served.
        gc_pause_ms_max / gc_full_collections: the longest garbage collection inside the window (every thread waits
            for it) and how many full ones ran.
    """

    backend: str
    rate: float
    duration_s: float
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    unanswered: int = 0
    fell_behind: bool = False
    skipped: bool = False
    ttft_ms: dict[str, float] = field(default_factory=dict)
    queue_ms: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float | None = None
    requests_per_s: float | None = None
    cached_share: float | None = None
    graph_share: float | None = None
    mean_batch_tokens: float | None = None
    cold_forwards: int = 0
    cold_ttft_ms_max: float | None = None
    gc_pause_ms_max: float = 0.0
    gc_full_collections: int = 0
    error: str | None = None


@dataclass
class Warmup:
    """What ran before a variant's first measured window, timed apart from it.

    Attributes:
        backend: the variant; requests: submitted in the burst; prefill_tokens: the forwards run to reach every
            bucket and the eager path once; wall_ms: the whole warm-up; paths: every forward path it ran.
    """

    backend: str
    requests: int = 0
    prefill_tokens: list[int] = field(default_factory=list)
    wall_ms: float = 0.0
    paths: list[str] = field(default_factory=list)


@dataclass
class LoadResult:
    """Every variant's build record and its rows, in run order, and the requests and tokens of each rate."""

    builds: list[BuildRecord]
    rows: list[LoadRow]
    workloads: list[dict[str, float]] = field(default_factory=list)
    warmups: list[Warmup] = field(default_factory=list)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()), "max": float(a.max())}


def path_of(record: Any) -> str:
    """The path a forward took, as first-use stalls go: a bucket's graph, or eager (why) at a power-of-two size."""
    if record.graph_used:
        return f"graph {record.bucket}"
    return f"eager ({record.reason}) <= {1 << max(int(record.num_tokens) - 1, 0).bit_length()}"


def _new_batches(eng: Any, before: int) -> list[Any]:
    """The forwards recorded since the telemetry counted ``before``, in run order."""
    t = eng.telemetry
    new = t.num_batches - before
    return list(t.batches[-new:]) if new > 0 else []


def measure_rate(eng: Any, work: Workload, backend: str, max_wait: float, seen: set[str] | None = None) -> LoadRow:
    """Submits ``work`` to ``eng`` on schedule and measures it (see the module docstring). ``seen``: the forward
    paths run before this window (updated with this window's), for ``cold_forwards``.

    Example::

        row = measure_rate(eng, make_workload(20.0, 1.0, parse_lengths("fixed:16"), 0, 256, seed=0), "breakable", 2)
        row.ttft_ms["p99"], row.fell_behind
    """
    row = LoadRow(backend, work.rate, float(work.arrivals[-1]) if len(work.arrivals) else 0.0)
    gc.collect()  # the garbage of the warm-up or the last window is not collected inside this one
    before = eng.telemetry.num_batches
    with gc_pauses() as pauses:
        futures, start = _submit_on_schedule(eng, work, row, max_wait)
    row.gc_pause_ms_max, row.gc_full_collections = pauses.max_ms, pauses.num_full
    row.submitted = len(futures)
    ttft, queue, tokens, cached, batches, last, answered = [], [], 0, 0, {}, start, []
    for i, f in enumerate(futures):
        if not f.done() or f.cancelled():
            row.unanswered += 1
            continue
        if f.exception() is not None:
            row.failed += 1
            row.error = row.error or first_line(f.exception())
            continue
        res = f.result()
        row.completed += 1
        answered.append(i)
        ttft.append((res.completed_at - start - work.arrivals[i]) * 1e3)  # the engine's stamp: no callback hop
        queue.append(res.queue_ms)
        tokens += res.num_tokens
        cached += res.cached_tokens
        last = max(last, res.completed_at)
        batches.update((id(b), b) for b in res.batches)
    row.ttft_ms, row.queue_ms = _percentiles(ttft), _percentiles(queue)
    if seen is not None:
        cold = set()
        for b in _new_batches(eng, before):  # in run order: the first forward on a new path is the cold one
            if path_of(b) not in seen:
                seen.add(path_of(b))
                cold.add(id(b))
        row.cold_forwards = len(cold)
        hit = [t for t, i in zip(ttft, answered) if any(id(b) in cold for b in futures[i].result().batches)]
        row.cold_ttft_ms_max = max(hit) if hit else None
    if row.completed:
        span = max(last - start, 1e-9)
        row.tokens_per_s, row.requests_per_s = tokens / span, row.completed / span
        row.cached_share = cached / tokens
        row.graph_share = sum(b.graph_used for b in batches.values()) / len(batches)
        row.mean_batch_tokens = sum(b.num_tokens for b in batches.values()) / len(batches)
    return row


def _submit_on_schedule(eng: Any, work: Workload, row: LoadRow, max_wait: float) -> tuple[list, float]:
    """Submits each request at its arrival and waits for the answers (``max_wait`` each, from its arrival); marks
    ``row.fell_behind`` and cancels what has not started once one waits longer. Returns the futures and the start."""
    futures: list = []
    pending: deque = deque()
    start = time.perf_counter() + 0.005
    for i, (t, prompt) in enumerate(zip(work.arrivals, work.prompts)):
        while pending and futures[pending[0]].done():
            pending.popleft()
        now = time.perf_counter()
        if pending and now - (start + work.arrivals[pending[0]]) > max_wait:
            row.fell_behind = True
            break
        if start + t > now:
            time.sleep(start + t - now)
        futures.append(eng.submit(prompt))
        pending.append(i)
    for i in pending:  # the rest get max_wait from their arrival
        if row.fell_behind:
            break
        left = start + work.arrivals[i] + max_wait - time.perf_counter()
        if not wait([futures[i]], timeout=max(left, 0.0)).done:
            row.fell_behind = True
    if row.fell_behind:  # stop what has not started; what runs finishes (bounded: it holds its KV slots)
        for f in futures:
            f.cancel()
        wait(futures, timeout=2 * max_wait)
    return futures, start


def workloads(cfg: Any, vocab_size: int) -> list[Workload]:
    """One workload per rate of a resolved :class:`~bcg.bench.load_config.LoadConfig` (one for a trace)."""
    if cfg.trace is not None:
        times, lengths = read_trace(cfg.trace)
        keep = times <= cfg.duration
        span = float(times[keep][-1]) if keep.any() else 0.0
        rate = keep.sum() / span if span > 0 else float(keep.sum())
        return [make_workload(rate, cfg.duration, None, cfg.shared_prefix, vocab_size, cfg.seed, (times, lengths))]
    return [make_workload(r, cfg.duration, cfg.length_spec, cfg.shared_prefix, vocab_size, cfg.seed)
            for r in cfg.rates]


def _warm(eng: Any, work: Workload, count: int, backend: str) -> tuple[Warmup, set[str]]:
    """Runs ``count`` of the workload's prompts at once (first forwards, lazy initialisation), then one forward of
    every bucket and of the whole token budget, and forgets what they cached; returns its record and the paths
    it ran."""
    t0, before = time.perf_counter(), eng.telemetry.num_batches
    record = Warmup(backend, requests=count)
    if count:
        for f in [eng.submit(p) for p in work.prompts[:count]]:
            f.result()
    context = eng.model.config.max_position_embeddings or eng.config.chunked_prefill_size
    vocab = eng.model.config.vocab_size
    rng = np.random.default_rng(0)
    for n in sorted({*(eng.telemetry.buckets or {}), eng.config.chunked_prefill_size}):
        n = min(n, eng.config.chunked_prefill_size, eng.kv_pool.num_slots)
        lengths = [min(context, n - k) for k in range(0, n, context)]  # one forward of n tokens in all
        eng.prefill([rng.integers(0, vocab, m).tolist() for m in lengths])
        record.prefill_tokens.append(n)
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()
    paths = {path_of(b) for b in _new_batches(eng, before)}
    record.paths = sorted(paths)
    record.wall_ms = (time.perf_counter() - t0) * 1e3
    return record, paths


def run_load(cfg: Any, progress: Any = None) -> LoadResult:
    """Every variant of a resolved :class:`~bcg.bench.load_config.LoadConfig` at every rate; ``progress(text)`` is told
    what runs next."""
    spec = cfg.engine_spec()
    builds, rows, warmups = [], [], []
    works: list[Workload] | None = None
    for variant in cfg.backends:
        record = BuildRecord(variant)
        builds.append(record)
        if progress:
            progress(f"{variant}: building")
        with engine_for(spec, variant, record) as eng:
            if eng is None:
                continue
            try:
                if works is None:
                    works = workloads(cfg, eng.model.config.vocab_size)
                warmup, seen = _warm(eng, works[0], cfg.warmup, variant)
                warmups.append(warmup)
                behind = False
                for work in works:
                    if behind:
                        rows.append(LoadRow(variant, work.rate, cfg.duration, skipped=True))
                        continue
                    if progress:
                        progress(f"{variant}: {work.rate:g} req/s, {len(work.prompts)} requests")
                    row = measure_rate(eng, work, variant, cfg.max_wait, seen)
                    rows.append(row)
                    behind = row.fell_behind
                    if eng.prefix_cache is not None:
                        eng.prefix_cache.clear()  # every rate starts cold
            except Exception as e:  # a variant that breaks under load is a result, not the end of the run
                rows.append(LoadRow(variant, float("nan"), cfg.duration, error=first_line(e)))
            finally:
                eng.close()
    sizes = [{"rate": w.rate, "requests": len(w.prompts), "tokens": w.num_tokens} for w in works or []]
    return LoadResult(builds, rows, sizes, warmups)
