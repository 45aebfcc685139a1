"""`bcg analyze --validate` measures each backend, never its eager fallback: a compiled variant timed under a torch
thread count other than the one it was compiled with fails dynamo's guard on every replay (tiny-dense, CPU
emulation), and such a timing is reported as a fallback, not as a latency; under ``--cpu-cores`` a compiled variant
is rebuilt pinned, so its guard holds and it replays."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from bcg.bench.config import AnalyzeConfig
from bcg.bench.engines import EngineSpec, engine_for
from bcg.bench.validate import measure_variants, prompt_for, time_prefills


def _spec() -> EngineSpec:
    cfg = AnalyzeConfig(model="tiny-dense", device="cpu", chunked_prefill_size=32, predict_lengths=[16], length=16,
                        backends=["tc_piecewise"], progress=False).resolved()
    assert cfg.tc_compiler == "traced"
    return cfg.engine_spec()


@pytest.fixture
def two_threads() -> object:
    """torch on two threads during the test (a count the pinned runs then differ from), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_a_timing_that_ran_the_eager_fallback_is_not_the_backends(two_threads: object,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)  # the disabled buckets' warnings are the point here
    with engine_for(_spec(), "tc_piecewise") as eng:
        assert eng is not None
        prompt = prompt_for(eng.model.config.vocab_size, 16, 0)
        timed, fell = time_prefills(eng, {16: prompt}, runs=2, warmup=0)
        assert 16 in timed and not fell  # compiled and replayed under the same thread count
        torch.set_num_threads(1)  # dynamo's guard on the thread count now fails at every replay
        timed, fell = time_prefills(eng, {16: prompt}, runs=2, warmup=0)
        assert 16 not in timed
        assert "ran eagerly instead of replaying" in fell[16] and "eager fallback" in fell[16]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 1, reason="no CPU affinity on this platform")
def test_cpu_cores_rebuild_a_compiled_variant_so_it_replays_pinned(two_threads: object) -> None:
    affinity = os.sched_getaffinity(0)
    got = measure_variants(_spec(), ["tc_piecewise"], [16], 16, runs=2, warmup=0, seed=0, cores=[None, 1])
    m = got["tc_piecewise"]
    assert m.available and m.fallbacks == {}
    assert set(m.ms) == {16} and set(m.by_cores) == {1} and set(m.by_cores[1]) == {16}
    assert m.by_cores[1][16] > 0
    assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == affinity  # the process as it was
