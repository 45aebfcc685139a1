"""Misuse of `bcg bench`, `bcg analyze` and `bcg verify` (bad checkpoints included) is one line and the right exit
status (2: usage, 1: nothing could be measured, 130: interrupted), never a traceback or a run that measured nothing
and exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bcg.bench.config import VerifyConfig
from bcg.cli import main
from bcg.runtime import Engine

COMMON = ["--device", "cpu", "--runs", "1", "--warmup", "0", "--no-progress", "--no-plots"]
FAST = [*COMMON, "--batch-requests", "1", "--no-memory"]  # bench's


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line or "interrupted" in line]
    assert len(lines) == 1, err
    return lines[0]


def _checkpoint(folder: Path, config: dict | None, weights: bytes | None = None) -> Path:
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}


@pytest.mark.parametrize("lengths", ["4097", "16,4097"])
def test_lengths_past_the_context_are_refused_before_anything_is_built(lengths: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--lengths", lengths, "--out", str(tmp_path)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert "--lengths: 4097 tokens is more than 'tiny-dense' holds (its context is 4096 tokens" in line
    assert "give lengths up to 4096" in line and captured.out == ""


def test_analyze_length_past_the_context_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--device", "cpu", "--chunked-prefill-size", "8192", "--length", "5000"])
    assert exc.value.code == 2 and "--length: 5000 tokens is more than" in capsys.readouterr().err


def test_a_run_that_measures_nothing_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def prefill(self, prompts):
        raise RuntimeError("every row fails")

    monkeypatch.setattr(Engine, "prefill", prefill)
    assert main(["bench", *FAST, "--lengths", "8,16", "--out", str(tmp_path)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("bcg bench: error: nothing was measured (eager: failed at input length 8: RuntimeError")
    assert not (tmp_path / "results.json").exists()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def prefill(self, prompts):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "prefill", prefill)
    assert main(["bench", *FAST, "--lengths", "8", "--out", str(tmp_path)]) == 130
    assert one_error_line(capsys.readouterr().err) == "bcg bench: interrupted"


def test_tensor_parallel_without_torchrun_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--tp", "2", "--lengths", "8", "--out", str(tmp_path)])
    assert exc.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--tp 2: tp_size=2 runs one process per rank" in line and "torchrun --nproc-per-node 2" in line


@pytest.mark.parametrize("argv, message", [
    (["--tolerance", "-1"], "--tolerance must be a finite number >= 0 (a relative difference), got -1.0"),
    (["--tolerance", "nan"], "--tolerance must be a finite number >= 0"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--backend", "eager"], "argument --backend: invalid choice: 'eager'"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be in [1, 16384], got 0"),
    (["--max-tokens", "0"], "max_tokens must be >= 1, got 0 (the flag of the same name)"),
    (["--model", "no-such-model"], "--model 'no-such-model' is neither a preset nor a checkpoint folder"),
    (["--model-impl", "transformers"], "--model 'tiny-dense' is a preset"),
])
def test_bad_verify_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--device", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in one_error_line(err) and "usage: bcg verify" in err


def test_verify_on_a_missing_gpu_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["verify", "--device", "cuda"])
    assert exc.value.code == 2
    assert "--device 'cuda' was asked for, but no CUDA device is visible" in one_error_line(capsys.readouterr().err)


def test_verify_takes_the_chunk_of_bench_and_analyze_and_the_flags_of_the_engine() -> None:
    cfg = VerifyConfig(device="cpu").resolved()
    assert cfg.chunked_prefill_size == 256 and cfg.model == "tiny-dense"  # as bench and analyze on the CPU
    config = VerifyConfig(device="cpu", model_impl="native", tc_compiler="traced", backend="tc_piecewise",
                          max_tokens=16).resolved().engine_config()
    assert (config.model_impl, config.tc_compiler, config.backend, config.max_tokens) == (
        "native", "traced", "tc_piecewise", 16)


def test_verify_an_engine_that_cannot_be_built_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _checkpoint(tmp_path / "ckpt", LLAMA, b"not a safetensors file")
    assert main(["verify", "--device", "cpu", "--model", str(folder), "--no-progress"]) == 1
    assert one_error_line(capsys.readouterr().err).startswith("bcg verify: error: the breakable engine of ")


def test_tc_piecewise_takes_the_traced_compiler_its_refusal_names(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", *FAST, "--backends", "eager,tc_piecewise", "--tc-compiler", "traced", "--lengths", "8",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in data["rows"]] == ["eager", "tc_piecewise"] and data["rows"][1]["graph_used"]
    assert data["config"]["tc_compiler"] == "traced" and "traced (pieces)" in out


def test_a_model_type_transformers_does_not_know_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    folder = _checkpoint(tmp_path / "ckpt", {"model_type": "foo_arch"})
    with pytest.raises(SystemExit) as exc:
        main(["bench", *FAST, "--model", str(folder), "--model-impl", "transformers", "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert (f"model_type 'foo_arch' is not one transformers {transformers.__version__} knows"
            in one_error_line(capsys.readouterr().err))


@pytest.mark.parametrize("command", ["bench", "analyze"])
@pytest.mark.parametrize("config, weights, message", [
    (None, None, "has no config.json, so it is not a Hugging Face checkpoint folder"),
    ({"model_type": "no-such-arch"}, None,
     "model_type 'no-such-arch' is neither one bcg implements natively nor one transformers"),
    (LLAMA, None, "has config.json but no *.safetensors weights"),
])
def test_bad_checkpoint_folder_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     command: str, config: dict | None, weights: bytes | None,
                                                     message: str) -> None:
    folder = _checkpoint(tmp_path / "ckpt", config, weights)
    with pytest.raises(SystemExit) as exc:
        main([command, *COMMON, "--model", str(folder), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and f"--model {str(folder)!r}" in errors[0]
    assert "Traceback" not in captured.err and captured.out == ""  # nothing ran


@pytest.mark.parametrize(("argv", "message"), [
    (["--model-impl", "native"], "unsupported model_type 'gpt2'; supported: llama, qwen3, qwen3_moe; "
                                 "model_impl='transformers' runs"),
    (["--model-impl", "transformers", "--model", "tiny-dense"],
     "--model 'tiny-dense' is a preset (one of bcg's own models); --model-impl transformers needs a checkpoint"),
])
def test_model_impl_is_checked_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                        message: str) -> None:
    folder = _checkpoint(tmp_path / "ckpt", {"model_type": "gpt2"}, b"weights")
    with pytest.raises(SystemExit) as exc:
        main(["bench", *COMMON, "--model", str(folder), *argv, "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_unloadable_checkpoint_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Passes the up-front checks, but its weights file is garbage: the eager baseline cannot be built.
    folder = _checkpoint(tmp_path / "ckpt", LLAMA, b"not a safetensors file")
    for command in ("bench", "analyze"):
        rc = main([command, *COMMON, "--model", str(folder), "--no-plots", "--out", str(tmp_path / command)])
        assert rc == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"bcg {command}: error: ") and "could not be built" in err[-1]
        assert "Traceback" not in "\n".join(err)
        assert not (tmp_path / command / "results.json").exists()


def test_unwritable_out_is_refused_before_anything_runs(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, reason in ((blocker, "it is a file, not a folder"), (blocker / "sub", "Not a directory")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", *COMMON, "--out", str(out)])
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert f"--out {str(out)!r} is not a writable folder ({reason})" in captured.err
        assert captured.out == ""  # no banner: nothing was built or measured


def test_a_variant_that_is_not_measured_is_logged_as_such(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Inductor's kernels cannot run under the CPU emulation: the engine would run uncompiled, the bench times nothing.
    rc = main(["bench", *FAST, "--backends", "breakable,breakable+inductor", "--lengths", "8", "--out", str(tmp_path)])
    assert rc == 0
    lines = [m for m in caplog.messages if m.startswith("bcg: ")]
    assert not any("running the uncompiled layer stack" in m for m in lines), lines
    assert lines[0].startswith("bcg: breakable+inductor is not measured: compile='inductor' failed: "), lines
