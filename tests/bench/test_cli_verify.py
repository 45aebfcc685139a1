"""`bcg verify`: the segment-by-segment check from the command line (exit 1 on divergence)."""

from __future__ import annotations

import json

import pytest

from bcg.cli import main

ARGS = ["verify", "--model", "tiny-dense", "--backend", "breakable", "--device", "cpu", "--buckets", "8,16",
        "--num-tokens", "5,12", "--no-progress"]


def test_verify_passes_on_correct_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["kind"] == "verify" and summary["ok"] is True and summary["buckets"] == [8, 16]


def test_verify_exits_1_and_names_the_segment(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.graph import EagerStep
    from bcg.runtime.backends.breakable import BreakableBackend

    original = BreakableBackend.capture

    def capture(self, n):
        graph = original(self, n)
        if n == 16:  # the last segment of bucket 16 writes a wrong output
            last = [s for s in graph.steps if not isinstance(s, EagerStep)][-1]
            real, out = last.replay, self.resources.inputs.static_output

            def faulty() -> None:
                real()
                out[0, 0] += 1.0

            last.replay = faulty
        return graph

    monkeypatch.setattr(BreakableBackend, "capture", capture)
    assert main(ARGS) == 1
    out = capsys.readouterr().out
    assert "bucket 16" in out and "diverges" in out and "output" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False and summary["first_divergence"]["16"]["kind"] == "segment"
