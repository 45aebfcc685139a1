"""The isolated prefill experiment of SGLang's breakable-graph blog post (2026-08-17, the article bcg started from):
one request at a time, fixed input length, every backend.

For each backend one engine is built per model (capture ceiling = the longest input, capped at the chunk size) and
reused across lengths. By default each engine is built, measured at every length and freed before the next one,
so each runs alone in its process as it would serve. With ``interleave=True`` (``--interleave``) every engine is
built first and all stay alive while they are measured in turn (an untimed call, then a timed one; ``runs``
rounds), so a drift of the machine during the run lands on every variant alike; the host path of every variant is
then slower (one heap holds every engine), so compare ratios, not absolute times, across the two ways.

Each (backend, length) row (:mod:`bcg.bench.rows`) holds the prefill latency over ``runs`` timed runs after
``warmup`` (median and interquartile range), the speedup over eager with the range the two spreads allow, and on
CUDA the device time of one profiled prefill of the same variant, with the kernel floors (eager's device time). The
profiling comes last, in a fresh engine per variant: once loaded, the profiler slows the host work of every later
run. For every backend one extra batch per length packs ``batch_requests`` requests of the same total tokens, to show
whether a many-request batch still replays a graph (``full`` bakes in a few request slots, so there it usually runs
eagerly, and the row says so).

A backend that cannot be built, or that refuses the model, gets no rows: its build record says why, and nothing it
would have served eagerly is counted as its speed.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from bcg.bench.config import BenchConfig, BenchError
from bcg.bench.engines import BuildRecord, EngineSpec, engine_for, make_prompts, split_tokens
from bcg.bench.rows import LatencyRow, Shape, TokenCheck, compare_with_eager
from bcg.bench.timing import Stats, gpu_kernel_ms, time_fn
from bcg.bench.variants import parse_variant
from bcg.errors import first_line

__all__ = ["LatencyResult", "run_latency"]


@dataclass
class LatencyResult:
    """Build records per backend, one row per (backend, length), and the many-request batch rows."""

    builds: list[BuildRecord] = field(default_factory=list)
    rows: list[LatencyRow] = field(default_factory=list)
    batch_rows: list[LatencyRow] = field(default_factory=list)


def run_latency(cfg: BenchConfig) -> LatencyResult:
    """Runs the isolated prefill experiment for every backend of a resolved ``cfg``.

    Eager is always measured (first) because every speedup is relative to it; when it cannot be built nothing
    is, and :class:`~bcg.bench.config.BenchError` says why, as it does when no row could be measured at all.

    Example::

        res = run_latency(BenchConfig(model="tiny-dense", lengths=[16, 32], runs=2).resolved())
        [(r.backend, r.input_len, r.wall.median_ms) for r in res.rows]
    """
    spec = cfg.engine_spec()
    backends = ["eager"] + [b for b in cfg.backends if b != "eager"]
    result = LatencyResult()
    # One engine at a time, or every engine alive at once and timed in turn (--interleave).
    groups = [backends] if cfg.interleave else [[b] for b in backends]
    with tqdm(total=len(backends) * len(cfg.lengths), desc="bcg bench", unit="shape",
              disable=not cfg.progress) as bar:
        for group in groups:
            with contextlib.ExitStack() as stack:  # the group's engines stay alive until all are measured
                engines: dict[str, tuple[Any, BuildRecord]] = {}
                for backend in group:
                    record = BuildRecord(backend)
                    result.builds.append(record)
                    eng = stack.enter_context(engine_for(spec, backend, record))
                    if eng is not None:
                        engines[backend] = (eng, record)
                        continue
                    if backend == "eager":
                        raise BenchError(f"the eager baseline of {cfg.model!r} could not be built ({record.error}); "
                                         "nothing was measured")
                    bar.update(len(cfg.lengths))  # the report lists it with its reason
                _measure(engines, cfg, result, bar)
    if not result.rows and not result.batch_rows:
        reasons = "; ".join(f"{b.backend}: {b.error}" for b in result.builds if b.error)
        raise BenchError(f"nothing was measured ({reasons})")
    device_ms = _profile(cfg, spec, result) if cfg.profile and not cfg.emulated else {}
    compare_with_eager(result.rows, device_ms)
    compare_with_eager(result.batch_rows, device_ms)
    return result


def _prompts(cfg: BenchConfig, vocab: int, length: int, num_requests: int) -> list[Any]:
    """The prompts of one shape: ``length`` tokens over ``num_requests`` requests, the same for every variant."""
    parts = [length] if num_requests == 1 else split_tokens(length, num_requests)
    return make_prompts(parts, vocab, cfg.seed + length)


def _shapes(cfg: BenchConfig, vocab: int, length: int) -> list[list[Any]]:
    """The prompts measured at one length: one request, and the many-request batch of the same total."""
    counts = [1] + ([cfg.batch_requests] if cfg.batch_requests > 1 else [])
    return [_prompts(cfg, vocab, length, k) for k in counts]


def _row(eng: Any, backend: str, input_len: int, prompts: list[Any], samples: list[float]) -> LatencyRow:
    res = eng.prefill(prompts)  # one more, untimed, to read how it ran and what it chose
    batches, first = res.batches, res.batches[0]
    top2 = res.logits.float().topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min()) if backend == "eager" else None  # the others get eager's
    return LatencyRow(backend=backend, input_len=input_len, num_requests=len(prompts),
                      num_tokens=sum(int(p.numel()) for p in prompts), wall=Stats.of(samples),
                      graph_used=all(b.graph_used for b in batches), bucket=first.bucket, reason=first.reason,
                      greedy=TokenCheck(res.next_tokens.tolist(), eager_top2_gap=gap))


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
                                    warmup=warm_turn).median_ms
                    except Exception as e:  # one variant failing must not lose the others
                        _fail(engines.pop(b)[1], length, e, bar)
                        continue
                    if r >= 0:
                        samples[b].append(t)
            rows = result.rows if len(prompts) == 1 else result.batch_rows
            for b in [b for b in samples if b in engines]:
                try:
                    rows.append(_row(engines[b][0], b, length, prompts, samples[b]))
                except Exception as e:  # as above
                    _fail(engines.pop(b)[1], length, e, bar)
        # A variant dropped here has no more lengths to measure: its share of the bar is done too.
        bar.update(sum(1 if b in engines else len(cfg.lengths) - done for b in measured))


def _profile(cfg: BenchConfig, spec: EngineSpec, result: LatencyResult) -> dict[Shape, float | None]:
    """The device busy time of one prefill per row, each variant profiled in a fresh engine after every timed run;
    eager first (its times are the kernel floors), then eager on the fused kernels when a variant uses them (the
    fused floor), then the graph variants.

    A variant whose fresh engine does not run a shape as its timed rows did (a capture that failed this time) gets
    no device time there: it would be another variant's under its name.
    """
    by_variant: dict[str, list[LatencyRow]] = {}
    for r in result.rows + result.batch_rows:
        by_variant.setdefault(r.backend, []).append(r)
    eager = by_variant.pop("eager", [])
    todo = [("eager", eager)]
    if any(parse_variant(b).kernels == "fused" for b in cfg.backends):
        todo.append(("eager+fused", by_variant.pop("eager+fused", eager)))  # at eager's shapes if not measured
    todo.extend(by_variant.items())
    out: dict[Shape, float | None] = {}
    quiet = spec.replace(progress=False)
    for variant, todo_rows in todo:
        if not todo_rows:
            continue
        try:
            with engine_for(quiet, variant) as eng:
                if eng is None:
                    continue
                for r in todo_rows:
                    prompts = _prompts(cfg, eng.model.config.vocab_size, r.input_len, r.num_requests)
                    warm = eng.prefill(prompts)  # the profiler's warm-up, and how this engine runs the shape
                    if all(b.graph_used for b in warm.batches) == r.graph_used:
                        ms = gpu_kernel_ms(lambda p=prompts: eng.prefill(p), cfg.device, warmup=0)
                        out[(variant, r.input_len, r.num_requests)] = ms
        except Exception as e:  # a device time is optional; the timed rows stand without it
            print(f"bcg bench: no device time for {variant}: {first_line(e)}", file=sys.stderr)
    return out
