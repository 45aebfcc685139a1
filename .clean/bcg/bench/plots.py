"""The PNG figures of ``bcg bench`` (matplotlib, Agg backend: no display needed), and the helpers ``bcg analyze``'s
figures (:mod:`bcg.bench.analysis_plots`) share.

Each figure takes the plain data ``results.json`` holds (dicts, :mod:`bcg.bench.results`), so it can be redrawn
from the file alone; one colour per variant in every figure of a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bcg.errors import first_line

__all__ = ["BENCH_PLOTS", "CPU_PLOT_NOTE", "bench_figures", "latency_figure", "memory_figure", "speedup_figure",
           "write_plots"]

BENCH_PLOTS = ("latency.png", "speedup.png", "memory.png")
CPU_PLOT_NOTE = "CPU emulation: speedups measure the emulation, not launch overhead"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: the benchmark machine has no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def _log2_axis(ax: Any, ticks: Sequence[int]) -> None:
    """Log2 x axis labelled with plain token counts (64, 128, ...) rather than powers of two."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()


def _backends(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["backend"] for r in rows))


def _legend_below(ax: Any, ncol: int = 2, fontsize: int = 8) -> None:
    """A legend under the axes, where it cannot hide a bar or a line (only when something carries a label)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, fontsize=fontsize, frameon=False)


def _colors(rows: Sequence[dict]) -> dict[str, str]:
    """One colour per variant, the same in every figure of a run (eager included, though speedup has no bar of it)."""
    return {b: f"C{i % 10}" for i, b in enumerate(_backends(rows))}


def latency_figure(rows: Sequence[dict], title: str = "") -> Any:
    """Median prefill latency vs input length, one line per variant (bars: interquartile range), log2 x axis,
    kernel floor dashed. Flat lines over a 32x length range are the signature of launch-bound prefill (as in SGLang's
    breakable-graph post, the article bcg started from).

    Example::

        latency_figure(results["rows"], "llama-dense on H200").savefig("latency.png")
    """
    plt, colors = _plt(), _colors(rows)
    fig, ax = plt.subplots(figsize=(7, 5))
    for backend in _backends(rows):
        pts = sorted((r["input_len"], r["wall"]["median_ms"], r["wall"]["q1_ms"], r["wall"]["q3_ms"]) for r in rows
                     if r["backend"] == backend)
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[y - q1 for _, y, q1, _ in pts],
                                                                   [q3 - y for _, y, _, q3 in pts]],
                    marker="o", capsize=3, label=backend, color=colors[backend])
    floor = sorted({(r["input_len"], r["device"]["floor_ms"]) for r in rows if r["device"]["floor_ms"] is not None})
    if floor:
        ax.plot([x for x, _ in floor], [y for _, y in floor], "k--", label="kernel floor (eager)")
    _log2_axis(ax, sorted({r["input_len"] for r in rows}))
    ax.set_xlabel("input length (tokens, one request)")
    ax.set_ylabel("prefill latency (ms): median, bars q1-q3")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Isolated prefill latency")
    ax.grid(True, which="both", alpha=0.3)
    _legend_below(ax, ncol=3)
    fig.tight_layout()
    return fig


def speedup_figure(rows: Sequence[dict], title: str = "") -> Any:
    """Grouped bars of speedup over eager per input length and variant, with a line at 1x; the whiskers span the
    speedups the two rows' interquartile ranges allow; the legend sits under the axes, off the bars.

    Example::

        speedup_figure(results["rows"]).savefig("speedup.png")
    """
    plt, colors = _plt(), _colors(rows)
    backends = [b for b in _backends(rows) if b != "eager"]
    lengths = sorted({r["input_len"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 5))
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        by_len = {r["input_len"]: r["speedup"] or {} for r in rows if r["backend"] == backend}
        mid = [by_len.get(n, {}).get("over_eager") or 0.0 for n in lengths]
        lo = [max(m - (by_len.get(n, {}).get("low") or m), 0.0) for n, m in zip(lengths, mid)]
        hi = [max((by_len.get(n, {}).get("high") or m) - m, 0.0) for n, m in zip(lengths, mid)]
        ax.bar([j + i * width for j in range(len(lengths))], mid, width, yerr=[lo, hi], capsize=3, label=backend,
               color=colors[backend])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(lengths))])
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("speedup over eager (x)")
    ax.set_title(title or "Prefill speedup over eager")
    _legend_below(ax, ncol=3)
    fig.tight_layout()
    return fig


def memory_figure(rows: Sequence[dict], title: str = "") -> Any:
    """Memory above the no-graph baseline per capture ceiling: device-level total and resident graph memory.

    Example::

        memory_figure(results["memory"]["rows"]).savefig("memory.png")
    """
    plt = _plt()
    rows = [r for r in rows if r.get("available")]
    labels = [r["label"] if r["ceiling"] is None else f"{r['label']}\n({r['ceiling']})" for r in rows]
    gib = 2.0**30

    def series(key: str) -> list[float]:
        return [(r.get(key) or 0) / gib for r in rows]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], series("device_used_above_baseline_bytes"), 0.4, label="total above baseline")
    ax.bar([x + 0.2 for x in xs], series("graph_memory_bytes"), 0.4, label="resident graph memory")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_xlabel("capture ceiling (fraction of chunked_prefill_size)")
    ax.set_ylabel("GiB")
    ax.set_title(title or "Memory after one chunk-sized prefill")
    ax.legend()
    fig.tight_layout()
    return fig


def bench_figures(results: dict[str, Any], title: str) -> dict[str, Callable[[], Any]]:
    """The figures of a ``bcg bench`` results dict, by file name: latency and speedup when rows were measured, memory
    when it was (CUDA)."""
    rows, mem = results["rows"], results["memory"]
    if not rows:
        return {}
    note = f"\n{CPU_PLOT_NOTE}" if results["environment"]["emulated"] else ""
    figures = {"latency.png": lambda: latency_figure(rows, title),
               "speedup.png": lambda: speedup_figure(rows, title + note)}
    if mem is not None and mem["available"]:
        figures["memory.png"] = lambda: memory_figure(mem["rows"], title)
    return figures


def write_plots(figures: dict[str, Callable[[], Any]], out: str | os.PathLike, known: Sequence[str]) -> list[str]:
    """Draws and saves each figure under ``out``; returns the paths written. A figure that fails is reported on stderr
    and skipped (the measurements stand). Every PNG of ``known`` this run did not write is removed, so a previous
    run's figures never sit beside results that have none.

    Example::

        write_plots(bench_figures(results, "tiny-dense on cpu"), "out/bench", BENCH_PLOTS)
    """
    written: list[str] = []
    for name, draw in figures.items():
        try:
            written.append(str(_save(draw(), Path(out) / name)))
        except Exception as e:  # a failed figure must not lose the measurements
            print(f"bcg: could not draw {name}: {first_line(e)}", file=sys.stderr)
    for name in known:
        stale = Path(out) / name
        if str(stale) not in written:
            stale.unlink(missing_ok=True)
    return written
