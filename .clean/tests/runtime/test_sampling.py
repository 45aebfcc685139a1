"""Greedy first tokens in two stages: the same answer as argmax, ties, infinities and NaN included."""

from __future__ import annotations

import pytest
import torch

from bcg.runtime.sampling import greedy_tokens


@pytest.mark.parametrize("vocab", [256, 32000, 32768, 128256, 151936, 50257])
def test_two_stages_give_argmax_on_random_logits(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_ties_take_the_first_maximum_across_and_within_chunks() -> None:
    vocab = 128256  # 256 chunks of 501
    logits = torch.zeros(4, vocab)
    logits[0, [700, 600, 90000]] = 3.0           # equal maxima in two chunks: the first index
    logits[1, [1001, 1002]] = 3.0                 # in one chunk
    logits[2, [500, 501]] = 3.0                   # either side of a chunk boundary
    logits[3] = -float("inf")                     # every logit the same
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist() == [600, 1001, 500, 0]


def test_nan_counts_as_the_maximum_as_argmax_does() -> None:
    logits = torch.randn(2, 32768, generator=torch.Generator().manual_seed(1))
    logits[0, [7000, 20000]] = float("nan")
    logits[1, 12345] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits).tolist() == [7000, 12345]


def test_small_vocabularies_and_strided_rows_take_one_stage() -> None:
    logits = torch.randn(3, 8192 * 2, generator=torch.Generator().manual_seed(2))
    view = logits[:, ::2]  # not contiguous: the one-stage argmax
    assert torch.equal(greedy_tokens(view), view.argmax(dim=-1))
    tiny = torch.randn(2, 100)
    assert torch.equal(greedy_tokens(tiny), tiny.argmax(dim=-1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_stages_give_argmax_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4, 128256, generator=g, device="cuda")
    logits[1, [700, 600, 90000]] = 10.0
    logits[2, [40000, 40001]] = float("nan")
    logits[3] = logits[3].round()  # many ties at the maximum
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
