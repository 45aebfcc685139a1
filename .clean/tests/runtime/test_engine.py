"""Engine and runner behaviour under CPU graph emulation: equality with eager, fallbacks, bad input."""

from __future__ import annotations

import pytest
import torch
from engine_cache import EngineCache, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bcg.runtime import Engine
from bcg.runtime.batch import PrefillBatch, PrefillItem

PRESETS = ["tiny-dense", "tiny-moe", "tiny-dsa"]
BUCKETS = [4, 8, 16, 32, 48, 64]
engine = EngineCache(buckets=BUCKETS, chunked_prefill_size=64, kv_tokens=1024, device="cpu")
prompts = random_prompts


@pytest.mark.parametrize("preset", PRESETS)
def test_breakable_matches_eager_and_replays_graphs(preset: str) -> None:
    batch = prompts([3, 7, 12, 1])
    ref = engine(preset, "eager").prefill(batch)
    res = engine(preset, "breakable").prefill(batch)
    assert res.logits.shape == (4, 256)
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5
    assert torch.equal(res.next_tokens, ref.next_tokens)
    assert [b.graph_used for b in res.batches] == [True] and res.batches[0].bucket == 32


@pytest.mark.parametrize("preset", PRESETS)
def test_replay_is_identical_to_eager_at_the_padded_shape(preset: str) -> None:
    eng = engine(preset, "breakable")
    runner = eng.runner
    batch_prompts = prompts([5, 9])
    slots = eng.kv_pool.alloc(14)
    try:
        items = [PrefillItem(torch.tensor(batch_prompts[0]), slots[:5]),
                 PrefillItem(torch.tensor(batch_prompts[1]), slots[5:])]
        batch = PrefillBatch(items, eng.kv_pool)
        with torch.inference_mode():
            with runner.replay_context(batch) as (bucket, handle):
                handle.replay()
                graph_out = runner.static_output[:bucket].clone()
                runner.run_step_eagerly(bucket)  # the same fields, eagerly
                eager_out = runner.static_output[:bucket].clone()
    finally:
        eng.kv_pool.free(slots)
    assert bucket == 16
    assert torch.equal(graph_out[:14], eager_out[:14])


@pytest.mark.parametrize("preset", PRESETS)
def test_islands_are_the_only_breaks(preset: str) -> None:
    eng = engine(preset, "breakable")
    rec = eng.telemetry.buckets[16]
    config = eng.model.config
    # One island an attention layer; DSA has one an indexer group (its sparse attention is captured).
    islands = config.num_index_groups if config.arch == "dsa" else config.num_layers
    assert rec.disabled_reason is None and rec.num_breaks >= islands
    assert rec.num_segments == rec.num_breaks + 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=16), seed=st.integers(0, 2**16),
       chunk=st.sampled_from([16, 64]))
def test_random_compositions_match_eager(lengths: list[int], seed: int, chunk: int) -> None:
    batch = prompts(lengths, seed)
    ref = engine("tiny-dense", "eager", chunked_prefill_size=chunk).prefill(batch)
    res = engine("tiny-dense", "breakable", chunked_prefill_size=chunk).prefill(batch)
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_equals_one_shot(preset: str) -> None:
    prompt = prompts([50])
    one_shot = engine(preset, "eager").prefill(prompt)
    chunked = engine(preset, "breakable", chunked_prefill_size=16).prefill(prompt)
    assert len(chunked.batches) == 4 and all(b.graph_used for b in chunked.batches[:3])
    assert (chunked.logits - one_shot.logits).abs().max().item() <= 1e-5


def test_same_seed_same_weights_whatever_the_backend() -> None:
    a, b = engine("tiny-moe", "eager"), engine("tiny-moe", "breakable")
    for (name, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), name


def test_fallback_reasons_are_recorded() -> None:
    eng = engine("tiny-dense", "breakable", chunked_prefill_size=256, max_padding_tokens=0)  # the ratio alone
    res = eng.prefill(prompts([70, 17]))  # 87 tokens > largest bucket (64)
    assert [(b.graph_used, b.reason) for b in res.batches] == [(False, "exceeds_max_bucket")]
    res = eng.prefill(prompts([1]))  # bucket 4 would be 4x padding
    assert res.batches[0].reason == "padding_over_limit"
    assert eng.runner.choose(33) == (48, "graph")


