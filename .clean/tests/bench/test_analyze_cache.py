"""The machine's costs on disk (bcg.bench.machine_cache): a second `bcg analyze` takes them from the cache instead of
measuring, a changed key (another measuring method, other cores) measures again, `--machine-cache refresh` measures
and overwrites, `off` neither reads nor writes, and an entry that cannot be used is measured again with a note. CPU
emulation: only where the numbers come from is checked, not what they are."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bcg.bench import machine_cache
from bcg.bench.machine_cache import MachineCache, cache_dir
from bcg.cli import main

FAST = ["--device", "cpu", "--runs", "2", "--warmup", "0", "--no-progress", "--no-plots", "--chunked-prefill-size",
        "32", "--predict-lengths", "8,16", "--length", "16", "--lengths", "5,30", "--backends", "breakable,full"]


def _analyze(out: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[dict, str]:
    assert main(["analyze", *FAST, *flags, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    return json.loads(text.strip().splitlines()[-1])["timings"]["machine_cache"], text


def _targets(results: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from analyze_targets import main as targets
    finally:
        sys.path.pop(0)
    assert targets([str(results)]) == 0
    (check,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    assert check["validated"] is False and check["errors_ok"] is None
    return check


def test_the_second_run_takes_the_machines_costs_from_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path / "cache"))
    first, text = _analyze(tmp_path / "a", capsys)
    assert first["dir"] == str(tmp_path / "cache") and first["mode"] == "use"
    assert set(first["sources"]) == {"machine", "device"} and "disk" not in first["sources"].values()
    assert "measured and kept in" in text
    files = sorted((tmp_path / "cache").glob("*.json"))
    assert [f.name.split("-")[0] for f in files] == ["device", "machine"]
    second, text = _analyze(tmp_path / "b", capsys)
    assert second["sources"] == {"machine": "disk", "device": "disk"}
    assert set(second["files"].values()) == {str(f) for f in files}
    assert "came from the cache in" in text and "--machine-cache refresh" in text
    a, b = (json.loads((tmp_path / d / "results.json").read_text())["machine"]["None"] for d in "ab")
    assert {k: v for k, v in a.items() if k not in ("seconds", "cached")} == \
        {k: v for k, v in b.items() if k not in ("seconds", "cached")}
    assert b["cached"] is True
    # the time target is judged on the second run alone: predicting with the machine's costs from the cache
    times = [_targets(tmp_path / d / "results.json", capsys)["predict_time_ok"] for d in "ab"]
    assert times[0] is None and isinstance(times[1], bool)

    # another measuring method is another key: the entries of the old one are not read
    monkeypatch.setattr(machine_cache, "METHOD", machine_cache.METHOD + 1)
    third, _ = _analyze(tmp_path / "c", capsys)
    assert "disk" not in third["sources"].values()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 4  # two more entries, the old ones left as they were


def test_refresh_measures_again_and_off_leaves_no_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path / "cache"))
    _analyze(tmp_path / "a", capsys)
    entry = next((tmp_path / "cache").glob("machine-*.json"))
    saved = json.loads(entry.read_text())
    refreshed, _ = _analyze(tmp_path / "b", capsys, "--machine-cache", "refresh")
    assert refreshed["sources"] == {"machine": "measured", "device": "measured"}  # this process's copy not reused
    again = json.loads(entry.read_text())
    assert again["key"] == saved["key"] and again["value"]["eager_launch_us"] != saved["value"]["eager_launch_us"]

    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path / "untouched"))
    off, _ = _analyze(tmp_path / "c", capsys, "--machine-cache", "off")
    assert "disk" not in off["sources"].values() and off["files"] == {}
    assert not (tmp_path / "untouched").exists()


def test_an_entry_that_cannot_be_used_is_measured_again_with_a_note(tmp_path: Path) -> None:
    cache = MachineCache("use", tmp_path)
    costs = cache.machine_costs("cpu", (), False)
    entry = Path(cache.files["machine"])
    assert cache.sources["machine"] in ("measured", "process") and entry.exists()
    again = MachineCache("use", tmp_path)
    assert again.machine_costs("cpu", (), False).eager_launch_us == costs.eager_launch_us
    assert again.sources["machine"] == "disk" and again.notes == []

    entry.write_text("{not json")
    broken = MachineCache("use", tmp_path)
    broken.machine_costs("cpu", (), False)
    assert broken.sources["machine"] != "disk"
    assert len(broken.notes) == 1 and str(entry) in broken.notes[0] and "measured again" in broken.notes[0]
    assert json.loads(entry.read_text())["key"]["guards"] is False  # written whole again


def test_the_device_entry_keeps_every_device_time_the_mixed_chains_included(tmp_path: Path) -> None:
    from bcg.bench.machine import DEVICE_FIELDS

    first = MachineCache("use", tmp_path)
    measured = first.device_costs(first.machine_costs("cpu", (), False))
    again = MachineCache("use", tmp_path)
    loaded = again.device_costs(again.machine_costs("cpu", (), False))
    assert again.sources["device"] == "disk" and loaded.chain_kernels and loaded.chain_kernel_us > 0
    assert {f: getattr(loaded, f) for f in DEVICE_FIELDS} == {f: getattr(measured, f) for f in DEVICE_FIELDS}
    assert loaded.graph_chain_us == measured.graph_chain_us  # the host-phase half, in the machine entry


def test_the_key_holds_the_machine_the_software_and_the_measured_shapes(tmp_path: Path) -> None:
    cache = MachineCache("use", tmp_path)
    cache.machine_costs("cpu", (), False)
    key = json.loads(Path(cache.files["machine"]).read_text())["key"]
    for field in ("device_name", "torch", "triton", "python", "cores", "threads", "method", "shape"):
        assert field in key, field
    assert key["shape"]["kernels"] > 0 and key["compilers"] == [] and "bcg" not in key  # commit-independent
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "bcg"
    assert cache_dir({"BCG_CACHE_DIR": "/x", "XDG_CACHE_HOME": "/y"}) == Path("/x")
    with pytest.raises(ValueError, match="--machine-cache must be one of use, refresh, off"):
        MachineCache("sometimes", tmp_path)
