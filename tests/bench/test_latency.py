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
