"""The PNG figures of ``bcg bench`` and ``bcg analyze`` (matplotlib, Agg backend: no display needed).

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

__all__ = ["ANALYZE_PLOTS", "BENCH_PLOTS", "CPU_PLOT_NOTE", "amdahl_figure", "analyze_figure", "analyze_figures",
           "bench_figures", "cores_figure", "latency_figure", "memory_figure", "speedup_figure", "write_plots"]

BENCH_PLOTS = ("latency.png", "speedup.png", "memory.png")
ANALYZE_PLOTS = ("analyze.png", "amdahl.png", "cpu_cores.png")
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
    kernel floor dashed. Flat lines over a 32x length range are the seed's signature of launch-bound prefill.

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


def _analyze_colors(names: Sequence[str]) -> dict[str, str]:
    return {n: f"C{i % 10}" for i, n in enumerate(names)}


def analyze_figure(analysis: dict[str, Any], title: str = "") -> Any:
    """Two panels: every variant's prefill latency against the input length (predicted dashed, measured solid with
    ``--validate``; eager measured), and the forward-size histogram of the workload on the recommended ladder,
    replayed against eager, with the ceiling marked (legends under the panels, whole-number counts).

    Example::

        analyze_figure(json.loads(Path("out/analyze/results.json").read_text())).savefig("analyze.png")
    """
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.5))
    predicted, measured = analysis["predictions"], analysis.get("measured") or {}
    colors = _analyze_colors(list(dict.fromkeys([*predicted, *measured])))
    lengths: set[int] = set()
    for name, by_len in predicted.items():
        pts = sorted((int(n), ms) for n, ms in by_len.items() if ms is not None)
        lengths |= {n for n, _ in pts}
        eager = name.startswith("eager")
        ax1.plot([n for n, _ in pts], [ms for _, ms in pts], "-" if eager else "--", marker="o" if eager else "x",
                 color=colors[name], label=f"{name} ({'measured' if eager else 'predicted'})")
    for name, by_len in measured.items():
        if name.startswith("eager"):
            continue
        pts = sorted((int(n), ms) for n, ms in by_len.items() if ms is not None)
        ax1.plot([n for n, _ in pts], [ms for _, ms in pts], "-", marker="o", color=colors[name],
                 label=f"{name} (measured)")
    if lengths:
        _log2_axis(ax1, sorted(lengths))
    ax1.set_xlabel("input length (tokens, one request)")
    ax1.set_ylabel("prefill latency (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Predicted before capture" + (", then measured" if measured else ""))
    ax1.grid(True, which="both", alpha=0.3)
    _legend_below(ax1, ncol=2, fontsize=7)

    cov = analysis["parameters"]["bucket_coverage"]
    sizes, graph = cov["forward_sizes"], cov["forward_graph"]
    if sizes:
        import numpy as np

        bins = np.logspace(np.log2(max(min(sizes), 1)), np.log2(max(sizes) + 1), 30, base=2)
        ax2.hist([[s for s, g in zip(sizes, graph) if g], [s for s, g in zip(sizes, graph) if not g]], bins=bins,
                 stacked=True, label=["replays a graph", "runs eagerly"], color=["tab:green", "tab:red"])
        _log2_axis(ax2, [2**k for k in range(int(np.log2(max(min(sizes), 1))), int(np.log2(max(sizes))) + 2)])
    rec = analysis["recommendation"]
    if rec["ceiling"] is not None:
        ax2.axvline(rec["ceiling"], color="k", ls="--", label=f"ceiling {rec['ceiling']}")
    ax2.axvline(cov["chunked_prefill_size"], color="tab:gray", ls=":", label=f"chunk {cov['chunked_prefill_size']}")
    ax2.set_xlabel("forward size (tokens)")
    ax2.set_ylabel("forwards")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of forwards has no fractions
    ax2.set_title(f"{rec['backend']}: coverage {cov['graph_fraction']:.0%}, padding {cov['padding_waste']:.0%}")
    _legend_below(ax2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def amdahl_figure(analysis: dict[str, Any], title: str = "") -> Any:
    """The Amdahl curve of this model: the speedup over eager against how much faster the captured part runs
    (``1 / (p + (1 - p) / n)`` at the measured dynamic share ``p``), its ceiling ``1 / p``, and the predicted (and
    measured) breakable point on it; a second panel shows the ceiling ``1 / p`` for every ``p`` with this model's.

    Example::

        amdahl_figure(analysis).savefig("amdahl.png")
    """
    import numpy as np

    plt = _plt()
    am = analysis["amdahl"]
    p = am["p"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    ns = np.logspace(0, 3, 200)
    ax1.plot(ns, 1.0 / (p + (1.0 - p) / ns), color="tab:blue", label=f"1 / (p + (1 - p) / n), p = {p:.3f}")
    if p > 0:
        ax1.axhline(1.0 / p, color="tab:blue", ls=":", label=f"S_max = 1/p = {1 / p:.2f}x")
    for key, marker, label in (("predicted", "x", "predicted"), ("measured", "o", "measured (--validate)")):
        s, n = am.get(f"{key}_speedup"), am.get(f"{key}_n")
        if s is not None and n is not None:
            color = "tab:red" if key == "measured" else "tab:orange"
            ax1.plot([min(n, ns[-1])], [s], marker, color=color, markersize=10, markerfacecolor="none",
                     markeredgewidth=2, label=f"{am['variant']} {label}: {s:.2f}x")
    ax1.set_xscale("log")
    ax1.set_xlabel("n: how much faster the captured part runs")
    ax1.set_ylabel("speedup over eager (x)")
    ax1.set_title(f"Amdahl curve at {am['length']} tokens")
    ax1.grid(True, which="both", alpha=0.3)
    _legend_below(ax1, ncol=1, fontsize=7)
    ps = np.linspace(0.01, 1.0, 200)
    ax2.plot(ps, 1.0 / ps, color="tab:gray", label="S_max = 1/p")
    ax2.plot([p], [1.0 / p if p > 0 else 100.0], "o", color="tab:blue", label=f"this model: p = {p:.3f}")
    ax2.set_yscale("log")
    ax2.set_xlabel("p: share that stays eager (islands and host work)")
    ax2.set_ylabel("ceiling on the speedup (x)")
    ax2.set_title("The dynamic share bounds every graph")
    ax2.grid(True, which="both", alpha=0.3)
    _legend_below(ax2, ncol=1, fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def cores_figure(analysis: dict[str, Any], title: str = "") -> Any:
    """The host as a variable: every variant's latency at the representative length against the cores the process
    was pinned to (predicted dashed, measured solid), and the eager forward's launch-gap share.

    Example::

        cores_figure(analysis).savefig("cpu_cores.png")
    """
    plt = _plt()
    data = {int(k): v for k, v in analysis["cpu_cores"].items()}
    cores = sorted(data)
    names = list(dict.fromkeys(v for r in data.values() for v in r["predictions"]))
    colors = _analyze_colors(names)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    for name in names:
        ax1.plot(cores, [data[k]["predictions"].get(name) for k in cores], "--", marker="x", color=colors[name],
                 label=f"{name} ({'measured' if name.startswith('eager') else 'predicted'})")
        got = [(data[k].get("measured") or {}).get(name) for k in cores]
        if any(g is not None for g in got) and not name.startswith("eager"):
            ax1.plot(cores, got, "-", marker="o", color=colors[name], label=f"{name} (measured)")
    ax1.set_xticks(cores)
    ax1.set_xlabel("CPU cores (process pinned; torch threads = cores)")
    ax1.set_ylabel(f"prefill latency at {analysis['length']} tokens (ms)")
    ax1.set_ylim(bottom=0)
    ax1.grid(True, alpha=0.3)
    _legend_below(ax1, ncol=2, fontsize=7)
    ax2.plot(cores, [data[k]["launch_gap_share"] for k in cores], marker="o", color="tab:purple")
    ax2.set_xticks(cores)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("CPU cores")
    ax2.set_ylabel("launch-gap share of the eager forward")
    ax2.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def analyze_figures(analysis: dict[str, Any], title: str) -> dict[str, Callable[[], Any]]:
    """The figures of a ``bcg analyze`` results dict, by file name (cpu_cores.png only with ``--cpu-cores``)."""
    note = f"\n{CPU_PLOT_NOTE}" if analysis["environment"].get("emulated") else ""
    figures = {"analyze.png": lambda: analyze_figure(analysis, title + note)}
    if analysis["amdahl"].get("p") is not None:
        figures["amdahl.png"] = lambda: amdahl_figure(analysis, title + note)
    if analysis.get("cpu_cores"):
        figures["cpu_cores.png"] = lambda: cores_figure(analysis, title + note)
    return figures


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
