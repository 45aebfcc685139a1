"""Tensor parallel on the CPU tier: two (and four) rank processes over gloo, graphs under the emulation, logits equal
to one process and the same result on every rank, with the layer stack compiled, all-reduces as islands, verify on
every rank; TP=1 is the single-device path.

Failures on one rank, handled on all of them, have their own file (test_tensor_parallel_failures).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rank_pool import RankPool, module_pool
from tp_helpers import OPTIONS, PROMPTS, reference, summary

from bcg.ops.parallel import TensorParallelError
from bcg.runtime import Engine

pool = module_pool(2, timeout_s=90)  # a module-scoped fixture: two ranks kept across this module's tests


def _prefill_on_rank(preset: str, backends: list[str], extra: dict) -> dict:
    return {b: summary(eng, eng.prefill(PROMPTS)) for b in backends
            for eng in [Engine(preset, backend=b, tp_size=2, **OPTIONS, **extra)]}


@pytest.mark.parametrize(("preset", "backends", "extra"), [
    ("tiny-dense", ["eager", "breakable", "full"], {}),
    ("tiny-moe", ["breakable", "tc_piecewise"], {}),
    ("tiny-moe", ["breakable"], {"kernels": "fused"}),  # the fused kernels' paths (their references on a CPU)
    ("tiny-dsa", ["breakable"], {}),
])
def test_tp2_logits_equal_one_process_and_every_rank_returns_the_same(pool, preset, backends, extra):
    ref = reference(preset)
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
    return {"compile_error": eng.telemetry.compile_error, **summary(eng, eng.prefill(PROMPTS))}


def test_tp2_with_the_layer_stack_compiled(pool):
    ref = reference("tiny-moe")
    for res in pool.run(_compiled_on_rank):  # dynamo traces the all-reduces; the breakable capture keeps them
        assert res["compile_error"] is None and res["batches"] == [(16, True, "graph")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def _all_reduce_islands_on_rank() -> dict:
    import bcg.ops.parallel as parallel

    parallel._AS_ISLAND = True  # what BCG_TP_ALLREDUCE=island sets at import
    try:
        eng = Engine("tiny-dense", backend="breakable", tp_size=2, **OPTIONS)
        return summary(eng, eng.prefill(PROMPTS))
    finally:
        parallel._AS_ISLAND = False


def test_the_debug_switch_runs_all_reduces_as_islands(pool):
    ref = reference("tiny-dense")
    for res in pool.run(_all_reduce_islands_on_rank):
        segments, breaks, reason = res["buckets"][16]
        assert reason is None and breaks == 1 + 2 * 3  # the embedding's all-reduce; per layer attention and two
        assert res["batches"] == [(16, True, "graph")]
        assert np.abs(res["logits"] - ref.logits.numpy()).max() <= 1e-5


def _verified() -> dict:
    eng = Engine("tiny-dense", backend="breakable", tp_size=2, verify=True, **OPTIONS)
    return {n: (r.verify_diff, r.disabled_reason) for n, r in eng.telemetry.buckets.items()}


def test_verify_replays_every_bucket_on_every_rank(pool):
    zero, one = pool.run(_verified)
    assert zero == one and all(diff == 0.0 and reason is None for diff, reason in zero.values())


def _prefill_tp4(preset: str) -> dict:
    eng = Engine(preset, backend="breakable", tp_size=4, **OPTIONS)
    return {"kv_heads": eng.kv_pool.k[0].shape[1], **summary(eng, eng.prefill(PROMPTS))}


def test_tp4_replicates_kv_heads_and_matches_one_process():
    ref = {p: reference(p).logits.numpy() for p in ("tiny-dense", "tiny-moe")}
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
