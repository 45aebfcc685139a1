"""Tensor parallel over NCCL: all-reduces captured inside CUDA graph segments replay correctly (one GPU: a group of
one rank; two GPUs: two ranks), and the engine's logits at TP=2 match one GPU. The two-GPU tests are skipped
without two GPUs (the multi-GPU run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_cache import random_prompts
from rank_pool import RankPool

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

OPTIONS = dict(device="cuda", dtype="float32", buckets=[8, 16, 32], chunked_prefill_size=32, kv_tokens=512,
               max_requests=4, progress=False, seed=0)
PROMPTS = random_prompts([5, 11, 3], seed=2)


def _captured_all_reduce_on_rank() -> dict:
    import os

    import torch.distributed as dist

    import bcg
    from bcg.ops.parallel import TensorParallel, init_tensor_parallel

    world = int(os.environ["WORLD_SIZE"])
    if world == 1:  # init_tensor_parallel leaves one rank alone: make the group by hand
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        tp = TensorParallel(1, 0, dist.group.WORLD, dist.new_group(backend="gloo"))
    else:
        tp = init_tensor_parallel(world, torch.device("cuda"))
    x = torch.zeros(1024, device="cuda")
    out = {}
    stream = torch.cuda.Stream()
    for kind in ("cuda_graph", "breakable"):
        torch.cuda.synchronize()
        y = x + 1
        dist.all_reduce(y)  # warm the communicator outside any capture
        if kind == "cuda_graph":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                y = x * 2 + 1
                dist.all_reduce(y)
                z = y * 3
        else:
            g = bcg.BreakableCUDAGraph()

            @bcg.eager_on_graph
            def island(t: torch.Tensor) -> torch.Tensor:
                return t + 1

            with bcg.breakable_graph(g, barrier_fn=lambda: dist.barrier(group=tp.host_group)):
                y = x * 2 + 1
                dist.all_reduce(y)
                z = island(y) * 3
                dist.all_reduce(z)
        values = []
        for step in range(3):
            x.fill_(float(step + tp.rank))
            g.replay()
            torch.cuda.synchronize()
            values.append(z[:2].tolist())
        out[kind] = values
    return out


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=two_gpus)])
def test_all_reduces_captured_in_graph_segments_replay_as_collectives(world):
    pool = RankPool(world, timeout_s=180, start_method="spawn")
    try:
        results = pool.run(_captured_all_reduce_on_rank)
    finally:
        pool.close()
    for res in results:
        for step in range(3):  # x = step + rank on each rank
            total = sum(2 * (step + rank) + 1 for rank in range(world))
            assert res["cuda_graph"][step] == [3.0 * total] * 2
            assert res["breakable"][step] == [world * 3.0 * (total + 1)] * 2


def _engine_on_rank(preset: str, backend: str) -> dict:
    from bcg.runtime import Engine

    eng = Engine(preset, backend=backend, tp_size=2, **OPTIONS)
    res = eng.prefill(PROMPTS)
    return {"logits": res.logits.cpu().numpy(), "graph": [b.graph_used for b in res.batches]}


@two_gpus
@pytest.mark.parametrize(("preset", "backend"), [("tiny-dense", "breakable"), ("tiny-moe", "breakable"),
                                                 ("tiny-dense", "full"), ("tiny-dsa", "breakable")])
def test_tp2_engine_matches_one_gpu(preset, backend):
    pool = RankPool(2, timeout_s=300, start_method="spawn")
    try:
        zero, one = pool.run(_engine_on_rank, preset, backend)
    finally:
        pool.close()
    from bcg.runtime import Engine

    ref = Engine(preset, backend="eager", **OPTIONS).prefill(PROMPTS).logits.cpu().numpy()
    for res in (zero, one):
        assert res["graph"] == [True]
        assert np.abs(res["logits"] - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
    assert np.array_equal(zero["logits"], one["logits"])
