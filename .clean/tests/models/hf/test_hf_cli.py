"""`bcg bench` and `bcg analyze` on a transformers checkpoint (--model-impl transformers), under the CPU emulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_cases import make_model

from bcg.cli import main

FAST = ["--device", "cpu", "--runs", "1", "--warmup", "0", "--no-progress", "--no-plots"]


def test_bench_and_analyze_a_transformers_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, impl = tmp_path / "gpt-oss-tiny", "transformers"
    make_model("gpt_oss").save_pretrained(folder)
    rc = main(["bench", *FAST, "--model", str(folder), "--model-impl", impl, "--lengths", "8,16",
               "--backends", "eager,breakable", "--batch-requests", "1", "--chunked-prefill-size", "16", "--no-memory",
               "--no-profile",
               "--out", str(tmp_path / "bench")])
    assert rc == 0
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["config"]["model_impl"] == impl
    rows = {(r["backend"], r["input_len"]): r for r in results["rows"]}
    assert rows[("breakable", 16)]["graph_used"] and not rows[("eager", 16)]["graph_used"]
    capsys.readouterr()
    rc = main(["analyze", *FAST, "--model", str(folder), "--model-impl", impl, "--chunked-prefill-size", "16",
               "--length", "8", "--lengths", "5,12", "--out", str(tmp_path / "analyze")])
    assert rc == 0
    analysis = json.loads((tmp_path / "analyze" / "results.json").read_text())
    assert analysis["model"]["arch"] == "transformers:gpt_oss" and analysis["model"]["num_layers"] == 4
    # which modules run as islands, and what each costs: the attention of each of the 4 layers
    assert [(i["name"], i["calls"]) for i in analysis["islands"]][:1] == [("attention_island", 4)]
    assert analysis["islands"][0]["host_us"] > 0 and "breakable" in analysis["predictions"]
