"""What Engine.submit refuses at once, in the caller's thread and before anything starts: a prompt larger than the
pool (the engine serving on as before), token ids the engine cannot read (named as given), a prompt that is not
token ids; and the options EngineConfig refuses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_cache import random_prompts
from gate_helpers import SMALL
from submit_helpers import engine, reference, same, whole

from bcg.runtime import Engine, EngineConfig


def test_submit_refuses_a_prompt_larger_than_the_pool_at_once() -> None:
    eng = Engine("tiny-dense", backend="eager", **SMALL)
    with pytest.raises(ValueError, match="needs 65 KV slots but the pool holds 64; raise kv_tokens"):
        eng.submit(list(range(65)))
    assert eng._server is None  # refused in the caller's thread: nothing started


@pytest.mark.parametrize("prompt, match", [
    ([np.uint64(2**64 - 1)], "token id 18446744073709551615 outside the vocabulary"),
    (np.array([3, 2**64 - 1], dtype=np.uint64), "token id 18446744073709551615 outside the vocabulary"),
    (torch.zeros(3, dtype=torch.long, device="meta"), "meta-device tensor, which holds no token ids"),
])
def test_prompts_the_engine_cannot_read_are_named_as_given(prompt: Any, match: str) -> None:
    eng = Engine("tiny-dense", backend="eager", **SMALL)
    for call in (lambda: eng.submit(prompt), lambda: eng.prefill([prompt])):
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "on cpu" not in str(e.value)


def test_a_prompt_larger_than_the_pool_is_refused_at_submit() -> None:
    eng = engine("tiny-dense", "breakable", kv_tokens=128)
    ok, big = random_prompts([20], seed=1)[0], random_prompts([300], seed=2)[0]
    with pytest.raises(ValueError, match="needs 300 KV slots but the pool holds 128; raise kv_tokens"):
        eng.submit(big)
    assert same(eng.submit(ok).result(timeout=60), reference([ok])[0])
    assert eng.submit(ok).result(timeout=60).cached_tokens  # the engine serves on as before
    assert whole(eng)


def test_submit_refuses_bad_prompts_at_once_and_the_config_refuses_bad_options() -> None:
    eng = engine("tiny-dense", "breakable")
    with pytest.raises(TypeError, match="tokenize it first"):
        eng.submit("hello")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, 999])
    with pytest.raises(ValueError, match="needs tp_size=1"):
        EngineConfig(prefix_cache=True, tp_size=2)
    assert not EngineConfig(tp_size=2).uses_prefix_cache and EngineConfig().uses_prefix_cache
    with pytest.raises(TypeError, match="prefix_cache must be True or False"):
        EngineConfig(prefix_cache="yes")
    with pytest.raises(ValueError, match="schedule_policy must be one of fifo, shortest"):
        EngineConfig(schedule_policy="lifo")
    with pytest.raises(ValueError, match="max_inflight_batches must be >= 1"):
        EngineConfig(max_inflight_batches=0)
