"""scripts/hf_evidence.py (the GPU measurement of the transformers path) runs end to end in its CPU smoke mode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "hf_evidence.py"


def test_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("hf_evidence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    out = tmp_path / "hf.json"
    assert module.main(["--smoke", "--device", "cpu", "--workdir", str(tmp_path), "--out", str(out),
                        "--fp32-reference", "--ungraphed"]) == 0
    assert torch.get_num_threads() == threads
    summary = json.loads(out.read_text())
    assert summary["errors"] == []
    qwen3, gpt_oss = summary["results"]["qwen3-0.6b"], summary["results"]["gpt-oss-small"]
    assert qwen3["from_disk"] and not gpt_oss["from_disk"] and "native_breakable" not in gpt_oss
    for rows in (qwen3["tf_breakable"], qwen3["native_breakable"], gpt_oss["tf_breakable"]):
        assert set(rows["by_length"]) == {"8", "16"}
        assert all(r["graph_used"] and r["ms"] > 0 and "token_equal" in r for r in rows["by_length"].values())
    # fp32 on the CPU: the bf16 model, the engine with and without graphs all measured against its fp32 copy
    for rows in (qwen3["tf_breakable"], gpt_oss["tf_eager"]):
        assert all(r["rel_logit_diff_fp32"] < 0.1 and "token_equal_fp32" in r for r in rows["by_length"].values())
    assert all("rel_logit_diff_fp32" in r for r in gpt_oss["hf"].values())
    assert not any(r["graph_used"] for r in gpt_oss["tf_eager"]["by_length"].values())
    assert "| qwen3-0.6b | 16 |" in capsys.readouterr().out
