"""The figures of `bcg analyze`, drawn from the JSON of synthetic findings: whole-number counts, legends off the bars
and lines, the Amdahl curve through its points, the core-count figure, and which PNGs a run writes."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from test_analyze_recommend import measurements

from bcg.bench import analysis_plots as plots
from bcg.bench.findings import findings
from bcg.bench.results import jsonable


def analysis(validated: bool = True, cores: list[int] | None = None) -> dict:
    a = findings(measurements(validated=validated, cores=cores))
    a.update(environment={"emulated": False}, length=64)
    return jsonable(a)


def _legends_clear(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
        assert not any(box.overlaps(b) for b in bars + [ax.get_window_extent(renderer)])


def test_analyze_figure_predicted_and_measured_lines_and_whole_forwards() -> None:
    fig = plots.analyze_figure(analysis(), "m on H200")
    ax1, ax2 = fig.axes[:2]
    labels = [line.get_label() for line in ax1.lines]
    assert "breakable (predicted)" in labels and "breakable (measured)" in labels and "eager (measured)" in labels
    assert labels.count("eager (measured)") == 1  # eager is measured either way: one line
    ticks = [t for t in ax2.get_yticks() if ax2.get_ylim()[0] <= t <= ax2.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    _legends_clear(fig)
    plt.close(fig)


def test_amdahl_figure_puts_the_points_on_the_curve() -> None:
    a = analysis()
    fig = plots.amdahl_figure(a)
    ax = fig.axes[0]
    p = a["amdahl"]["p"]
    for key in ("predicted", "measured"):
        s, n = a["amdahl"][f"{key}_speedup"], a["amdahl"][f"{key}_n"]
        point = next(line for line in ax.lines if line.get_label().endswith(f"{s:.2f}x"))
        assert point.get_ydata()[0] == pytest.approx(s)
        assert 1.0 / (p + (1 - p) / n) == pytest.approx(s)  # on the curve of this p
    assert any(line.get_label().startswith("S_max = 1/p") for line in ax.lines)
    _legends_clear(fig)
    plt.close(fig)


def test_cores_figure_and_which_pngs_a_run_draws() -> None:
    a = analysis(cores=[1, 2])
    fig = plots.cores_figure(a)
    assert [t for t in fig.axes[0].get_xticks()] == [1, 2]
    plt.close(fig)
    assert set(plots.analyze_figures(a, "t")) == {"analyze.png", "amdahl.png", "cpu_cores.png"}
    assert set(plots.analyze_figures(analysis(validated=False), "t")) == {"analyze.png", "amdahl.png"}
