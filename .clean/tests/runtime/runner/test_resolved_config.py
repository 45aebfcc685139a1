"""The engine says what it runs: ``engine.config`` is resolved once at construction (kernels, attention backend,
buckets, device, dtype), the runner and the model run exactly that, and the bench's and load's first lines print it."""

from __future__ import annotations

import pytest
import torch

import bcg.ops.attention as attention_module
import bcg.ops.kernels as kernels_module
from bcg.bench import load_report, text
from bcg.bench.config import BenchConfig
from bcg.bench.load_config import LoadConfig
from bcg.runtime import Engine
from bcg.runtime.config import EngineConfig


def test_the_engine_config_holds_the_resolved_choices_the_engine_runs() -> None:
    eng = Engine("tiny-dense", device="cpu", progress=False, chunked_prefill_size=32, warmup=0)
    cfg = eng.config
    assert (cfg.kernels, cfg.attention_backend, cfg.device, cfg.dtype) == ("torch", "sdpa", "cpu", "float32")
    assert cfg.buckets == sorted(eng.runner.table.sizes) and cfg.max_tokens == max(cfg.buckets) == 32
    # One owner: what the config says is what runs (the model's kernels, the runner's attention and buckets).
    assert eng.model.layers[0].mlp.kernels == cfg.kernels
    assert eng.telemetry.attention_backend == cfg.attention_backend
    assert cfg.resolved() == cfg  # resolving again changes nothing
    assert cfg.describe() == ("backend breakable, kernels torch, attention sdpa, compile none, "
                              "buckets 4..32 (8 buckets), cpu float32")


def test_full_resolves_to_its_static_attention_and_explicit_choices_are_kept() -> None:
    eng = Engine("tiny-dense", backend="full", device="cpu", progress=False, buckets=[16, 8], kernels="fused",
                 warmup=0)
    assert (eng.config.attention_backend, eng.telemetry.attention_backend) == ("static", "static")
    assert (eng.config.kernels, eng.config.buckets, eng.config.max_tokens) == ("fused", [8, 16], 16)


def test_cuda_resolves_to_the_fused_kernels_where_triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the H200 tier asserts (eng.config.kernels == "fused"), reached on the CPU: only the device is CUDA.
    on_cuda = lambda device, *_: torch.device(device).type == "cuda"  # noqa: E731
    monkeypatch.setattr(kernels_module, "fused_available", on_cuda)
    monkeypatch.setattr(attention_module, "default_attention_backend", lambda *a: "varlen" if on_cuda(*a) else "sdpa")
    cfg = EngineConfig(device="cuda", chunked_prefill_size=16).resolved()
    assert (cfg.kernels, cfg.attention_backend, cfg.dtype, cfg.device) == ("fused", "varlen", "bfloat16", "cuda")
    assert EngineConfig(device="cuda", kernels="torch").resolved().kernels == "torch"
    monkeypatch.setattr(kernels_module, "fused_available", lambda device: False)
    assert EngineConfig(device="cuda").resolved().kernels == "torch"
    with pytest.raises(ValueError, match="kernels='fused' needs Triton"):
        EngineConfig(device="cuda", kernels="fused").resolved()


def test_the_bench_and_load_first_lines_name_what_each_engine_runs() -> None:
    env = {"device_name": "cpu", "model_impl": "native", "torch_threads": 1}
    cfg = BenchConfig(model="tiny-dense", device="cpu", backends=["eager", "breakable+fused", "full"],
                      lengths=[16, 64]).resolved()
    first = text.header("bench", cfg, env).splitlines()
    assert len(first) == 1
    for variant in cfg.backends:  # each variant's clause is its engine config's own description
        assert f"{variant}: {cfg.engine_spec().config_for(variant).describe()}" in first[0]
    assert "breakable+fused: backend breakable, kernels fused, attention sdpa, compile none, buckets 4..64" in first[0]
    assert "full: backend full, kernels torch, attention static" in first[0]
    load = LoadConfig(model="tiny-dense", device="cpu", backends=["breakable"]).resolved()
    line = load_report.load_header(load, env, {"lengths": "16-64"})
    assert len(line.splitlines()) == 1
    assert f"breakable: {load.engine_spec().config_for('breakable').describe()}" in line
