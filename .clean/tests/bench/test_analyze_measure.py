"""What `bcg analyze` measures of the eager forwards, on tiny-dense under the CPU emulation: kineto's records read
as torch's own events read them, one profiler session cut into its forwards, every size profiled in one session
(more profiles only where they disagree), and the host times stopping once their spread has settled. The numbers are
the emulation's: only where they come from and how many runs they took is checked."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, record_function

from bcg.bench import profile, profiled
from bcg.bench.engines import EngineSpec, engine_for, make_prompts, one_batch
from bcg.bench.kineto import Event, Span, forward_label, profile_events, split_forwards
from bcg.bench.quiet_profiler import quiet_profile
from bcg.bench.trace import kernels_from_events
from bcg.runtime.config import EngineConfig


@pytest.fixture(scope="module")
def eng() -> Iterator[object]:
    spec = EngineSpec("tiny-dense", EngineConfig(device="cpu", chunked_prefill_size=32, progress=False))
    with engine_for(spec, "eager") as e:
        yield e


def _prompts(sizes: tuple[int, ...]) -> dict[int, torch.Tensor]:
    return {n: make_prompts([n], 256, n)[0] for n in sizes}


def test_kinetos_records_read_as_the_function_events_and_cut_into_forwards(eng: object) -> None:
    batch, slots = one_batch(eng, _prompts((16,))[16])
    try:
        with torch.inference_mode(), quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
            for r in range(2):
                with record_function(forward_label(f"f#{r}")), profiled._annotated():
                    eng.runner.forward(batch)
    finally:
        eng.kv_pool.free(slots)
    raw = split_forwards(profile_events(prof))
    slow = split_forwards([Event(e.name, str(e.device_type).rsplit(".", 1)[-1],
                                 Span(e.time_range.start, e.time_range.end), e.id, e.linked_correlation_id, e.thread)
                           for e in prof.events()])
    # a torch whose profiler keeps no kineto results: its FunctionEvents are read instead
    fallback = split_forwards(profile_events(SimpleNamespace(profiler=None, events=prof.events)))
    assert set(raw) == set(slow) == set(fallback) == {"f#0", "f#1"}
    assert [e.name for e in fallback["f#0"]] == [e.name for e in slow["f#0"]]
    for tag in raw:
        a, b = kernels_from_events(raw[tag], cuda=False), kernels_from_events(slow[tag], cuda=False)
        assert [(k.name, k.op, k.island) for k in a.kernels] == [(k.name, k.op, k.island) for k in b.kernels]
        assert [k.device_us for k in a.kernels] == pytest.approx([k.device_us for k in b.kernels], abs=1e-3)
        assert [c.label for c in a.calls] == ["attention_island#0", "attention_island#1"]  # two layers, per forward


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The keyword arguments of every profiler session started while the test runs."""
    started: list[dict] = []

    def counted(**kwargs: object):
        started.append(kwargs)
        return quiet_profile(**kwargs)

    monkeypatch.setattr(profiled, "quiet_profile", counted)
    return started


def test_every_size_is_profiled_in_one_session(eng: object, sessions: list[dict],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiled, "PROFILE_AGREE", float("inf"))  # any two profiles agree: no second session
    prompts = _prompts((8, 16))
    hosts = {n: profile.host_times(eng, p, runs=2, warmup=0) for n, p in prompts.items()}
    ps = profiled.profile_sizes(eng, prompts, hosts, most=3)
    assert len(sessions) == 1 and sessions[0]["profile_memory"] is True
    for n, p in ps.items():
        assert p.size == n and p.host is hosts[n] and p.profiles == 2
        assert [c.name for c in p.trace.calls] == ["attention_island"] * 2 and p.full_error is None
        assert p.full_trace is not None and not p.full_trace.calls and p.full_islands == []
        assert p.activation_bytes and p.activation_bytes > 0
        for lo, mid, hi in zip(p.trace_low.kernels, p.trace.kernels, p.trace_high.kernels):
            assert lo.device_us <= mid.device_us <= hi.device_us
    assert ps[8].activation_bytes < ps[16].activation_bytes


def test_both_kernels_settings_are_profiled_in_one_session(eng: object, sessions: list[dict],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiled, "PROFILE_AGREE", float("inf"))
    prompts = _prompts((8,))
    spec = EngineSpec("tiny-dense", EngineConfig(device="cpu", chunked_prefill_size=32, progress=False))
    with engine_for(spec, "eager+fused") as fused:
        hosts = {s: {8: profile.host_times(e, prompts[8], runs=2, warmup=0)} for s, e in (("torch", eng),
                                                                                           ("fused", fused))}
        seconds: dict[str, float] = {}
        ps = profiled.profile_settings({"torch": (eng, prompts, hosts["torch"]),
                                        "fused": (fused, prompts, hosts["fused"])}, seconds=seconds, full={"torch"})
    assert len(sessions) == 1 and set(ps) == {"torch", "fused"}
    for s in ps:  # each setting's forwards are its own: its host times, its kernels
        assert ps[s][8].host is hosts[s][8] and ps[s][8].profiles == 2
    # the full step only where a full variant runs those kernels
    assert ps["torch"][8].full_trace is not None and ps["torch"][8].full_error is None
    assert ps["fused"][8].full_trace is None and ps["fused"][8].full_error == profiled.NOT_PROFILED
    assert [k.name for k in ps["torch"][8].trace.kernels] != [k.name for k in ps["fused"][8].trace.kernels]
    assert 0 < seconds["start"] + seconds["stop"] < seconds["run"] and seconds["read"] > 0


def test_profiles_that_disagree_are_profiled_again(eng: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiled, "PROFILE_AGREE", -1.0)  # no two profiles agree: every size once more
    prompts = _prompts((8,))
    hosts = {8: profile.host_times(eng, prompts[8], runs=2, warmup=0)}
    assert profiled.profile_sizes(eng, prompts, hosts, repeats=2, most=3)[8].profiles == 3


@pytest.mark.parametrize("within, warmups, runs", [(float("inf"), 2, profile.MIN_RUNS), (-1.0, 4, 12)])
def test_host_times_stop_once_their_spread_settled(eng: object, monkeypatch: pytest.MonkeyPatch, within: float,
                                                   warmups: int, runs: int) -> None:
    monkeypatch.setattr(profile, "SETTLED", within)
    host = profile.host_times(eng, _prompts((16,))[16], runs=12, warmup=4)
    # settled at once: two warm-ups (the first pair agrees) and the fewest runs; never: every run asked for
    assert (host.warmups, host.runs) == (warmups, runs)
    assert host.island_calls == {"attention_island": 2} and host.island_us["attention_island"] > 0
    assert host.low.prefill_ms <= host.prefill_ms <= host.high.prefill_ms and host.prefill_pre_us is not None
