"""The `bcg` entry point as a user meets it: help (every command's too) and a bad flag without torch, Ctrl-C at any
moment, a closed pipe, one rule for `--tc-compiler` in every command, and `--out ''` refused."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bcg.cli import COMMANDS, build_parser, main

# What the `bcg` console script does (`from bcg.cli import main; sys.exit(main())`), after saying it has started.
SCRIPT = "import sys; print('started', flush=True); from bcg.cli import main; sys.exit(main(sys.argv[1:]))"
CPU_BENCH = ["bench", "--device", "cpu", "--lengths", "8", "--runs", "1", "--warmup", "0", "--batch-requests", "1",
             "--no-progress", "--no-plots"]


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["nope"], []])
def test_help_version_and_a_mistyped_command_do_not_import_torch(argv: list[str]) -> None:
    code = ("import sys\nfrom bcg.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert proc.stderr.splitlines()[-1] == "no torch", proc.stderr
    if argv == ["--version"]:
        assert proc.stdout.startswith("bcg 0.") and "torch 2." in proc.stdout


def _main_in_a_fresh_process(argv: list[str], columns: int = 120) -> tuple[int, str, str]:
    """(exit status, stdout, stderr without its last line) of ``main(argv)`` in a new interpreter; the last line of
    stderr says whether torch was imported by then."""
    code = ("import sys\nfrom bcg.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nprint('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
            "sys.exit(code)")
    env = {**os.environ, "COLUMNS": str(columns)}  # argparse wraps its help at the terminal's width
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, env=env)
    *err, torch_line = proc.stderr.splitlines()
    assert torch_line == "no torch", proc.stderr
    return proc.returncode, proc.stdout, "\n".join(err)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_does_not_import_torch(command: str) -> None:
    code, out, err = _main_in_a_fresh_process([command, "--help"])
    assert code == 0 and out.startswith(f"usage: bcg {command} ") and "--tc-compiler" in out and not err, err


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--runs", "x"], "argument --runs: invalid int value: 'x'"),
    (["bench", "--lengths", "0"], "argument --lengths: 0 must be >= 1"),
    (["bench", "--backends", "bogus"], "argument --backends: unknown backend 'bogus'"),
    (["analyze", "--memory-budget", "2XB"], "argument --memory-budget: '2XB': unknown unit 'xb'"),
    (["verify", "--backend", "eager"], "argument --backend: invalid choice: 'eager'"),
    (["load", "--schedule-policy", "lifo"], "argument --schedule-policy: invalid choice: 'lifo'"),
])
def test_a_bad_flag_is_refused_before_torch_is_imported(argv: list[str], message: str) -> None:
    code, out, err = _main_in_a_fresh_process(argv)
    assert code == 2 and not out, (code, out)
    assert err.splitlines()[-1].startswith(f"bcg {argv[0]}: error: {message}"), err


def test_bench_help_shows_the_defaults_each_machine_resolves_to() -> None:
    # Read in a fresh process, without torch, the defaults must be those the config resolves to on each machine.
    from bcg.bench.config import BenchConfig
    from bcg.models.config import PRESETS

    code, out, _ = _main_in_a_fresh_process(["bench", "--help"], columns=1000)  # one line per flag
    assert code == 0
    cpu = BenchConfig(device="cpu").resolved()
    helps: dict[str, str] = {}  # each flag and its help (on the next line when the flag's name is long)
    for line in out.splitlines():
        if line.startswith("  --"):
            flag = line.split()[0].rstrip(",")
            helps[flag] = line
        elif line.startswith("     ") and helps:
            helps[flag] += " " + line.strip()
    assert "(default: eager,breakable,breakable+fused,breakable+fused+full,breakable+inductor,full,tc_piecewise " \
        f"on CUDA, {','.join(cpu.backends)} on the CPU)" in helps["--backends"]
    assert "(default: 64,128,256,512,1024,2048 on CUDA, " \
        f"{','.join(map(str, cpu.lengths))} on the CPU)" in helps["--lengths"]
    assert f"default: llama-dense on CUDA, {cpu.model} on the CPU" in helps["--model"]
    assert f"a preset ({', '.join(PRESETS)})" in helps["--model"]
    assert f"(default: 2048 on CUDA, {cpu.chunked_prefill_size} on the CPU, for every command alike)" \
        in helps["--chunked-prefill-size"]
    assert f"(default: inductor on CUDA, {cpu.tc_compiler} on the CPU)" in helps["--tc-compiler"]
    assert "(default: bfloat16 on CUDA, float32 on the CPU)" in helps["--dtype"]
    assert helps["--runs"].endswith(f"(default: {cpu.runs})") and helps["--warmup"].endswith(f"(default: {cpu.warmup})")
    assert "{auto,native,transformers}" in helps["--model-impl"]


@pytest.mark.parametrize("delay_s", [0.3, 1.5])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(delay_s: float, tmp_path: Path) -> None:
    # 0.3 s after start is inside `import torch` (seconds on any machine); 1.5 s is in the imports or the run.
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *CPU_BENCH, "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "bcg bench: interrupted\n", (proc.returncode, err)


def test_ctrl_c_before_the_flags_are_read_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(commands):  # the parser's imports are where the first seconds go
        raise KeyboardInterrupt

    monkeypatch.setattr("bcg.cli.build_parser", interrupted)
    assert main(["load", "--help"]) == 130
    assert capsys.readouterr().err == "bcg load: interrupted\n"


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    # `bcg bench | head -1`: the reader leaves after the first line, the tables have nowhere to go.
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *CPU_BENCH, "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    assert proc.stdout.readline().startswith("bcg bench: tiny-dense on the CPU")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_every_command_has_the_same_tc_compiler_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.bench.config import AnalyzeConfig, BenchConfig, VerifyConfig
    from bcg.bench.load_config import LoadConfig

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    helps = set()
    for name in COMMANDS:
        flag = next(a for a in subs[name]._actions if a.dest == "tc_compiler")
        assert flag.default is None, name  # the config resolves it, for this machine
        helps.add(flag.help)
    assert helps == {next(iter(helps))} and "(default: inductor on CUDA, traced on the CPU)" in helps.pop()
    for cls in (BenchConfig, AnalyzeConfig, VerifyConfig, LoadConfig):
        assert cls(device="cpu").resolved().tc_compiler == "traced", cls.__name__
        assert cls(device="cpu", tc_compiler="inductor").resolved().tc_compiler == "inductor", cls.__name__
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a GPU machine, as far as the defaults can tell
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    for cls in (BenchConfig, VerifyConfig, LoadConfig):
        assert cls(device="cuda").resolved().tc_compiler == "inductor", cls.__name__


@pytest.mark.parametrize("command", ["bench", "analyze", "load"])
def test_an_empty_out_is_refused(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--device", "cpu", "--out", ""])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"bcg {command}: error: argument --out: is empty; give a folder for the results, e.g. " \
        "out/run1 (or . for this one)"
