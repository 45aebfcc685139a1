"""The readable report of ``bcg bench``: build, latency and memory tables, what was not measured and why, and the
geomean speedups, labelled for what they measure.

:mod:`bcg.bench.latency` and :mod:`bcg.bench.memory` measure; this module only formats their results, so every
line a user reads can be tested without an engine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bcg.bench.report import describe_reason, fmt, fmt_bytes, table
from bcg.bench.variants import parse_variant

__all__ = ["CPU_PLOT_NOTE", "CPU_SPEEDUP_NOTE", "NOISY_SPREAD", "format_bench", "geomean_speedups", "spread"]

# A row whose middle half of runs spans more than this share of its median cannot separate backends within it.
NOISY_SPREAD = 0.25
CPU_SPEEDUP_NOTE = ("CPU emulation: speedups measure the emulation's replay against eager on the CPU, not the "
                    "kernel-launch overhead graphs remove on a GPU")
CPU_PLOT_NOTE = "CPU emulation: speedups measure the emulation, not launch overhead"


def spread(row: Any) -> float | None:
    """Interquartile range of a latency row over its median (0.1 = the middle half of runs spans 10%)."""
    return (row.q3_ms - row.q1_ms) / row.median_ms if row.median_ms > 0 else None


def geomean_speedups(rows: Sequence[Any], backends: Sequence[str]) -> dict[str, float]:
    """Geometric mean of the one-request speedups over eager of every graph backend that has rows.

    Backends that were unavailable or refused have no rows, so nothing they would have served eagerly counts.

    Example::

        geomean_speedups(result.rows, ["eager", "breakable"])   # {"breakable": 2.41}
    """
    out: dict[str, float] = {}
    for b in backends:
        vals = [r.speedup_vs_eager for r in rows if r.backend == b and r.speedup_vs_eager]
        if b != "eager" and vals:
            out[b] = statistics.geometric_mean(vals)
    return out


def _speedup_range(r: Any) -> str:
    if r.speedup_low is None or r.speedup_high is None:
        return "-"
    return f"{r.speedup_low:.2f}-{r.speedup_high:.2f}x"


def _latency_table(title: str, rows: Sequence[Any], cuda: bool) -> str:
    headers = ["backend", "kernels", "compile", "tokens", "reqs", "median ms", "q1-q3 ms", "spread", "speedup",
               "speedup range"]
    fused_floors = cuda and any(r.fused_floor_ms for r in rows)
    headers += ["kernel floor"] + (["fused floor"] if fused_floors else []) + ["launch gap"] if cuda else []
    cells = []
    for r in rows:
        s, v = spread(r), parse_variant(r.backend)
        row = [v.backend, v.kernels, v.compile_label, r.num_tokens, r.num_requests, fmt(r.median_ms, 3),
               f"{r.q1_ms:.3f}-{r.q3_ms:.3f}", "-" if s is None else f"{s:.0%}", fmt(r.speedup_vs_eager, 2, "x"),
               _speedup_range(r)]
        if cuda:
            row += [fmt(r.kernel_floor_ms, 3)] + ([fmt(r.fused_floor_ms, 3)] if fused_floors else [])
            row += [fmt(r.launch_gap_share, 2)]
        cells.append(row + [_tokens(r), describe_reason(r.graph_used, r.reason, r.bucket)])
    headers += ["tokens = eager", "graph"]
    if any((spread(r) or 0) > NOISY_SPREAD for r in rows):
        headers.append("")
        for r, row in zip(rows, cells):
            row.append("noisy" if (spread(r) or 0) > NOISY_SPREAD else "")
    return table(headers, cells, title=title)


def _tokens(r: Any) -> str:
    """The greedy-token column: ``-`` for eager itself, else whether the tokens equal eager's."""
    return "-" if r.backend == "eager" else fmt(r.tokens_equal_eager)