def test_failed_capture_disables_only_that_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    from bcg.runtime.backends.breakable import BreakableBackend

    original = BreakableBackend.capture

    def flaky(self, n):
        if n == 16:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, n)

    monkeypatch.setattr(BreakableBackend, "capture", flaky)
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16, 32], progress=False,
                 max_padding_tokens=0)  # the ratio alone: 12 tokens may not move up to bucket 32
    assert set(eng.runner.handles) == {8, 32}
    assert "out of memory" in eng.telemetry.buckets[16].disabled_reason
    res = eng.prefill(prompts([12]))
    assert res.batches[0].reason == "bucket_disabled"
    ref = engine("tiny-dense", "eager").prefill(prompts([12]))
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5
    assert eng.prefill(prompts([20])).batches[0].graph_used


def test_failed_replay_falls_back_and_engine_stays_usable() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16], progress=False,
                 max_replay_failures=1)  # disable on the first failure (tests/runtime/runner/test_retry.py: more)
    handle = eng.runner.handles[16]
    calls = {"n": 0}
    real_replay = handle.replay

    def broken() -> None:
        calls["n"] += 1
        real_replay()  # writes some state, then fails half way like a real error would
        raise RuntimeError("simulated replay failure")

    handle.replay = broken
    ref = engine("tiny-dense", "eager").prefill(prompts([13]))
    res = eng.prefill(prompts([13]))
    assert calls["n"] == 1 and res.batches[0].reason == "replay_failed"
    assert (res.logits - ref.logits).abs().max().item() <= 1e-5
    assert "replay failed" in eng.telemetry.buckets[16].disabled_reason
    assert eng.prefill(prompts([13])).batches[0].reason == "bucket_disabled"
    assert eng.prefill(prompts([7])).batches[0].graph_used


@pytest.mark.parametrize("preset", PRESETS)
def test_debug_mode_runs_the_stack_as_one_break(preset: str) -> None:
    eng = engine(preset, "breakable", debug=True)
    rec = eng.telemetry.buckets[16]
    assert rec.num_breaks == 1
    ref = engine(preset, "eager").prefill(prompts([6, 5]))
    res = eng.prefill(prompts([6, 5]))
    assert res.batches[0].graph_used and (res.logits - ref.logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ([], ValueError, "at least one prompt"),
        ([[1, 2], []], ValueError, "prompt 1 is empty"),
        ([[1, 256]], ValueError, "token id 256 outside the vocabulary"),
        ([[-1]], ValueError, "token id -1"),
        ([torch.tensor([1.0, 2.0])], TypeError, "integer tensor"),
        ([torch.tensor([[1, 2]])], ValueError, "1-D"),
        ([[1, 2.5]], TypeError, "Python ints"),
        (torch.tensor([1, 2]), TypeError, "list of prompts"),
        ([list(range(200)) * 6], ValueError, "KV slots"),
    ],
)
def test_bad_input_is_rejected_and_leaves_the_pool_untouched(bad, error, match) -> None:
    eng = engine("tiny-dense", "breakable")
    free = eng.kv_pool.num_free
    k0 = eng.kv_pool.k[0].clone()
    with pytest.raises(error, match=match):
        eng.prefill(bad)
    assert eng.kv_pool.num_free == free and torch.equal(eng.kv_pool.k[0], k0)


def test_unknown_options_and_backends_fail_clearly() -> None:
    with pytest.raises(TypeError, match="unknown Engine option"):
        Engine("tiny-dense", device="cpu", bukets=[4])
    with pytest.raises(ValueError, match="unknown backend"):
        Engine("tiny-dense", device="cpu", backend="cudagraph")
    with pytest.raises(ValueError, match="tiny-dense"):
        Engine("no-such-model", device="cpu")


def test_a_one_token_prompt_replays_the_smallest_bucket() -> None:
    eng = engine("tiny-dense", "breakable")
    res = eng.prefill(prompts([1]))  # 4x padding, but 3 padded rows cost nothing next to eager's launches
    assert (res.batches[0].graph_used, res.batches[0].bucket, res.batches[0].reason) == (True, 4,
                                                                                         "graph_small_padding")
    assert (res.logits - engine("tiny-dense", "eager").prefill(prompts([1])).logits).abs().max().item() <= 1e-5


