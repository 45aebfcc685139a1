"""What ``bcg bench`` and ``bcg analyze`` print: the header line, the tables, what was not measured and why, the
geomean speedups labelled for what they measure; the analysis with its verdict is :mod:`bcg.bench.analysis_text`'s
(re-exported here as :func:`format_analysis`).

The measuring modules produce the results; this module only formats them, so every line a user reads can be tested
without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bcg.bench.analysis_text import format_analysis
from bcg.bench.rows import CPU_SPEEDUP_NOTE, LatencyRow, geomean_speedups
from bcg.bench.tables import describe_reason, fmt, fmt_bytes, table
from bcg.bench.variants import parse_variant

__all__ = ["NOISY_SPREAD", "format_analysis", "format_bench", "header"]

# A row whose middle half of runs spans more than this share of its median cannot separate backends within it.
NOISY_SPREAD = 0.25


def header(command: str, cfg: Any, environment: dict[str, Any]) -> str:
    """The first line a run prints: what runs, where, how (model implementation, tensor parallel size, threads), what
    each variant's engine runs (kernels, attention backend, compiler, buckets: :meth:`EngineSpec.describe`) and, on
    a CPU, what its numbers cannot show.

    Example::

        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model="tiny-moe", device="cpu", emulated=True, tp=1)
        >>> header("bench", cfg, {"device_name": "cpu", "model_impl": "native", "torch_threads": 1})[:81]
        'bcg bench: tiny-moe on the CPU, under the CUDA-graph emulation, native model code'
    """
    threads = environment["torch_threads"]
    how = [f"{environment['model_impl']} model code (--model-impl)"]
    if hasattr(cfg, "tp"):
        how.append(f"tensor parallel size {cfg.tp} (--tp)")
    how.append(f"{threads} torch thread{'s' if threads != 1 else ''} (--threads)")
    # What each engine runs, resolved as the engine resolves it (a config without variants, e.g. verify's, has none).
    runs = f" Engines: {cfg.engine_spec().describe(cfg.backends)}." if getattr(cfg, "backends", None) else ""
    if not cfg.emulated:
        return f"bcg {command}: {cfg.model} on {environment['device_name']} ({cfg.device}), {', '.join(how)}.{runs}"
    return (f"bcg {command}: {cfg.model} on the CPU, under the CUDA-graph emulation, {', '.join(how)}.{runs} CPU "
            "timings carry no kernel-launch overhead: a speedup here measures the emulation against eager, not what "
            "graphs save on a GPU. Run on a GPU for real numbers.")


def _noisy(r: LatencyRow) -> bool:
    return (r.wall.spread or 0) > NOISY_SPREAD


def _latency_table(title: str, rows: Sequence[LatencyRow], cuda: bool, tc_compiler: str) -> str:
    headers = ["backend", "kernels", "compile", "tokens", "reqs", "median ms", "q1-q3 ms", "spread", "speedup",
               "speedup range"]
    fused_floors = cuda and any(r.device.fused_floor_ms for r in rows)
    if cuda:
        headers += ["device ms", "host ms", "wall/device", "kernel floor"] + ["fused floor"] * fused_floors
        headers += ["launch gap"]
    headers += ["tokens = eager", "graph"] + ["note"] * any(_noisy(r) for r in rows)
    cells = []
    for r in rows:
        v, s, w, d = parse_variant(r.backend, tc_compiler), r.wall.spread, r.wall, r.device
        sp = r.speedup
        row = [v.backend_label, v.kernels, v.compile_label, r.num_tokens, r.num_requests, fmt(w.median_ms, 3),
               f"{w.q1_ms:.3f}-{w.q3_ms:.3f}", "-" if s is None else f"{s:.0%}",
               fmt(sp and sp.over_eager, 2, "x"),
               f"{sp.low:.2f}-{sp.high:.2f}x" if sp and sp.low is not None and sp.high is not None else "-"]
        if cuda:
            row += [fmt(d.ms, 3), fmt(d.host_ms, 3), fmt(d.wall_over_device, 2, "x"), fmt(d.floor_ms, 3)]
            row += [fmt(d.fused_floor_ms, 3)] * fused_floors + [fmt(d.launch_gap_share, 2)]
        row += ["-" if r.backend == "eager" else fmt(r.greedy.equal_eager),
                describe_reason(r.graph_used, r.reason, r.bucket)]
        cells.append(row + (["noisy" if _noisy(r) else ""] if "note" in headers else []))
    return table(headers, cells, title=title)


def _build_table(builds: Sequence[Any], tc_compiler: str) -> str:
    def cells(b: Any) -> list[Any]:
        v = parse_variant(b.backend, tc_compiler)
        status = "yes" if b.available else "refused" if b.refused_reason else "no"
        return [v.backend_label, status, v.kernels, v.compile_label, fmt(b.build_ms, 0), fmt(b.compile_ms, 0),
                fmt(b.capture_ms, 0), f"{b.num_captured}/{b.num_buckets}" if b.available else "-",
                f"{fmt(b.num_segments)}/{fmt(b.num_breaks)}", fmt_bytes(b.graph_memory_bytes)]

    return table(["backend", "available", "kernels", "compile", "build ms", "compile ms", "capture ms", "buckets",
                  "segs/breaks", "graph mem"], [cells(b) for b in builds], title="Build")


def _memory_table(mem: Any) -> str:
    if not mem.available:
        return f"Memory: {mem.note}"
    return table(["ceiling", "backend", "buckets", "graph mem", "activation peak", "total above base", "replayed"],
                 [[r.label if r.ceiling is None else f"{r.label} ({r.ceiling})", r.backend, r.num_buckets,
                   fmt_bytes(r.graph_memory_bytes), fmt_bytes(r.activation_peak_bytes),
                   fmt_bytes(r.device_used_above_baseline_bytes), fmt(r.graph_used)] for r in mem.rows],
                 title=f"Memory after one {mem.chunked_prefill_size}-token prefill")


def _lengths(n: int) -> str:
    return f"{n} length{'s' if n != 1 else ''}"


def _geomean_line(rows: Sequence[LatencyRow], backends: Sequence[str], emulated: bool) -> list[str]:
    """The geomean of each graph backend over the lengths it was measured at (and how many those are)."""
    geo = geomean_speedups(rows, backends)
    if not geo:
        return []
    counts = {b: len({r.input_len for r in rows if r.backend == b and r.speedup}) for b in geo}
    if len(set(counts.values())) == 1:
        line = f"{_lengths(next(iter(counts.values())))}: " + ", ".join(f"{b} {v:.2f}x" for b, v in geo.items())
    else:  # a variant that failed part-way has fewer lengths than the others
        line = "each over its measured lengths: " + ", ".join(f"{b} {v:.2f}x ({_lengths(counts[b])})"
                                                              for b, v in geo.items())
    label = f" ({CPU_SPEEDUP_NOTE})" if emulated else ""
    return ["", f"Geomean speedup over eager, one request, {line}{label}."]


def format_bench(cfg: Any, lat: Any, mem: Any, emulated: bool) -> str:
    """The text ``bcg bench`` prints: tables, the unavailable backends with their reasons, notes, geomeans."""
    out = [_build_table(lat.builds, cfg.tc_compiler)]
    gone = [b for b in lat.builds if not b.available]
    if gone:
        out += ["", "Unavailable (not measured, in no speedup):"] + [f"  {b.backend}: {b.error}" for b in gone]
    failed = [b for b in lat.builds if b.available and b.error]
    if failed:
        out += ["", "Failed part-way (rows up to the failure are kept):"]
        out += [f"  {b.backend}: {b.error}" for b in failed]
    where = " (CPU emulation)" if emulated else ""
    for t, rows in ((f"Latency, one request{where}", lat.rows),
                    (f"Latency, {cfg.batch_requests} requests, same total tokens{where}", lat.batch_rows)):
        if rows:
            out += ["", _latency_table(t, rows, not emulated, cfg.tc_compiler)]
    every = lat.rows + lat.batch_rows
    noisy = sum(map(_noisy, every))
    if noisy:
        out += ["", f"{noisy} row(s) marked noisy: their middle half of runs spans more than {NOISY_SPREAD:.0%} of "
                    "the median, so backends within that spread are not told apart; the machine was busy. Rerun, or "
                    "raise --runs."]
    if not emulated and any(r.device.ms for r in every):
        out += ["", "device ms: the GPU's busy time in one profiled prefill of the same variant; host ms = median - "
                    "device, the time the GPU waited for the host."]
    differ = [r for r in every if r.greedy.equal_eager is False]
    if differ:
        out += ["", f"{len(differ)} row(s) chose a different greedy token than eager: "
                + ", ".join(f"{r.backend} at {r.num_tokens} tokens (eager's top-2 gap "
                            f"{fmt(r.greedy.eager_top2_gap, 4)})" for r in differ)
                + ". A gap near the dtype's rounding is a near-tie; a wide one is a wrong answer."]
    if lat.batch_rows and cfg.batch_requests > 1:
        out += ["", f"The {cfg.batch_requests}-request rows pack requests of the same total tokens; a graph "
                    "backend that cannot replay such a batch runs it eagerly, and its graph column says why."]
    if mem is not None:
        out += ["", _memory_table(mem)]
    return "\n".join(out + _geomean_line(lat.rows, cfg.backends, emulated))
