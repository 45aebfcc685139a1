"""Bridge buffers: island tensors of every layer and bucket share one set of max-size buffers."""

from __future__ import annotations

import torch

from bcg.graph import EagerStep
from bcg.ops.bridge import BridgeBuffers, bridge_buffers, carry, output_like
from bcg.runtime import Engine


def test_outside_a_bridge_tensors_pass_through() -> None:
    q = torch.randn(4, 2, 8)
    assert carry("attn", q)[0] is q
    assert output_like("attn", q).shape == q.shape


def test_carry_copies_into_shared_views() -> None:
    bridge = BridgeBuffers(max_tokens=16)
    a, b = torch.randn(4, 2, 8), torch.randn(8, 2, 8)
    with bridge_buffers(bridge):
        (va,) = carry("attn", a)
        (vb,) = carry("attn", b)
        out = output_like("attn", a)
    assert torch.equal(vb, b) and va.data_ptr() == vb.data_ptr() == bridge.view("attn.0", a).data_ptr()
    assert out.data_ptr() != va.data_ptr() and bridge.nbytes == 2 * 16 * 2 * 8 * 4


def test_carry_casts_in_the_copy_or_on_its_own() -> None:
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    (plain,) = carry("attn", x, dtype=torch.float32)  # outside a bridge: a cast
    bridge = BridgeBuffers(max_tokens=16)
    with bridge_buffers(bridge):
        (bridged,) = carry("attn", x, dtype=torch.float32)
    assert plain.dtype == bridged.dtype == torch.float32 and torch.equal(plain, bridged)
    assert bridged.data_ptr() == bridge.view("attn.0", x, torch.float32).data_ptr()
    assert bridge.nbytes == 16 * 2 * 8 * 4  # one float32 buffer, none for the float64 input


def _island_ptrs(graph) -> set[int]:
    return {t.untyped_storage().data_ptr() for s in graph.steps if isinstance(s, EagerStep)
            for t in s.args if isinstance(t, torch.Tensor)}


def test_every_bucket_and_layer_shares_the_same_island_buffers() -> None:
    eng = Engine("tiny-dense", backend="breakable", device="cpu", buckets=[8, 16, 32], progress=False)
    ptrs = [_island_ptrs(eng.runner.handles[n]) for n in (8, 16, 32)]
    # q and k side by side in one buffer, v, out, and the write slots of the metadata arena
    assert ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[0]) == 4
    ref = Engine("tiny-dense", backend="eager", device="cpu", progress=False)
    prompts = [[1, 2, 3, 4, 5, 6], [7] * 13, [9] * 30, [3, 4, 5]]
    for p in prompts + prompts[::-1]:  # interleave buckets 8, 16, 32
        assert (eng.prefill([p]).logits - ref.prefill([p]).logits).abs().max() <= 1e-5
