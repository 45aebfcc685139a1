"""The profiler ``bcg analyze`` runs is quiet: the native start/stop lines torch's profiler writes to stderr are
dropped, anything else written to stderr meanwhile still shows."""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity

from bcg.bench.quiet_profiler import quiet_profile


def test_the_profilers_start_and_stop_lines_are_dropped(capfd: pytest.CaptureFixture[str]) -> None:
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).add_(1.0)
    assert any(e.name == "aten::add_" for e in prof.events())
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT" not in err


def test_other_stderr_lines_written_at_start_still_show(capfd: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.profiler import profile

    start = profile.start

    def noisy_start(self: profile) -> None:
        os.write(2, b"USDT:2026-12-02 07:07:03 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning that matters\n")
        start(self)

    monkeypatch.setattr(profile, "start", noisy_start)
    with quiet_profile(activities=[ProfilerActivity.CPU]):
        torch.ones(8).add_(1.0)
    err = capfd.readouterr().err
    assert "a warning that matters" in err and "profiler_start" not in err


def test_a_repeatable_island_is_timed_back_to_back_once_per_forward():
    """IslandTimer(repeats=R) runs a repeatable island R more times after its first call of a forward (the host cost
    a replay pays) and any other island once; host_times takes those back-to-back times for the island."""
    from bcg.bench import profile

    calls = []
    timer = profile.IslandTimer(repeats=4)
    for name in ("attention_island", "attention_island", "experts"):
        timer(lambda n=name: calls.append(n), name, (), {})
    assert calls.count("attention_island") == 2 + 4 and calls.count("experts") == 1
    assert set(timer.steady_us) == {"attention_island"} and timer.calls["attention_island"] == 2
    low, mid, high = sorted(timer.steady_us["attention_island"])
    assert 0 <= low <= mid <= high
