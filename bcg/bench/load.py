"""The load experiment of ``bcg load``: an open-loop stream of requests through :meth:`Engine.submit
<bcg.runtime.engine.Engine.submit>`, per backend and offered rate, timed from each request's scheduled arrival.

For every variant (built one at a time, as ``bcg bench`` builds them) a few warm-up requests run first; then each
rate's workload (:mod:`bcg.bench.workload`, the same requests at the same times for every variant) is submitted on
schedule from this thread while the engine's scheduler serves it. A request's time to first token runs from its
scheduled arrival (so a late submission counts against the engine, as it would for a client) to the moment its
future resolved. A variant falls behind a rate when a request has waited ``max_wait`` seconds without an answer:
that rate stops there (its numbers are over the requests answered, marked), and its higher rates are skipped, so a
run takes at most about ``duration + 2 * max_wait`` seconds per rate and variant, plus the builds.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bcg.bench.engines import BuildRecord, engine_for
from bcg.bench.workload import Workload, make_workload, read_trace
from bcg.errors import first_line

__all__ = ["LoadResult", "LoadRow", "measure_rate", "run_load"]


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
    error: str | None = None


@dataclass
class LoadResult:
    """Every variant's build record and its rows, in run order, and the requests and tokens of each rate."""

    builds: list[BuildRecord]
    rows: list[LoadRow]
    workloads: list[dict[str, float]] = field(default_factory=list)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()), "max": float(a.max())}


def measure_rate(eng: Any, work: Workload, backend: str, max_wait: float) -> LoadRow:
    """Submits ``work`` to ``eng`` on schedule and measures it (see the module docstring).

    Example::

        row = measure_rate(eng, make_workload(20.0, 1.0, parse_lengths("fixed:16"), 0, 256, seed=0), "breakable", 2)
        row.ttft_ms["p99"], row.fell_behind
    """
    row = LoadRow(backend, work.rate, float(work.arrivals[-1]) if len(work.arrivals) else 0.0)
    futures, done_at, pending = [], {}, deque()
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
        fut = eng.submit(prompt)
        fut.add_done_callback(lambda _f, i=i: done_at.setdefault(i, time.perf_counter()))
        futures.append(fut)
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
    row.submitted = len(futures)
    ttft, queue, tokens, cached, batches, last = [], [], 0, 0, {}, start
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
        ttft.append((done_at[i] - start - work.arrivals[i]) * 1e3)
        queue.append(res.queue_ms)
        tokens += res.num_tokens
        cached += res.cached_tokens
        last = max(last, done_at[i])
        batches.update((id(b), b) for b in res.batches)
    row.ttft_ms, row.queue_ms = _percentiles(ttft), _percentiles(queue)
    if row.completed:
        span = max(last - start, 1e-9)
        row.tokens_per_s, row.requests_per_s = tokens / span, row.completed / span
        row.cached_share = cached / tokens
        row.graph_share = sum(b.graph_used for b in batches.values()) / len(batches)
        row.mean_batch_tokens = sum(b.num_tokens for b in batches.values()) / len(batches)
    return row


def workloads(cfg: Any, vocab_size: int) -> list[Workload]:
    """One workload per rate of a resolved :class:`~bcg.bench.config.LoadConfig` (one for a trace)."""
    if cfg.trace is not None:
        times, lengths = read_trace(cfg.trace)
        keep = times <= cfg.duration
        span = float(times[keep][-1]) if keep.any() else 0.0
        rate = keep.sum() / span if span > 0 else float(keep.sum())
        return [make_workload(rate, cfg.duration, None, cfg.shared_prefix, vocab_size, cfg.seed, (times, lengths))]
    return [make_workload(r, cfg.duration, cfg.length_spec, cfg.shared_prefix, vocab_size, cfg.seed)
            for r in cfg.rates]


def _warm(eng: Any, work: Workload, count: int) -> None:
    """Runs ``count`` of the workload's prompts at once (first forwards, lazy initialisation), then forgets them."""
    if count:
        for f in [eng.submit(p) for p in work.prompts[:count]]:
            f.result()
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()


def run_load(cfg: Any, progress: Any = None) -> LoadResult:
    """Every variant of a resolved :class:`~bcg.bench.config.LoadConfig` at every rate; ``progress(text)`` is told
    what runs next."""
    spec = cfg.engine_spec()
    builds, rows = [], []
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
                _warm(eng, works[0], cfg.warmup)
                behind = False
                for work in works:
                    if behind:
                        rows.append(LoadRow(variant, work.rate, cfg.duration, skipped=True))
                        continue
                    if progress:
                        progress(f"{variant}: {work.rate:g} req/s, {len(work.prompts)} requests")
                    row = measure_rate(eng, work, variant, cfg.max_wait)
                    rows.append(row)
                    behind = row.fell_behind
                    if eng.prefix_cache is not None:
                        eng.prefix_cache.clear()  # every rate starts cold
            except Exception as e:  # a variant that breaks under load is a result, not the end of the run
                rows.append(LoadRow(variant, float("nan"), cfg.duration, error=first_line(e)))
            finally:
                eng.close()
    sizes = [{"rate": w.rate, "requests": len(w.prompts), "tokens": w.num_tokens} for w in works or []]
    return LoadResult(builds, rows, sizes)
