"""A forward's ambient state (the running region's layer, the region runner) lives on its forward context: set for a
block, restored after, and gone with the forward."""

from __future__ import annotations

import pytest
import torch

from bcg.models.regions import is_regional, regional, run_layer
from bcg.ops.context import LayerIds, current_forward_context, forward_context
from bcg.ops.kv_cache import KVPool
from bcg.ops.region_islands import at_layer, current_layer
from bcg.runtime.batch import PrefillBatch, PrefillItem


def _context():
    pool = KVPool(num_slots=8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    batch = PrefillBatch([PrefillItem(torch.tensor([1, 2]), pool.alloc(2))], pool)
    return batch.to_context(num_padded_tokens=4)


def test_the_layer_and_the_region_runner_are_the_contexts_and_restored_after() -> None:
    ctx, seen = _context(), []
    with forward_context(ctx):
        assert not is_regional() and ctx.layer is None
        with regional(lambda layer, ids, args, kwargs: seen.append((ids, args)) or "ran"):
            assert is_regional() and ctx.region_runner is not None
            assert run_layer(torch.nn.Identity(), LayerIds(attention=2), "x") == "ran"
            with at_layer(LayerIds(attention=5)):
                assert current_layer() == LayerIds(attention=5) and ctx.layer == LayerIds(attention=5)
                with at_layer(LayerIds(attention=6)):
                    assert current_layer().attention == 6
                assert current_layer().attention == 5  # nested blocks restore the outer layer
        assert ctx.layer is None and ctx.region_runner is None and not is_regional()
        assert run_layer(torch.nn.Identity(), LayerIds(attention=2), "x") == "x"  # plain call again
    assert seen == [(LayerIds(attention=2), ("x",))] and current_forward_context() is None


def test_no_state_outlives_its_forward_or_reaches_another() -> None:
    first, second = _context(), _context()
    with forward_context(first), at_layer(LayerIds(attention=1)):
        with forward_context(second):  # a nested forward sees none of the outer one's region
            with pytest.raises(RuntimeError, match="outside a compiled layer region"):
                current_layer()
        assert current_layer().attention == 1
    with pytest.raises(RuntimeError, match="no ForwardContext"):
        with at_layer(LayerIds(attention=1)):  # a region needs a forward
            pass
