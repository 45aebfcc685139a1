"""The transformers path under real CUDA graphs in bf16 (tiny configs): replay equals eager bit for bit, logits within
bf16 tolerance of transformers' own forward, greedy tokens equal wherever transformers' top two are not a tie."""

from __future__ import annotations

import pytest
import torch
from hf_cases import ARCHS, MOE_ARCHS, make_model, prompts, reference_copy, reference_logits

from bcg.runtime import Engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
OPTS = dict(device="cuda", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)
REL_TOL = 3e-2  # bf16, relative to the largest logit


def _models(arch: str, experts: str | None = None):
    model = make_model(arch).to("cuda", torch.bfloat16)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model, reference_copy(model)


def _compare(res, want: torch.Tensor) -> None:
    """Logits within bf16 tolerance; the same greedy token wherever transformers' top-2 margin clears it (closer
    logits are a tie in bf16: either token is a legitimate pick)."""
    tol = REL_TOL * max(1.0, want.abs().max().item())
    assert (res.logits - want).abs().max().item() <= tol
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(res.next_tokens[clear], want.argmax(-1)[clear])


def _rounding_spread(ref, batch: list[torch.Tensor], seeds: int = 4) -> float:
    """How far transformers' own bf16 forward moves when its input is rounded once more: every element of the
    embeddings nudged by at most one bf16 step (2^-7 relative), over a few random draws. A routed MoE block is
    discontinuous (a token whose k-th and (k+1)-th expert scores are within rounding takes either), so this, not a
    share of the largest logit, is how far another rounding of the same function (bcg's fused kernels, another
    summation order) can legitimately land."""
    embed = ref.get_input_embeddings()
    base = reference_logits(ref, batch)
    worst = 0.0
    with torch.inference_mode():
        for seed in range(seeds):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            rows = []
            for p in batch:
                e = embed(p[None].to("cuda"))
                step = torch.randint(-1, 2, e.shape, generator=gen, device="cuda").to(e.dtype) * 2**-7
                rows.append(ref(inputs_embeds=e * (1 + step), use_cache=False).logits[0, -1].float())
            worst = max(worst, (torch.stack(rows) - base).abs().max().item())
    return worst


def _compare_moe(arch: str, res, ref, experts: str | None = None) -> None:
    """bcg's bf16 logits against the fp32 forward of the same weights, within twice the larger of transformers' own
    bf16 error and its rounding spread (:func:`_rounding_spread`); greedy tokens equal the fp32 ones wherever the fp32
    top-2 margin clears that bound."""
    truth_model = make_model(arch).to("cuda")
    if experts is not None:
        truth_model.set_experts_implementation(experts)
    truth = reference_logits(truth_model, prompts())
    own_error = (reference_logits(ref, prompts()) - truth).abs().max().item()
    spread = _rounding_spread(ref, prompts())
    bound = 2 * max(own_error, spread)
    error = (res.logits - truth).abs().max().item()
    assert own_error > 0.0 and error <= bound, (
        f"bcg's bf16 logits are {error:.4f} from fp32; transformers' own bf16 error {own_error:.4f}, its rounding "
        f"spread {spread:.4f}")
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
    assert torch.equal(res.next_tokens[clear], truth.argmax(-1)[clear])


def _graph_engine(model, **kw) -> Engine:
    # islands at every bucket unless asked (the engine's default on CUDA adds whole-step graphs: tested below)
    eng = Engine(model, backend="breakable", verify=True, **{**OPTS, "full_graph_tokens": 0, **kw})
    assert eng.telemetry.refused_reason is None
    assert all(r.verify_diff == 0.0 for r in eng.telemetry.buckets.values()), eng.telemetry.buckets
    return eng


@pytest.mark.parametrize("arch", ARCHS)
def test_breakable_cuda_graphs_match_transformers_in_bf16(arch):
    model, ref = _models(arch)
    eng = _graph_engine(model)
    assert eng.dtype == torch.bfloat16 and eng.device.type == "cuda" and eng.config.kernels == "fused"
    # bf16 rounding stays within the fusion's check: what fuses in fp32 on a CPU fuses here too
    assert not any("differs from the module as written" in n for n in eng.telemetry.notes), eng.telemetry.notes
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    if arch in MOE_ARCHS:
        _compare_moe(arch, res, ref)
    else:
        _compare(res, reference_logits(ref, prompts()))


@pytest.mark.parametrize(("arch", "is_refused"), [("llama", False), ("qwen3_moe", False), ("gpt_oss", True)])
def test_the_default_engine_replays_whole_step_graphs_of_transformers_models(arch, is_refused):
    """The engine's default on CUDA: small buckets also hold a whole-step graph of the transformers model (refused,
    with a note, where it has attention the static kernel lacks: gpt_oss's sinks and sliding windows)."""
    model, ref = _models(arch)
    eng = Engine(model, backend="breakable", verify=True, max_requests=4, **OPTS)  # 1 by default at a 32-token chunk
    assert eng.config.full_graph_tokens == max(eng.config.buckets)  # every bucket of a small chunk
    assert (eng.runner.full.table.refused_reason is not None) == is_refused
    res = eng.prefill(prompts())
    assert all(b.graph_used and (b.reason == "graph_full") != is_refused for b in res.batches), res.batches
    if arch in MOE_ARCHS:
        _compare_moe(arch, res, ref)
    else:
        _compare(res, reference_logits(ref, prompts()))


@pytest.mark.parametrize("experts", ["eager", "batched_mm"])
def test_experts_implementations_capture(experts, monkeypatch):
    """Eager experts (nonzero, .item()) run as automatic islands; batched_mm (repeat_interleave with int repeats)
    captures as it is, as the emulation now says. The experts run as written (fusion off): the fused MoE block would
    replace either implementation."""
    model, ref = _models("qwen3_moe", experts)
    monkeypatch.setenv("BCG_HF_FUSION", "off")
    eng = _graph_engine(model)
    monkeypatch.delenv("BCG_HF_FUSION")
    assert bool(eng.telemetry.auto_islands) == (experts == "eager")
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    _compare_moe("qwen3_moe", res, ref, experts)


def test_full_backend_on_cuda():
    model, ref = _models("qwen3")
    eng = Engine(model, backend="full", max_requests=4, verify=True, **OPTS)
    assert eng.telemetry.refused_reason is None and eng.telemetry.num_captured == 2
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    _compare(res, reference_logits(ref, prompts()))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_compiled_breakable_on_cuda(arch):
    model, ref = _models(arch)
    eng = Engine(model, backend="breakable", compile="inductor", **OPTS)
    assert eng.telemetry.refused_reason is None and eng.telemetry.compile_error is None
    assert eng.runner.step.layers.num_graphs <= 2  # one per layer structure, not one per layer
    res = eng.prefill(prompts())
    assert all(b.graph_used for b in res.batches)
    _compare(res, reference_logits(ref, prompts()))


def test_fused_and_as_written_agree_on_cuda(monkeypatch):
    """The fused path (Triton kernels, joined GEMMs) against the same weights run as written, both through bcg."""
    model, _ = _models("qwen3")
    monkeypatch.setenv("BCG_HF_FUSION", "off")
    plain = Engine(make_model("qwen3").to("cuda", torch.bfloat16), backend="eager", **OPTS)
    monkeypatch.delenv("BCG_HF_FUSION")
    fused = _graph_engine(model)
    assert not any(n.startswith("fused at load") for n in plain.telemetry.notes)
    assert fused.telemetry.notes[0].startswith("fused at load")
    _compare(fused.prefill(prompts()), plain.prefill(prompts()).logits)
