"""What Engine.submit refuses at once, in the caller's thread and before anything starts: a prompt larger than the
pool, token ids the engine cannot read (named as given)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gate_helpers import SMALL

from bcg.runtime import Engine


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