def test_disabled_is_an_alias_of_eager() -> None:
    eng = Engine("tiny-dense", backend="disabled", device="cpu", progress=False)
    assert eng.config.backend == "eager" and eng.prefill(prompts([4])).batches[0].reason == "backend_eager"


def test_padded_rows_write_only_the_scratch_slot() -> None:
    eng = engine("tiny-dense", "breakable")
    for k in eng.kv_pool.k:
        k.zero_()
    eng.prefill(prompts([5]))  # replays bucket 8: three padded rows
    # which slots the request got depends on the cached engine's history; how many were written does not
    written = eng.kv_pool.k[0].flatten(1).abs().sum(1) != 0
    assert written[eng.kv_pool.scratch_slot]  # the padded rows' K/V write, captured in the graph, lands there
    assert written.sum().item() == 5 + 1  # the request's five slots and the scratch slot, nothing else


def test_forward_context_is_not_leaked() -> None:
    from bcg.ops.context import get_forward_context

    engine("tiny-dense", "breakable").prefill(prompts([3]))
    with pytest.raises(RuntimeError, match="no ForwardContext"):
        get_forward_context()


def test_batch_telemetry_stays_bounded() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8], progress=False)
    eng.telemetry.max_batches = 3
    for _ in range(5):
        res = eng.prefill(prompts([6]))
        assert len(res.batches) == 1 and res.batches[0].graph_used
    assert len(eng.telemetry.batches) == 3 and eng.telemetry.num_batches == 5


def test_engine_serves_a_hugging_face_checkpoint_through_graphs(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=64, vocab_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    eng = Engine(str(tmp_path), backend="breakable", device="cpu", buckets=[16, 32], progress=False)
    batch = prompts([11, 6], seed=3)
    res = eng.prefill(batch)
    with torch.no_grad():
        expected = torch.stack([hf_model(torch.tensor([p])).logits[0, -1] for p in batch])
    assert res.batches[0].graph_used and (res.logits - expected).abs().max().item() <= 1e-4


def test_leak_check_reaches_every_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    import bcg

    seen, original = [], bcg.breakable_graph

    def spy(*args, **kw):
        seen.append(kw.get("leak_check"))
        return original(*args, **kw)

    monkeypatch.setattr(bcg, "breakable_graph", spy)
    Engine("tiny-dense", device="cpu", buckets=[8, 16], leak_check="warn", progress=False)
    assert seen and set(seen) == {"warn"}  # every bucket's capture, from the option, not the environment


def test_an_island_replays_only_the_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the emulation, with a stand-in for FlashAttention (one aten op, as the kernel is one launch): each
    island of a replay dispatches that op and nothing else; the K/V write ran in the segment before it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from bcg.ops.attention import ATTENTION_BACKENDS, AttentionBackend, VarlenAttention, island, varlen

    class StubVarlen(VarlenAttention):
        name = "stub-varlen"

        @classmethod
        def is_usable(cls, device, dtype):
            return None

        def __init__(self, kv_pool):
            AttentionBackend.__init__(self, kv_pool)  # no CUDA probes

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal, out=None):
        return out.copy_(q)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    real_attend = island._attend

    def counted(*args):
        with Count():
            real_attend(*args)
        per_island.append(list(ops))
        ops.clear()

    monkeypatch.setitem(ATTENTION_BACKENDS, StubVarlen.name, StubVarlen)
    monkeypatch.setattr(varlen, "flash_varlen", flash)
    eng = Engine("tiny-dense", device="cpu", attention_backend="stub-varlen", buckets=[8, 16], progress=False)
    ops, per_island = [], []
    monkeypatch.setattr(island, "_attend", counted)
    for cache in eng.kv_pool.k:
        cache.zero_()
    res = eng.prefill(prompts([9, 7]))  # fills bucket 16
    assert res.batches[0].bucket == 16 and res.batches[0].graph_used
    assert per_island == [["copy_"]] * eng.model.config.num_layers
    assert all((cache.flatten(1).abs().sum(1) != 0).sum() == 16 for cache in eng.kv_pool.k)  # written in segments
