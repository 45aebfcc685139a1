"""The varlen backend through a whole engine on the CPU, as the GPU runs it: FlashAttention's reference in bf16 in
every island of breakable graphs (emulated), over several buckets, against eager SDPA. Batches with and without
cached prefixes (chunked prompts, prefix-cache hits, exact repeats), padded rows (their K/V in the scratch slot,
which holds NaN here), batches that fill their bucket, and one-token batches (the serving soak's crash)."""

from __future__ import annotations

import pytest
import torch
from engine_cache import check_prefix_hits, poison_scratch, same_answer

from bcg.runtime import Engine

BUCKETS = [1, 4, 16, 32]
COMMON = dict(device="cpu", dtype="bfloat16", progress=False, seed=0, buckets=BUCKETS, chunked_prefill_size=32)
TOL = 5e-2  # bf16 logits of a 2-layer model: the same reduction order differs between SDPA and the reference


@pytest.fixture(scope="module")
def engines():
    eng = Engine("tiny-dense", attention_backend="varlen", prefix_cache=True, **COMMON)
    ref = Engine("tiny-dense", backend="eager", attention_backend="sdpa", prefix_cache=False, **COMMON)
    yield eng, ref
    eng.close()
    ref.close()




def test_the_engine_runs_the_varlen_islands(engines):
    eng, _ = engines
    assert eng.telemetry.attention_backend == "varlen" and eng.telemetry.notes == []
    assert sorted(eng.telemetry.buckets) == BUCKETS and all(r.disabled_reason is None
                                                            for r in eng.telemetry.buckets.values())


@pytest.mark.parametrize(("name", "lengths"), [
    ("one-token", [1]),  # bucket 1, filled: an empty padded sequence with the longest query 1 (GQA)
    ("one-token-each", [1, 1, 1]),  # bucket 4, padded
    ("fills-bucket", [9, 7]),  # bucket 16, no padded rows
    ("padded", [5, 3, 2]),  # bucket 16, 6 padded rows
    ("chunked", [75, 3]),  # 3 chunks: later chunks attend over the cached earlier ones (prefix path)
])
def test_prefill_matches_eager_sdpa(engines, name, lengths):
    eng, ref = engines
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(0, eng.model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    poison_scratch(eng)
    got, want = eng.prefill(prompts), ref.prefill(prompts)
    same_answer(got, want, TOL)
    assert all(b.graph_used for b in got.batches), [b.reason for b in got.batches]
    if name == "chunked":
        assert len(got.batches) == 3  # every chunk a replay, the later two with a prefix


def test_prefix_cache_hits_and_repeats_match_eager_sdpa(engines):
    """Served requests: a shared system prompt cut at different tokens (hits end anywhere), and an exact repeat
    (all of it cached: its last token runs again as a one-token request after a prefix)."""
    check_prefix_hits(*engines, TOL)
