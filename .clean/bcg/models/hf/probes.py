"""The adapter's probe forwards: one short request over a pool of its own, and what every attention call receives.

Both run at construction, before anything is captured: :func:`probe_layers` records, per layer, what the attention
function is given (K/V shapes for the pool, window, soft-cap, sinks) without computing attention, and
:func:`one_request` is the forward context the other probes (capturability, fusion checks, the tail check) run in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from bcg.models.hf import UnsupportedModelError
from bcg.models.hf.attention import AttentionCall, recording_calls
from bcg.ops.attention import single_request_context
from bcg.ops.context import forward_context

__all__ = ["one_request", "probe_layers"]


@contextmanager
def one_request(model: Any, num_tokens: int) -> Iterator[tuple[Tensor, Tensor]]:
    """A forward context of one request of ``num_tokens`` over a small pool of its own (``model.make_kv_pool``),
    under inference mode; yields seeded random token ids and their positions."""
    device = model.device
    ctx = single_request_context(num_tokens, model.make_kv_pool(num_tokens, device, model.dtype), model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), forward_context(ctx):
        yield ids.to(device), torch.arange(num_tokens, device=device)


def probe_layers(model: Any, num_tokens: int) -> list[AttentionCall]:
    """One forward of ``model`` (an :class:`~bcg.models.hf.model.HFCausalLM`) that records every attention call,
    computing no attention; the calls sorted by layer.

    Raises:
        UnsupportedModelError: a layer's attention does not go through the attention function, or the layers' keys
            come in several dtypes.
    """
    device = model.device
    with torch.inference_mode(), recording_calls() as calls:
        ids = torch.arange(num_tokens, device=device) % model.config.vocab_size
        model.forward_layers(model.embed(ids), torch.arange(num_tokens, device=device))
    name = type(model.hf).__name__
    seen = sorted(c.layer_idx for c in calls)  # DSA module islands run the model's module, which calls it too
    if seen != list(range(model.config.num_layers)):
        raise UnsupportedModelError(
            f"{name}: the attention function ran for layers {seen}, expected one call for each of the "
            f"{model.config.num_layers} layers; some attention modules bypass transformers' AttentionInterface")
    dtypes = {c.dtype for c in calls}
    if len(dtypes) > 1:
        raise UnsupportedModelError(f"{name}: its layers' keys come in several dtypes {sorted(map(str, dtypes))}")
    return sorted(calls, key=lambda c: c.layer_idx)
