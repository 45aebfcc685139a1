"""The PNG figures of ``bcg analyze``: predicted against measured latency with the workload's coverage, the Amdahl
curve of the model with its points, and the host as a variable. Each takes the plain data of results.json, so it can
be redrawn from the file alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bcg.bench.plots import CPU_PLOT_NOTE, _legend_below, _log2_axis, _plt

__all__ = ["ANALYZE_PLOTS", "amdahl_figure", "analyze_figure", "analyze_figures", "cores_figure"]

ANALYZE_PLOTS = ("analyze.png", "amdahl.png", "cpu_cores.png")


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
