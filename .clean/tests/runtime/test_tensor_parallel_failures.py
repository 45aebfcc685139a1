"""Tensor parallel 2 on the CPU tier, failures on one rank handled on all of them: a capture or replay failing on one
rank, ranks capturing different graphs, choosing different buckets or given different prompts, and a rank that hangs
or dies."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from engine_cache import random_prompts
from rank_pool import RankPool, module_pool
from tp_helpers import OPTIONS, PROMPTS, current_rank, reference, summary

import bcg
from bcg.ops.attention import BatchContext
from bcg.ops.parallel import TensorParallelError
from bcg.runtime import Engine

pool = module_pool(2, timeout_s=90)  # a module-scoped fixture: two ranks kept across this module's tests


def _capture_fails_on_rank_one(bucket: int, uncapturable: bool) -> dict:
    real = BatchContext.attend

    def attend(self, q, k, v, out, layer_id):
        if current_rank() == 1 and bcg.is_capturing() and self.num_padded_tokens == bucket and layer_id == 0:
            raise (bcg.emulation.UncapturableOpError if uncapturable else RuntimeError)("injected on rank 1")
        return real(self, q, k, v, out, layer_id)

    BatchContext.attend = attend
    try:
        # Ratio-only padding: with the disabled bucket 8, a 7-token batch has no healthy bucket within 2x.
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, max_padding_tokens=0, **OPTIONS)
    finally:
        BatchContext.attend = real
    return summary(eng, eng.prefill([PROMPTS[1]]))  # 7 tokens: bucket 8


def test_a_capture_failure_on_one_rank_disables_that_bucket_on_every_rank(pool):
    ref = reference("tiny-dense", [PROMPTS[1]])
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
        if current_rank() == 1 and len(calls) == 1:  # the first island of the first replay
            raise RuntimeError("injected replay failure on rank 1")
        return real(self, q, k, v, out, layer_id)

    BatchContext.attend = attend
    try:
        first = summary(eng, eng.prefill(PROMPTS))
    finally:
        BatchContext.attend = real
    return {"first": first, "second": summary(eng, eng.prefill(PROMPTS))}


def test_a_replay_failure_on_one_rank_reruns_the_batch_eagerly_on_every_rank(pool):
    ref = reference("tiny-moe")
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
        if current_rank() == 1 and bcg.is_capturing() and x.shape[0] == 16:
            bcg.break_graph()  # one more break than rank 0 captures
        return real(self, x)

    SwiGLUMLP.forward = forward
    try:
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
    finally:
        SwiGLUMLP.forward = real
    return summary(eng, eng.prefill(PROMPTS))


def test_ranks_that_capture_different_graphs_drop_the_bucket(pool):
    ref = reference("tiny-dense")
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
    if current_rank() == 1:
        eng.runner.table.disable(16, "only on rank 1")  # the table alone, bypassing every agreement
    return summary(eng, eng.prefill(PROMPTS))


def test_a_bucket_chosen_on_one_rank_only_runs_eagerly_everywhere(pool):
    ref = reference("tiny-dense")
    zero, one = pool.run(_disagreeing_tables)
    assert zero["batches"] == one["batches"] == [(None, False, "ranks_disagree")]
    assert np.abs(zero["logits"] - ref.logits.numpy()).max() <= 1e-5
    assert np.array_equal(zero["logits"], one["logits"])


def _different_prompts_per_rank(same_lengths: bool) -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
    lengths = [3, 7, 2] if same_lengths or current_rank() == 0 else [5, 9]
    errors = []
    for _ in range(2):  # refused on both ranks, and the group is still usable for the next call
        try:
            eng.prefill(random_prompts(lengths, seed=current_rank()))
        except TensorParallelError as e:
            errors.append(str(e))
    return {"errors": errors, "after": summary(eng, eng.prefill(PROMPTS))}


@pytest.mark.parametrize("same_lengths", [True, False], ids=["same-lengths", "different-lengths"])
def test_ranks_given_different_prompts_refuse_them_naming_the_mismatch(pool, same_lengths):
    ref = reference("tiny-dense")
    for res in pool.run(_different_prompts_per_rank, same_lengths):
        assert len(res["errors"]) == 2 and all("different prompts" in e and "rank 1" in e for e in res["errors"])
        assert np.abs(res["after"]["logits"] - ref.logits.numpy()).max() <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# a rank that hangs or dies: bounded by the timeout, with a clear error (each breaks its group: a pool of its own)


def _peer_gone(how: str) -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, tp_timeout_s=3, **OPTIONS)
    if current_rank() == 1:
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
