"""The seed's isolated prefill experiment: one request at a time, fixed input length, every backend.

For each backend one engine is built per model (capture ceiling = the longest input, capped at the chunk size) and
reused across lengths. By default each engine is built, measured at every length and freed before the next one,
so each runs alone in its process as it would serve. With ``interleave=True`` (``--interleave``) every engine is
built first and all stay alive while they are measured in turn (an untimed call, then a timed one; ``runs``
rounds), so a drift of the machine during the run lands on every variant alike; the host path of every variant is
then slower (one heap holds every engine), so compare ratios, not absolute times, across the two ways.

Each (backend, length) row holds the median prefill latency over ``runs`` timed runs after ``warmup`` with its
interquartile range, the speedup over eager with the range the two spreads allow, and the kernel floor (device busy
time of the eager forward, CUDA only). For every backend one extra batch per length packs ``batch_requests``
requests of the same total tokens, to show whether a many-request batch still replays a graph (``full`` bakes in a
few request slots, so there it usually runs eagerly, and the row says so).

A backend that cannot be built, or that refuses the model, gets no rows: its build record says why, and nothing it
would have served eagerly is counted as its speed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from bcg.bench.amdahl import launch_gap_share
from bcg.bench.config import BenchConfig, BenchError
from bcg.bench.engines import BuildRecord, engine_for, make_prompts, split_tokens
from bcg.bench.timing import Timing, gpu_kernel_ms, time_fn
from bcg.bench.variants import parse_variant
from bcg.errors import first_line

__all__ = ["LatencyResult", "LatencyRow", "fill_speedups", "run_latency"]


@dataclass
class LatencyRow:
    """One (backend, input length, requests) measurement; times in milliseconds.

    ``graph_used`` is True when every forward of the timed prefill replayed a graph; ``bucket``/``reason`` are
    those of its first forward. ``q1_ms``/``q3_ms`` bound the middle half of the runs; ``speedup_low``/``_high``
    are the speedup over eager that those spreads allow (eager's q1 over this q3, eager's q3 over this q1).
    ``kernel_floor_ms`` is the eager forward's device busy time at the same shape, ``fused_floor_ms`` that of the
    eager forward on the fused kernels (measured when a variant uses them): the floors no launch path can beat
    without fusing more. ``next_tokens`` are the greedy tokens of the untimed prefill; ``tokens_equal_eager`` says
    whether eager's rows of the same shape chose the same ones, and ``eager_top2_gap`` is the smallest gap between
    eager's two best logits over its requests: a near-tie that bf16 rounding may flip.
    """

    backend: str
    input_len: int
    num_requests: int
    num_tokens: int
    median_ms: float
    min_ms: float
    q1_ms: float
    q3_ms: float
    max_ms: float
    mean_ms: float
    stdev_ms: float
    runs: int
    graph_used: bool
    bucket: int | None
    reason: str
    speedup_vs_eager: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    kernel_ms: float | None = None
    fused_kernel_ms: float | None = None
    kernel_floor_ms: float | None = None
    fused_floor_ms: float | None = None
    launch_gap_share: float | None = None
    next_tokens: list[int] = field(default_factory=list)
    tokens_equal_eager: bool | None = None
    eager_top2_gap: float | None = None


@dataclass
class LatencyResult:
    """Build records per backend, one row per (backend, length), and the many-request batch rows."""

    builds: list[BuildRecord] = field(default_factory=list)
    rows: list[LatencyRow] = field(default_factory=list)
    batch_rows: list[LatencyRow] = field(default_factory=list)


def _row(eng: Any, backend: str, input_len: int, prompts: list[Any], timing: Timing) -> LatencyRow:
    res = eng.prefill(prompts)  # one more, untimed, to read how it ran and what it chose
    batches, first = res.batches, res.batches[0]
    top2 = res.logits.float().topk(2, dim=-1).values
    return LatencyRow(
        backend=backend, input_len=input_len, num_requests=len(prompts),
        num_tokens=sum(int(p.numel()) for p in prompts), median_ms=timing.median_ms, min_ms=timing.min_ms,
        q1_ms=timing.q1_ms, q3_ms=timing.q3_ms, max_ms=timing.max_ms, mean_ms=timing.mean_ms,
        stdev_ms=timing.stdev_ms, runs=len(timing.samples_ms),
        graph_used=all(b.graph_used for b in batches), bucket=first.bucket, reason=first.reason,
        next_tokens=res.next_tokens.tolist(),
        eager_top2_gap=float((top2[:, 0] - top2[:, 1]).min()) if backend == "eager" else None,  # others: eager's
    )


def _engine(cfg: BenchConfig, backend: str, record: BuildRecord) -> Any:
    # The KV pool holds the longest prompt (the many-request batch has the same total), however long it is.
    return engine_for(cfg.model, backend, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                      chunked_prefill_size=cfg.chunked_prefill_size, max_tokens=cfg.ceiling,
                      kv_tokens=max(cfg.lengths), progress=cfg.progress, record=record, tp_size=cfg.tp,
                      model_impl=cfg.model_impl)


def _shapes(cfg: BenchConfig, vocab: int, length: int) -> list[list[Any]]:
    """The prompts measured at one length: one request, and the many-request batch of the same total."""
    out = [make_prompts([length], vocab, cfg.seed + length)]
    if cfg.batch_requests > 1:
        out.append(make_prompts(split_tokens(length, cfg.batch_requests), vocab, cfg.seed + length))
    return out


def _fail(record: BuildRecord, length: int, e: Exception, bar: Any) -> None:
    record.error = f"failed at input length {length}: {first_line(e)}"
    bar.write(f"bcg bench: backend {record.backend!r} {record.error}")


def _measure(engines: dict[str, tuple[Any, BuildRecord]], cfg: BenchConfig, result: LatencyResult, bar: Any) -> None:
    """Every engine in ``engines`` at each length, one turn each per round (the first of a round rotates), ``warmup``
    rounds untimed, then ``runs`` timed ones; a variant that raises is dropped with its reason, the others go on.

    With several engines a change of the machine's state during the run (clocks, a busy neighbour) lands on every
    variant alike; their turn is an untimed call, then the timed one, so the timed run finds its engine's host state
    warm instead of paying for the switch from another engine. With one engine this is plain back-to-back timing.
    """
    warm_turn = int(len(engines) > 1)
    for done, length in enumerate(cfg.lengths):
        if not engines:
            return
        bar.set_postfix(input_len=length, variants=len(engines))
        vocab = next(iter(engines.values()))[0].model.config.vocab_size
        measured = list(engines)
        for prompts in _shapes(cfg, vocab, length):
            samples: dict[str, list[float]] = {b: [] for b in engines}
            for r in range(-cfg.warmup, cfg.runs):
                names = [b for b in samples if b in engines]
                if not names:
                    break
                for b in names[r % len(names):] + names[: r % len(names)]:
                    try:
                        t = time_fn(lambda e=engines[b][0], p=prompts: e.prefill(p), cfg.device, runs=1,
                                    warmup=warm_turn).samples_ms[0]
                    except Exception as e:  # one variant failing must not lose the others
                        _fail(engines.pop(b)[1], length, e, bar)
                        continue
                    if r >= 0:
                        samples[b].append(t)
            rows = result.rows if len(prompts) == 1 else result.batch_rows
            for b in [b for b in samples if b in engines]:
                try:
                    rows.append(_row(engines[b][0], b, length, prompts, Timing(samples[b])))
                except Exception as e:  # as above
                    _fail(engines.pop(b)[1], length, e, bar)
        # A variant dropped here has no more lengths to measure: its share of the bar is done too.
        bar.update(sum(1 if b in engines else len(cfg.lengths) - done for b in measured))


def _bench_one_at_a_time(backend: str, cfg: BenchConfig, result: LatencyResult, bar: Any) -> None:
    """Builds one engine, measures every length, and frees it (the engine lives only in this frame)."""
    record = BuildRecord(backend)
    result.builds.append(record)
    with _engine(cfg, backend, record) as eng:
        if eng is None:
            _check_eager(backend, cfg, record)
            bar.update(len(cfg.lengths))  # the report lists it with its reason
            return
        _measure({backend: (eng, record)}, cfg, result, bar)


def _check_eager(backend: str, cfg: BenchConfig, record: BuildRecord) -> None:
    if backend == "eager":
        raise BenchError(f"the eager baseline of {cfg.model!r} could not be built ({record.error}); nothing was "
                         "measured")


def _kernel_floors(cfg: BenchConfig, result: LatencyResult) -> None:
    """Profiles the eager forward of every length in a fresh eager engine and stores its device busy time, on plain
    torch ops and, when a variant runs the fused kernels, on those too.

    Done last, after every graph backend has run: the kernel floor is a property of the eager kernels, and
    keeping the profiler (CUPTI) away from graph captures avoids any interference with them.
    """
    # Many-request rows too: their kernels can differ from one request's (an MoE routes differently), so each
    # shape gets its own floor.
    rows = [r for r in result.rows + result.batch_rows if r.backend == "eager"]
    if not (cfg.profile and rows and torch.device(cfg.device).type == "cuda"):
        return
    fused = any(parse_variant(b).kernels == "fused" for b in cfg.backends)
    for variant, field_name in (("eager", "kernel_ms"), ("eager+fused", "fused_kernel_ms"))[: 1 + fused]:
        with engine_for(cfg.model, variant, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                        chunked_prefill_size=cfg.chunked_prefill_size, max_tokens=cfg.ceiling,
                        kv_tokens=max(cfg.lengths), progress=False, tp_size=cfg.tp,
                        model_impl=cfg.model_impl) as eng:
            if eng is None:
                continue
            for row in rows:
                parts = [row.input_len] if row.num_requests == 1 else split_tokens(row.input_len, row.num_requests)
                prompts = make_prompts(parts, eng.model.config.vocab_size, cfg.seed + row.input_len)
                setattr(row, field_name, gpu_kernel_ms(lambda p=prompts: eng.prefill(p), cfg.device, warmup=1))


def fill_speedups(rows: list[LatencyRow]) -> None:
    """Sets speedup over eager (and its range from both rows' quartiles), the kernel floor, the launch-gap
    share and whether the greedy tokens equal eager's, on rows of the same shape.

    Example::

        fill_speedups(result.rows)   # rows[i].speedup_vs_eager = eager median / this median
    """
    eager = {(r.input_len, r.num_requests): r for r in rows if r.backend == "eager"}
    for r in rows:
        base = eager.get((r.input_len, r.num_requests))
        if base is None:
            continue
        r.speedup_vs_eager = base.median_ms / r.median_ms if r.median_ms > 0 else None
        if r is not base and r.q1_ms > 0:
            r.speedup_low, r.speedup_high = base.q1_ms / r.q3_ms, base.q3_ms / r.q1_ms
        r.kernel_floor_ms, r.fused_floor_ms = base.kernel_ms, base.fused_kernel_ms
        r.launch_gap_share = launch_gap_share(base.kernel_ms, r.median_ms) if r.median_ms > 0 else None
        r.tokens_equal_eager = r.next_tokens == base.next_tokens if r.next_tokens and base.next_tokens else None
        r.eager_top2_gap = base.eager_top2_gap


def run_latency(cfg: BenchConfig) -> LatencyResult:
    """Runs the isolated prefill experiment for every backend of a resolved ``cfg``.

    Eager is always measured (first) because every speedup is relative to it; when it cannot be built nothing
    is, and :class:`~bcg.bench.config.BenchError` says why.

    Example::

        res = run_latency(BenchConfig(model="tiny-dense", lengths=[16, 32], runs=2).resolved())
        [(r.backend, r.input_len, r.median_ms) for r in res.rows]
    """
    backends = ["eager"] + [b for b in cfg.backends if b != "eager"]
    result = LatencyResult()
    with tqdm(total=len(backends) * len(cfg.lengths), desc="bcg bench", unit="shape",
              disable=not cfg.progress) as bar:
        if not cfg.interleave:
            for backend in backends:
                _bench_one_at_a_time(backend, cfg, result, bar)
        else:
            with contextlib.ExitStack() as stack:  # every engine stays alive until all are measured
                engines: dict[str, tuple[Any, BuildRecord]] = {}
                for backend in backends:
                    record = BuildRecord(backend)
                    result.builds.append(record)
                    eng = stack.enter_context(_engine(cfg, backend, record))
                    if eng is None:
                        _check_eager(backend, cfg, record)
                        bar.update(len(cfg.lengths))
                    else:
                        engines[backend] = (eng, record)
                _measure(engines, cfg, result, bar)
    _kernel_floors(cfg, result)
    fill_speedups(result.rows)
    fill_speedups(result.batch_rows)
    return result
