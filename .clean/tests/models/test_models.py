"""Model zoo: presets, deterministic init, batching/chunking/padding invariance, the MoE core, DSA grouping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import bcg
from bcg.models import PRESETS, build_model, get_preset
from bcg.models import dsa as dsa_module
from bcg.models.moe import MoEFFN
from bcg.ops.attention import SdpaAttention
from bcg.ops.context import ForwardContext, forward_context
from bcg.ops.kv_cache import KVPool
from bcg.ops.staging import MetadataArena, Staged
from bcg.runtime.batch import PrefillBatch, PrefillItem

TOL = 1e-5
CONFIGS = {
    "tiny-dense": get_preset("tiny-dense"),
    "tiny-moe": get_preset("tiny-moe"),
    "tiny-dsa": get_preset("tiny-dsa"),
    # Exercises the optional attention features and tied embeddings.
    "dense-qknorm-bias-tied": replace(
        get_preset("tiny-dense"), qk_norm=True, attention_bias=True, tie_word_embeddings=True
    ),
}


def _model(name: str, seed: int = 0):
    model = build_model(CONFIGS[name], "cpu", torch.float32, seed=seed)
    if CONFIGS[name].attention_bias:
        # Zero-init biases would not test that they are wired in.
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return model


def _pool(model, num_slots: int = 256) -> KVPool:
    return KVPool.for_model(model.config, num_slots, "cpu", torch.float32)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_get_preset_unknown_lists_known():
    with pytest.raises(ValueError, match="tiny-dense"):
        get_preset("nope")


def test_presets_shapes():
    assert {"tiny-dense", "tiny-moe", "tiny-dsa", "llama-dense", "gptoss-moe", "glm-dsa"} <= set(PRESETS)
    assert get_preset("tiny-dsa").num_index_groups >= 2
    llama = get_preset("llama-dense")
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads) == (28, 1024, 16, 4)
    wide = get_preset("llama-dense-2k")
    assert (wide.num_layers, wide.hidden_size, wide.head_dim, wide.arch) == (24, 2048, 128, "dense")
    glm = get_preset("glm-dsa")
    assert glm.arch == "dsa" and glm.is_moe and (glm.index_n_heads, glm.index_head_dim, glm.index_topk) == (4, 64, 256)
    with pytest.raises(ValueError, match="num_kv_heads"):
        replace(llama, num_kv_heads=3)


def test_build_model_is_deterministic():
    a, b, c = _model("tiny-moe", seed=3), _model("tiny-moe", seed=3), _model("tiny-moe", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    tied = _model("dense-qknorm-bias-tied")
    assert tied.lm_head.weight is tied.embed_tokens.weight


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_batch_matches_each_request_alone(name, prefill):
    model = _model(name)
    prompts = [_tokens(n, seed) for seed, n in enumerate([11, 3, 17])]
    packed = prefill(model, _pool(model), [(None, p) for p in prompts]).logits
    for r, prompt in enumerate(prompts):
        alone = prefill(model, _pool(model), [(None, prompt)]).logits[0]
        assert (packed[r] - alone).abs().max() <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_prefill_matches_one_shot(name, prefill):
    model = _model(name)
    prompt, other = _tokens(19, 7), _tokens(6, 8)
    one_shot = prefill(model, _pool(model), [(None, prompt)]).logits[0]
    pool = _pool(model)
    first = prefill(model, pool, [(None, prompt[:7])])
    # Second chunk continues from the cache, packed with an unrelated fresh request.
    second = prefill(model, pool, [(None, other), (first.slots[0], prompt[7:])])
    assert (second.logits[1] - one_shot).abs().max() <= TOL
    other_alone = prefill(model, _pool(model), [(None, other)]).logits[0]
    assert (second.logits[0] - other_alone).abs().max() <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_padding_rows_change_nothing_and_never_write_kv(name, prefill):
    model = _model(name)
    chunks = [(None, _tokens(9, 1)), (None, _tokens(4, 2))]
    exact = prefill(model, _pool(model), chunks)
    pool = _pool(model, num_slots=64)
    prefix = prefill(model, pool, [(None, _tokens(5, 3))])
    padded = prefill(model, pool, [*chunks, (prefix.slots[0], _tokens(3, 4))], num_padded_tokens=32)
    n = exact.batch.num_tokens
    assert (padded.hidden[:n] - exact.hidden).abs().max() <= TOL
    assert (padded.logits[:2] - exact.logits).abs().max() <= TOL
    owned = torch.cat([prefix.slots[0], *padded.slots])
    unowned = torch.ones(pool.num_slots + 1, dtype=torch.bool)
    unowned[owned] = False
    unowned[pool.scratch_slot] = False  # padded rows write the scratch slot, which no request reads
    for cache in [*pool.k, *pool.v, *pool.index_k]:
        assert cache[owned].abs().sum() > 0
        assert not cache[unowned].any()


def _naive_moe(ffn: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x @ ffn.gate.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights, experts = probs[t].topk(ffn.top_k)
        if ffn.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            gate, up = (ffn.experts_gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (ffn.experts_down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_moe_matches_naive_per_token_loop(norm_topk_prob, use_grouped_mm):
    config = replace(get_preset("tiny-moe"), norm_topk_prob=norm_topk_prob)
    ffn = build_model(config, "cpu", torch.float32, seed=5).layers[0].mlp
    if use_grouped_mm and not ffn.use_grouped_mm:
        pytest.skip("grouped_mm unavailable here")
    ffn.use_grouped_mm = use_grouped_mm
    x = torch.randn(13, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ffn(x) - _naive_moe(ffn, x)).abs().max() <= TOL


def test_dsa_indexer_runs_once_per_group(monkeypatch, prefill):
    model = _model("tiny-dsa")
    calls = []
    real = dsa_module.select_topk
    monkeypatch.setattr(dsa_module, "select_topk", lambda *a: calls.append(a[3]) or real(*a))
    prefill(model, _pool(model), [(None, _tokens(10, 0))])
    assert calls == list(range(model.config.num_index_groups))


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_layers_captures_once_and_replays_other_batches(name, prefill):
    """Captured under the CPU emulation (which rejects host reads and data-dependent shapes), the
    layer stack replays correctly for a batch with a different request mix, a prefix and padding."""
    model, num_padded = _model(name), 24
    pool = _pool(model)
    static_hidden = torch.zeros(num_padded, model.config.hidden_size)
    static_positions = torch.zeros(num_padded, dtype=torch.int64)
    # Every batch of the graph is loaded into the fields it was captured against (the captured K/V write reads them).
    attn = SdpaAttention(pool)
    layout = MetadataArena(torch.device("cpu"), 4096).layout(*attn.fields(num_padded))

    def load(batch: PrefillBatch) -> ForwardContext:
        staged = Staged(layout, attn.tail_lengths(batch), torch.device("cpu"))
        attn.stage(batch, num_padded, staged)
        return attn.context(batch, num_padded, staged.upload())

    dummy_slots = pool.alloc(num_padded)
    dummy = PrefillBatch([PrefillItem([0] * num_padded, dummy_slots)], pool)
    graph = bcg.BreakableCUDAGraph(emulate=True)
    with torch.no_grad(), forward_context(load(dummy)), bcg.breakable_graph(graph):
        static_out = model.forward_layers(static_hidden, static_positions)
    pool.free(dummy_slots)
    # One break per attention layer; DSA breaks once per indexer group (its sparse attention is captured).
    config = model.config
    assert graph.num_breaks >= (config.num_index_groups if config.arch == "dsa" else config.num_layers)

    prompt, other = _tokens(14, 1), _tokens(5, 2)
    reference_pool = _pool(model)
    first = prefill(model, reference_pool, [(None, prompt[:6])])
    expected = prefill(model, reference_pool, [(first.slots[0], prompt[6:]), (None, other)]).hidden

    first = prefill(model, pool, [(None, prompt[:6])])
    items = [PrefillItem(prompt[6:], pool.alloc(8), 6, first.slots[0]), PrefillItem(other, pool.alloc(5))]
    batch = PrefillBatch(items, pool)
    n = batch.num_tokens
    static_hidden.zero_()
    static_hidden[:n] = model.embed(batch.input_ids)
    static_positions.zero_()
    static_positions[:n] = batch.positions
    with torch.no_grad(), forward_context(load(batch)):
        graph.replay()
    assert (static_out[:n] - expected).abs().max() <= TOL
    with torch.no_grad(), forward_context(batch.to_context(num_padded)), pytest.raises(RuntimeError, match="Layout"):
        graph.replay()  # fresh fields: the captured K/V write would miss them, and the island says so
