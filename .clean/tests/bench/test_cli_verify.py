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


def test_verify_full_passes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    # The CPU's 256-token chunk gives full one request slot; the check batch packs two.
    assert main(["verify", "--backend", "full", "--device", "cpu", "--buckets", "8,16", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] is True and summary["buckets"] == [8, 16] and summary["skipped"] == {}


def test_verify_where_no_size_replays_says_why_and_which_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--backend", "full", "--device", "cpu", "--buckets", "8", "--max-requests", "1", "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("bcg verify: error: no batch size replays a graph (1 skipped, e.g. a batch of 8 tokens "
                             "does not replay a graph (too_many_requests)); give --max-requests 2 or more"), err


def test_verify_tc_piecewise_on_the_cpu_reports_in_words(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--backend", "tc_piecewise", "--device", "cpu", "--buckets", "8", "--num-tokens", "5",
            "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bucket 8 (5 tokens, tc_piecewise): no divergence"), out


@pytest.mark.parametrize("argv, message", [
    (["--backend", "tc_piecewise", "--tc-compiler", "inductor"],
     "--tc-compiler inductor cannot run under the CPU emulation"),
    (["--num-tokens", "5000"], "--num-tokens: 5000 tokens is more than 'tiny-dense' holds (its context is 4096"),
    (["--num-tokens", "16,300"], "--num-tokens: 300 tokens is more than --chunked-prefill-size 256"),
])
def test_verify_refuses_what_cannot_run_before_building(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"bcg verify: error: {message}"), err
