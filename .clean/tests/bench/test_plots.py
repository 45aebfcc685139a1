"""The figures of `bcg bench`: one colour per variant, legends off the bars, no stale PNGs (`bcg analyze`'s:
test_analyze_plots.py)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from bcg.bench import plots
from bcg.cli import main


def _rows(wall_ms: dict[str, float], lengths: tuple[int, ...] = (16, 32, 64)) -> list[dict]:
    """Result rows as results.json holds them, eager first."""
    eager = wall_ms["eager"]
    return [{"backend": b, "input_len": n, "wall": {"median_ms": ms, "q1_ms": ms * 0.95, "q3_ms": ms * 1.05},
             "speedup": {"over_eager": eager / ms, "low": eager / ms / 1.1, "high": eager / ms * 1.1},
             "device": {"floor_ms": 0.5}} for b, ms in wall_ms.items() for n in lengths]


def _no_overlap(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
        lines = [line.get_window_extent(renderer) for line in ax.lines]
        assert (bars or lines) and not any(legend.overlaps(b) for b in bars + lines)


def test_a_variant_has_one_colour_in_every_figure() -> None:
    rows = _rows({"eager": 4.0, "breakable": 2.0, "full": 1.0})
    latency, speedup = plots.latency_figure(rows), plots.speedup_figure(rows)
    try:
        from matplotlib.colors import to_rgba
        from matplotlib.container import BarContainer, ErrorbarContainer

        lines = {c.get_label(): c.lines[0].get_color() for c in latency.axes[0].containers
                 if isinstance(c, ErrorbarContainer)}
        bars = {c.get_label(): c.patches[0].get_facecolor() for c in speedup.axes[0].containers
                if isinstance(c, BarContainer)}

        assert set(bars) == {"breakable", "full"} and set(lines) == {"eager", "breakable", "full"}
        assert all(to_rgba(lines[b]) == bars[b] for b in bars)
    finally:
        plt.close("all")


def test_legends_keep_off_the_bars_and_lines() -> None:
    # The CUDA default variants, all about as fast: bars of one height everywhere leave a legend no free corner.
    variants = ["breakable", "breakable+fused", "breakable+inductor", "full", "tc_piecewise"]
    rows = _rows({"eager": 4.0} | dict.fromkeys(variants, 1.0), lengths=(64, 128, 256, 512, 1024, 2048))
    for fig in (plots.latency_figure(rows, "tiny-dense on cpu"), plots.speedup_figure(rows, "tiny-dense on cpu")):
        _no_overlap(fig)
    plt.close("all")


def test_no_plots_removes_the_pngs_of_an_earlier_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--device", "cpu", "--runs", "1", "--warmup", "0", "--no-progress", "--batch-requests", "1",
            "--no-memory", "--lengths", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "latency.png").exists() and (tmp_path / "speedup.png").exists()
    (tmp_path / "memory.png").write_bytes(b"a figure of an earlier run on a GPU")
    (tmp_path / "mine.png").write_bytes(b"not bcg's")
    assert main([*argv, "--no-plots"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["plots"] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "results.json"]
