"""The latency experiment: interleaved and one-at-a-time measurement, and a variant failing part-way."""

from __future__ import annotations

import pytest

from bcg.bench.config import BenchConfig
from bcg.bench.latency import run_latency
from bcg.runtime import Engine


def _cfg(**kw) -> BenchConfig:
    base = dict(model="tiny-dense", device="cpu", backends=["eager", "breakable"], lengths=[8, 16], runs=2,
                warmup=1, batch_requests=2, memory=False, plots=False, profile=False, progress=False, threads=1)
    return BenchConfig(**{**base, **kw}).resolved()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the backend of every prefill, in order."""
    log: list[str] = []
    original = Engine.prefill

    def prefill(self, *args, **kw):
        log.append(self.config.backend)
        return original(self, *args, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    return log


@pytest.mark.parametrize("interleave", [True, False])
def test_both_ways_measure_the_same_rows(interleave: bool, calls: list[str]) -> None:
    res = run_latency(_cfg(interleave=interleave))
    assert sorted((r.backend, r.input_len) for r in res.rows) == [("breakable", 8), ("breakable", 16),
                                                                     ("eager", 8), ("eager", 16)]
    assert {(r.backend, r.num_requests) for r in res.batch_rows} == {("eager", 2), ("breakable", 2)}
    assert all(r.wall.runs == 2 and r.greedy.equal_eager for r in res.rows + res.batch_rows)
    switches = sum(a != b for a, b in zip(calls, calls[1:]))
    if interleave:  # the variants take turns (an untimed and a timed call each) in every round of every shape
        assert switches >= (1 + 2) * 2 * 2  # (warmup + runs) rounds x 2 lengths x 2 shapes, a switch in each
    else:  # one engine measured through every length before the next is built
        assert switches == 1


@pytest.mark.parametrize("interleave", [True, False])
def test_a_variant_failing_part_way_keeps_the_others(interleave: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Engine.prefill

    def prefill(self, prompts, *args, **kw):
        if self.config.backend == "breakable" and sum(len(p) for p in prompts) == 16:
            raise RuntimeError("boom at 16")
        return original(self, prompts, *args, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    res = run_latency(_cfg(interleave=interleave))
    record = next(b for b in res.builds if b.backend == "breakable")
    assert record.error == "failed at input length 16: RuntimeError: boom at 16"
    assert sorted((r.backend, r.input_len) for r in res.rows) == [("breakable", 8), ("eager", 8), ("eager", 16)]


def test_nothing_measured_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.bench.config import BenchError

    def prefill(self, prompts, *args, **kw):
        raise RuntimeError("no row")

    monkeypatch.setattr(Engine, "prefill", prefill)
    with pytest.raises(BenchError, match="nothing was measured .eager: failed at input length 8: RuntimeError: no"):
        run_latency(_cfg())


def test_every_row_gets_its_own_variants_device_time_from_a_fresh_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.bench import latency

    cfg = _cfg(backends=["eager", "breakable", "breakable+fused"])
    res = run_latency(cfg)
    profiled: list[tuple[str, int]] = []

    def gpu_kernel_ms(fn, device, warmup=1):  # the profiler on a CPU: the variant and tokens of each profiled call
        before = len(calls)
        fn()
        profiled.append((calls[before][0], calls[before][1]))
        return 1.0 + len(profiled)

    calls: list[tuple[str, int]] = []
    original = Engine.prefill

    def prefill(self, prompts, *args, **kw):
        calls.append((self.config.backend + ("+fused" if self.config.kernels == "fused" else ""),
                      sum(len(p) for p in prompts)))
        return original(self, prompts, *args, **kw)

    monkeypatch.setattr(Engine, "prefill", prefill)
    monkeypatch.setattr(latency, "gpu_kernel_ms", gpu_kernel_ms)
    broken = next(r for r in res.rows if r.backend == "breakable" and r.input_len == 16)
    broken.graph_used = False  # as if its capture had failed in the fresh engine: its device time would lie
    device = latency._profile(cfg, cfg.engine_spec(), res)
    # eager first (the floors), eager on the fused kernels at eager's shapes (the fused floor), then the variants
    assert [v for v, _ in profiled] == ["eager"] * 4 + ["eager+fused"] * 4 + ["breakable"] * 3 + ["breakable+fused"] * 4
    assert ("breakable", 16, 1) not in device and device[("breakable", 8, 1)] > 0
    assert set(device) == {(v, n, k) for v in ("eager", "eager+fused", "breakable+fused") for n in (8, 16)
                           for k in (1, 2)} | {("breakable", 8, 1), ("breakable", 8, 2), ("breakable", 16, 2)}
