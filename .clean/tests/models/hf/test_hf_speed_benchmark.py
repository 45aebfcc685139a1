"""benchmarks/hf_speed.py (issue 21's GPU measurement) runs end to end in its CPU smoke mode, and one model failing
does not lose the others."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "hf_speed.py"


def _module():
    spec = importlib.util.spec_from_file_location("hf_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "hf_speed.json"
    assert _module().main(["--smoke", "--shapes", "llama-3.2-1b", "--archs", "gpt_oss,no_such_arch", "--workdir",
                           str(tmp_path), "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    summary = json.loads(out.read_text())
    assert summary["errors"] == ["no_such_arch: unknown architecture (known: " + ", ".join(_module().ARCHS) + ")"]
    llama = summary["results"]["by_path"]["llama-3.2-1b"]
    for path in ("tf", "native", "tf_compiled", "native_compiled"):
        rows = llama[path]["by_length"]
        assert set(rows) == {"8", "16"} and all(r["graph_used"] and r["ms"] > 0 for r in rows.values()), path
    assert llama["tf_compiled"]["layer_graphs"] == 1 and llama["tf"]["notes"][0].startswith("fused at load")
    assert set(summary["results"]["archs"]["gpt_oss"]["tf"]["by_length"]) == {"8", "16"}
    text = capsys.readouterr().out
    assert "| llama-3.2-1b | 16 |" in text and "| gpt_oss |" in text
    assert text.strip().splitlines()[-1] == out.read_text()  # the last line is the JSON


def test_smoke_moe_shapes_by_path(tmp_path: Path) -> None:
    """The Qwen3-30B-A3B and gpt-oss-20b shapes (shrunk) load by path with their MoE blocks fused; Qwen3-MoE also runs
    the native path (bcg's MoE model), gpt-oss has none and says so by its absence."""
    out = tmp_path / "hf_speed.json"
    assert _module().main(["--smoke", "--shapes", "qwen3-30b-a3b-8l,gpt-oss-20b-8l", "--archs", "", "--workdir",
                           str(tmp_path), "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["errors"] == []
    qwen, oss = (summary["results"]["by_path"][s] for s in ("qwen3-30b-a3b-8l", "gpt-oss-20b-8l"))
    assert any(n.startswith("fused MoE blocks: 2 Qwen3MoeSparseMoeBlock") for n in qwen["tf"]["notes"])
    assert any(n.startswith("fused MoE blocks: 2 GptOssMLP") for n in oss["tf"]["notes"])
    assert all(r["token_equal"] for p in (qwen["tf"], qwen["native"], oss["tf"]) for r in p["by_length"].values())
    assert "native" not in oss
