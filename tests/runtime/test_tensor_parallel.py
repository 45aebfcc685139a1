"""Tensor parallel 2 on the CPU tier: two rank processes over gloo, graphs under the emulation, logits equal to one
process, the same result on every rank, and failures on one rank handled on all of them."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch
from engine_cache import random_prompts
from rank_pool import RankPool

import bcg
from bcg.ops.attention import BatchContext
from bcg.ops.parallel import TensorParallelError
from bcg.runtime import Engine

BUCKETS = [4, 8, 16]
OPTIONS = dict(device="cpu", buckets=BUCKETS, chunked_prefill_size=16, kv_tokens=256, max_requests=4,
               tc_compiler="traced", progress=False, seed=0)
PROMPTS = random_prompts([3, 7, 2], seed=1)  # 12 tokens: bucket 16


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, timeout_s=90)
    yield ranks
    ranks.close()


def _rank() -> int:
    return int(os.environ["RANK"])


def _summary(eng: Engine, res: Any) -> dict:
    return {"logits": res.logits.numpy(), "tokens": res.next_tokens.tolist(),
            "batches": [(b.bucket, b.graph_used, b.reason) for b in res.batches],
            "buckets": {n: (r.num_segments, r.num_breaks, r.disabled_reason) for n, r in eng.telemetry.buckets.items()}}


def _reference(preset: str, prompts: list[list[int]] = PROMPTS) -> Any:
    return Engine(preset, backend="eager", **OPTIONS).prefill(prompts)


def _prefill_on_rank(preset: str, backends: list[str], extra: dict) -> dict:
    return {b: _summary(eng, eng.prefill(PROMPTS)) for b in backends
            for eng in [Engine(preset, backend=b, tp_size=2, **OPTIONS, **extra)]}


@pytest.mark.parametrize(("preset", "backends", "extra"), [
    ("tiny-dense", ["eager", "breakable", "full"], {}),
    ("tiny-moe", ["breakable", "tc_piecewise"], {}),
    ("tiny-moe", ["breakable"], {"kernels": "fused"}),  # the fused kernels' paths (their references on a CPU)
    ("tiny-dsa", ["breakable"], {}),
])
def test_tp2_logits_equal_one_process_and_every_rank_returns_the_same(pool, preset, backends, extra):
    ref = _reference(preset)
    one_process = {b: Engine(preset, backend=b, **OPTIONS, **extra).telemetry.buckets[16]
                   for b in backends if b != "eager"}
    ranks = pool.run(_prefill_on_rank, preset, backends, extra)
    for backend in backends:
        zero, one = ranks[0][backend], ranks[1][backend]
        assert np.abs(zero["logits"] - ref.logits.numpy()).max() <= 1e-5, backend
        assert zero["tokens"] == ref.next_tokens.tolist()
        assert np.array_equal(zero["logits"], one["logits"])  # the same PrefillResult on every rank
        assert zero["batches"] == one["batches"] and zero["buckets"] == one["buckets"]
        if backend != "eager":
            assert zero["batches"] == [(16, True, "graph")], (backend, zero["batches"])
            # All-reduces sit inside the segments: the graphs have the segments and breaks of one process.
            record = one_process[backend]
            assert zero["buckets"][16] == (record.num_segments, record.num_breaks, None)


def _compiled_on_rank() -> dict:
    eng = Engine("tiny-moe", backend="breakable", tp_size=2, compile="traced", **OPTIONS)
    return {"compile_error": eng.telemetry.compile_error, **_summary(eng, eng.prefill(PROMPTS))}


def test_tp2_with_the_layer_stack_compiled(pool):
    ref = _reference("tiny-moe")
    for res in pool.run(_compiled_on_rank):  # dynamo traces the all-reduces; the breakable capture keeps them
        assert res["compile_error"] is None and res["batches"] == [(16, True, "graph")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def _all_reduce_islands_on_rank() -> dict:
    import bcg.ops.parallel as parallel

    parallel._AS_ISLAND = True  # what BCG_TP_ALLREDUCE=island sets at import
    try:
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
        return _summary(eng, eng.prefill(PROMPTS))
    finally:
        parallel._AS_ISLAND = False


def test_the_debug_switch_runs_all_reduces_as_islands(pool):
    ref = _reference("tiny-dense")
    for res in pool.run(_all_reduce_islands_on_rank):
        segments, breaks, reason = res["buckets"][16]
        assert reason is None and breaks == 1 + 2 * 3  # the embedding's all-reduce; per layer attention and two
        assert res["batches"] == [(16, True, "graph")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def _capture_fails_on_rank_one(bucket: int, uncapturable: bool) -> dict:
    real = BatchContext.attend

    def attend(self, q, k, v, out, layer_id):
        if _rank() == 1 and bcg.is_capturing() and self.num_padded_tokens == bucket and layer_id == 0:
            raise (bcg.emulation.UncapturableOpError if uncapturable else RuntimeError)("injected on rank 1")
        return real(self, q, k, v, out, layer_id)

    BatchContext.attend = attend
    try:
        # Ratio-only padding: with the disabled bucket 8, a 7-token batch has no healthy bucket within 2x.
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, max_padding_tokens=0, **OPTIONS)
    finally:
        BatchContext.attend = real
    return _summary(eng, eng.prefill([PROMPTS[1]]))  # 7 tokens: bucket 8


def test_a_capture_failure_on_one_rank_disables_that_bucket_on_every_rank(pool):
    ref = _reference("tiny-dense", [PROMPTS[1]])
    zero, one = pool.run(_capture_fails_on_rank_one, 8, False)
    assert "injected on rank 1" in one["buckets"][8][2]
    # Rank 0 was at its next island's barrier when rank 1 gave up: it aborted there instead of waiting.
    assert "another rank ended this capture early" in zero["buckets"][8][2]
    for res in (zero, one):
        assert res["buckets"][4][2] is None and res["buckets"][16][2] is None  # the other buckets are kept
        assert res["batches"] == [(None, False, "bucket_disabled")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def test_an_uncapturable_op_on_one_rank_refuses_the_backend_on_every_rank(pool):
    zero, one = pool.run(_capture_fails_on_rank_one, 16, True)  # the first bucket captured
    assert "injected on rank 1" in one["buckets"][4][2]
    assert "rank 1 cannot capture this model" in zero["buckets"][4][2]
    assert zero["batches"] == one["batches"] == [(None, False, "backend_refused")]


def _replay_fails_on_rank_one() -> dict:
    # One failure disables the bucket (the retry policy itself is tested on one process).
    eng = Engine("tiny-moe", backend="breakable", tp_size=2, max_replay_failures=1, **OPTIONS)
    real, calls = BatchContext.attend, []

    def attend(self, q, k, v, out, layer_id):
        calls.append(layer_id)
        if _rank() == 1 and len(calls) == 1:  # the first island of the first replay
            raise RuntimeError("injected replay failure on rank 1")
        return real(self, q, k, v, out, layer_id)

    BatchContext.attend = attend
    try:
        first = _summary(eng, eng.prefill(PROMPTS))
    finally:
        BatchContext.attend = real
    return {"first": first, "second": _summary(eng, eng.prefill(PROMPTS))}


def test_a_replay_failure_on_one_rank_reruns_the_batch_eagerly_on_every_rank(pool):
    ref = _reference("tiny-moe")
    zero, one = pool.run(_replay_fails_on_rank_one)
    assert "injected replay failure" in one["first"]["buckets"][16][2]
    assert "failed on rank 1" in zero["first"]["buckets"][16][2]
    for res in (zero, one):
        # Rank 1 drained its replay (the all-reduces of the segments after the failed island ran), so rank 0 was
        # not left waiting in one; both reran the batch eagerly and dropped the bucket.
        assert res["first"]["batches"] == [(None, False, "replay_failed")]
        assert res["second"]["batches"] == [(None, False, "bucket_disabled")]
        for run in ("first", "second"):
            assert np.abs(res[run]["logits"] - ref.logits.numpy()).max() <= 1e-5


def _graphs_differ_on_rank_one() -> dict:
    from bcg.models.layers import SwiGLUMLP

    real = SwiGLUMLP.forward

    def forward(self, x):
        if _rank() == 1 and bcg.is_capturing() and x.shape[0] == 16:
            bcg.break_graph()  # one more break than rank 0 captures
        return real(self, x)

    SwiGLUMLP.forward = forward
    try:
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
    finally:
        SwiGLUMLP.forward = real
    return _summary(eng, eng.prefill(PROMPTS))


def test_ranks_that_capture_different_graphs_drop_the_bucket(pool):
    ref = _reference("tiny-dense")
    zero, one = pool.run(_graphs_differ_on_rank_one)
    # Rank 1 reached one barrier more: rank 0's end of capture met it there, and both dropped the bucket.
    assert "another rank ended this capture early" in one["buckets"][16][2]
    assert "failed on rank 1" in zero["buckets"][16][2]
    for res in (zero, one):
        assert res["buckets"][4][2] is None and res["buckets"][8][2] is None
        assert res["batches"] == [(None, False, "bucket_disabled")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def _disagreeing_tables() -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
    if _rank() == 1:
        eng.runner.table.disable(16, "only on rank 1")  # the table alone, bypassing every agreement
    return _summary(eng, eng.prefill(PROMPTS))


def test_a_bucket_chosen_on_one_rank_only_runs_eagerly_everywhere(pool):
    ref = _reference("tiny-dense")
    zero, one = pool.run(_disagreeing_tables)
    assert zero["batches"] == one["batches"] == [(None, False, "ranks_disagree")]
    assert np.abs(zero["logits"] - ref.logits.numpy()).max() <= 1e-5
    assert np.array_equal(zero["logits"], one["logits"])


def _different_prompts_per_rank(same_lengths: bool) -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
    lengths = [3, 7, 2] if same_lengths or _rank() == 0 else [5, 9]
    errors = []
    for _ in range(2):  # refused on both ranks, and the group is still usable for the next call
        try:
            eng.prefill(random_prompts(lengths, seed=_rank()))
        except TensorParallelError as e:
            errors.append(str(e))
    return {"errors": errors, "after": _summary(eng, eng.prefill(PROMPTS))}


@pytest.mark.parametrize("same_lengths", [True, False], ids=["same-lengths", "different-lengths"])
def test_ranks_given_different_prompts_refuse_them_naming_the_mismatch(pool, same_lengths):
    ref = _reference("tiny-dense")
    for res in pool.run(_different_prompts_per_rank, same_lengths):
        assert len(res["errors"]) == 2 and all("different prompts" in e and "rank 1" in e for e in res["errors"])
        assert np.abs(res["after"]["logits"] - ref.logits.numpy()).max() <= 1e-5


def _verified() -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, verify=True, **OPTIONS)
    return {n: (r.verify_diff, r.disabled_reason) for n, r in eng.telemetry.buckets.items()}


def test_verify_replays_every_bucket_on_every_rank(pool):
    zero, one = pool.run(_verified)
    assert zero == one and all(diff == 0.0 and reason is None for diff, reason in zero.values())


def _prefill_tp4(preset: str) -> dict:
    eng = Engine(preset, backend="breakable", tp_size=4, **OPTIONS)
    return {"kv_heads": eng.kv_pool.k[0].shape[1], **_summary(eng, eng.prefill(PROMPTS))}


def test_tp4_replicates_kv_heads_and_matches_one_process():
    ref = {p: _reference(p).logits.numpy() for p in ("tiny-dense", "tiny-moe")}
    ranks = RankPool(4, timeout_s=90)
    try:
        results = {p: ranks.run(_prefill_tp4, p) for p in ref}
    finally:
        ranks.close()
    for preset, per_rank in results.items():
        for res in per_rank:
            assert res["kv_heads"] == 1  # 2 KV heads over 4 ranks: each held by 2 ranks
            assert res["batches"] == [(16, True, "graph")]
            assert np.abs(res["logits"] - ref[preset]).max() <= 1e-5
            assert np.array_equal(res["logits"], per_rank[0]["logits"])


# ---------------------------------------------------------------------------------------------------------------
# a rank that hangs or dies: bounded by the timeout, with a clear error (each breaks its group: a pool of its own)


def _peer_gone(how: str) -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, tp_timeout_s=3, **OPTIONS)
    if _rank() == 1:
        if how == "dies":
            os._exit(3)
        return {}  # alive, but never joins rank 0's prefill: a hang from rank 0's side
    t0 = time.monotonic()
    try:
        eng.prefill(PROMPTS)
    except TensorParallelError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("how", ["hangs", "dies"])
def test_a_rank_that_hangs_or_dies_fails_the_others_within_the_timeout(how):
    ranks = RankPool(2, timeout_s=60)
    try:
        zero = ranks.run(_peer_gone, how, allow_exit={1})[0]
    finally:
        ranks.close()
    assert zero["error"] is not None and zero["seconds"] < 30
    assert "rank 0/2" in zero["error"] and "relaunch" in zero["error"]


def test_tp_without_a_process_group_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(TensorParallelError, match=r"torchrun --nproc-per-node 2"):
        Engine("tiny-dense", tp_size=2, device="cpu", progress=False)


def test_tp1_is_the_single_device_path():
    from bcg.models.parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    eng = Engine("tiny-moe", backend="breakable", **OPTIONS)
    assert eng.tp.size == 1 and eng.runner.agreement is None and eng.runner.resources.barrier_fn is None
    assert not torch.distributed.is_initialized()  # no process group was needed
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    assert not any(isinstance(m, parallel) for m in eng.model.modules())
    assert eng.model.kv_shape is eng.model.config
    assert eng.runner.backend.replay.__func__ is type(eng.runner.backend).replay  # the plain replay, not drained