def _build_table(builds: Sequence[Any]) -> str:
    def status(b: Any) -> str:
        return "yes" if b.available else "refused" if b.refused_reason else "no"

    return table(["backend", "available", "kernels", "compile", "build ms", "compile ms", "capture ms", "buckets",
                  "segs/breaks", "graph mem"],
                 [[parse_variant(b.backend).backend, status(b), parse_variant(b.backend).kernels,
                   parse_variant(b.backend).compile_label, fmt(b.build_ms, 0), fmt(b.compile_ms, 0),
                   fmt(b.capture_ms, 0),
                   f"{b.num_captured}/{b.num_buckets}" if b.available else "-",
                   f"{fmt(b.num_segments)}/{fmt(b.num_breaks)}", fmt_bytes(b.graph_memory_bytes)]
                  for b in builds], title="Build")


def format_bench(cfg: Any, lat: Any, mem: Any, emulated: bool) -> str:
    """The text ``bcg bench`` prints: tables, the unavailable backends with their reasons, notes, geomeans."""
    out = [_build_table(lat.builds)]
    gone = [b for b in lat.builds if not b.available]
    if gone:
        out += ["", "Unavailable (not measured, in no speedup):"]
        out += [f"  {b.backend}: {b.error}" for b in gone]
    failed = [b for b in lat.builds if b.available and b.error]
    if failed:
        out += ["", "Failed part-way (rows up to the failure are kept):"]
        out += [f"  {b.backend}: {b.error}" for b in failed]
    where = " (CPU emulation)" if emulated else ""
    for t, rows in ((f"Latency, one request{where}", lat.rows),
                    (f"Latency, {cfg.batch_requests} requests, same total tokens{where}", lat.batch_rows)):
        if rows:
            out += ["", _latency_table(t, rows, not emulated)]
    noisy = sum(1 for r in lat.rows + lat.batch_rows if (spread(r) or 0) > NOISY_SPREAD)
    if noisy:
        out += ["", f"{noisy} row(s) marked noisy: their middle half of runs spans more than "
                    f"{NOISY_SPREAD:.0%} of the median, so backends within that spread are not told apart; the "
                    "machine was busy. Rerun, or raise --runs."]
    differ = [r for r in lat.rows + lat.batch_rows if r.tokens_equal_eager is False]
    if differ:
        out += ["", f"{len(differ)} row(s) chose a different greedy token than eager: "
                + ", ".join(f"{r.backend} at {r.num_tokens} tokens (eager's top-2 gap {fmt(r.eager_top2_gap, 4)})"
                            for r in differ)
                + ". A gap near the dtype's rounding is a near-tie; a wide one is a wrong answer."]
    if lat.batch_rows and cfg.batch_requests > 1:
        out += ["", f"The {cfg.batch_requests}-request rows pack requests of the same total tokens; a graph "
                    "backend that cannot replay such a batch runs it eagerly, and its graph column says why."]
    if mem is not None:
        out.append("")
        if mem.available:
            out.append(table(["ceiling", "backend", "buckets", "graph mem", "activation peak", "total above base",
                              "replayed"],
                             [[r.label if r.ceiling is None else f"{r.label} ({r.ceiling})", r.backend,
                               r.num_buckets, fmt_bytes(r.graph_memory_bytes), fmt_bytes(r.activation_peak_bytes),
                               fmt_bytes(r.device_used_above_baseline_bytes), fmt(r.graph_used)]
                              for r in mem.rows],
                             title=f"Memory after one {mem.chunked_prefill_size}-token prefill"))
        else:
            out.append(f"Memory: {mem.note}")
    geo = geomean_speedups(lat.rows, cfg.backends)
    if geo:
        line = ", ".join(f"{b} {v:.2f}x" for b, v in geo.items())
        label = f" ({CPU_SPEEDUP_NOTE})" if emulated else ""
        n = len(cfg.lengths)
        out += ["", f"Geomean speedup over eager, one request, {n} length{'s' if n != 1 else ''}: {line}{label}."]
    return "\n".join(out)
