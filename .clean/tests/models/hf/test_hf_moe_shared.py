"""Shared experts run as routed experts of weight 1 (bcg/models/hf/moe_shared.py): the split of their MLP into experts
of the routed width is exact in every layout, glm4_moe's fused block matches the module with one and with two shared
experts (routed_scaling_factor scaling the routed weights only), the weights are held once and given back by
restore, and shared experts of another width run as their own (fused) MLP, named in the notes."""

from __future__ import annotations

import pytest
import torch
from engine_cache import max_diff
from hf_cases import make_model, one_thread, prompts, reference_copy, reference_logits
from torch import nn

import bcg.models.hf.fused_moe as fused_moe
from bcg.models.hf.fused_layer import FusedMLP
from bcg.models.hf.fused_moe import ExpertsSpec, FusedMoE
from bcg.models.hf.model import HFCausalLM
from bcg.models.hf.moe_shared import StackedExperts, shared_problem
from bcg.runtime import Engine
from bcg.tensors import storage_key

SMALL = dict(device="cpu", buckets=[16, 32], chunked_prefill_size=32, kv_tokens=256, progress=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_thread()


class SharedMLP(nn.Module):
    """A gate/up MLP as transformers writes shared experts: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int, joined: bool = False) -> None:
        super().__init__()
        if joined:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


def _experts(num: int, hidden: int, width: int, activation: str, transposed: bool) -> ExpertsSpec:
    gate_up = torch.randn(num, 2 * width, hidden)
    down = torch.randn(num, hidden, width)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return ExpertsSpec(nn.Parameter(gate_up), nn.Parameter(down), None, None, transposed, activation)


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("activation", ["silu", "silu_interleaved"])
@pytest.mark.parametrize("num_shared", [1, 3])
def test_the_shared_mlp_is_the_sum_of_its_stacked_experts(num_shared, activation, transposed, joined):
    """Each stacked shared expert run as a routed one (the layout's GEMM, the activation, the down GEMM), summed
    over the shared experts, is the MLP; the routed experts are unchanged, and one shared expert is held once."""
    torch.manual_seed(0)
    hidden, width, num = 16, 8, 4
    experts = _experts(num, hidden, width, activation, transposed)
    routed_gate_up, routed_down = experts.gate_up.detach().clone(), experts.down.detach().clone()
    mlp = SharedMLP(hidden, num_shared * width, joined)
    x = torch.randn(5, hidden)
    mlp_weights = [p.detach().clone() for p in mlp.parameters()]
    with torch.inference_mode():
        want = mlp(x)
        assert shared_problem(mlp, experts) is None
        stack = StackedExperts(experts, mlp)
        assert stack.num_shared == num_shared and stack.gate_up.shape[0] == num + num_shared
        assert torch.equal(stack.gate_up[:num], routed_gate_up) and torch.equal(stack.down[:num], routed_down)
        assert storage_key(experts.gate_up) == storage_key(stack.gate_up)
        got = sum(experts.activate(x @ experts.matrix(stack.gate_up)[e], "torch") @ experts.matrix(stack.down)[e]
                  for e in range(num, num + num_shared))
        assert max_diff(got, want) <= 1e-5 * want.abs().max().item()
        assert all(torch.equal(p, w) for p, w in zip(mlp.parameters(), mlp_weights))  # values kept, maybe views
        # One shared expert is one strided block of the stack (but for interleaved rows in one gate_up weight).
        if num_shared == 1 and not (joined and activation == "silu_interleaved"):
            stacks = {storage_key(stack.gate_up), storage_key(stack.down)}
            assert all(storage_key(p) in stacks for p in mlp.parameters())
        stack.split()
        assert storage_key(experts.gate_up) != storage_key(stack.gate_up)
        assert all(torch.equal(p, w) and p.is_contiguous() for p, w in zip(mlp.parameters(), mlp_weights))
        assert torch.equal(experts.gate_up, routed_gate_up) and experts.gate_up.is_contiguous()


def test_shared_experts_that_are_no_routed_experts_are_refused_by_name():
    experts = _experts(4, 16, 8, "silu", False)
    assert shared_problem(SharedMLP(16, 12), experts) == ("their intermediate size 12 is not a multiple of the routed "
                                                          "experts' 8")
    biased = SharedMLP(16, 8)
    biased.up_proj.bias = nn.Parameter(torch.zeros(8))
    assert shared_problem(biased, experts) == "their projections have biases"
    gelu = SharedMLP(16, 8)
    gelu.act_fn = nn.GELU()
    assert shared_problem(gelu, experts) == "their activation is not SiLU"
    clamped = _experts(4, 16, 8, "clamped_swiglu", True)
    assert shared_problem(SharedMLP(16, 8), clamped) == ("the routed experts are not bias-free SiLU-and-multiply "
                                                         "experts")
    with pytest.raises(ValueError, match="cannot be stacked.*not a multiple"):
        StackedExperts(experts, SharedMLP(16, 12))


@pytest.mark.parametrize("n_shared", [1, 2])
def test_glm4_moe_blocks_run_their_shared_experts_as_routed_ones(n_shared):
    """The fused block alone against the module, with routed_scaling_factor 2.5 (were it to scale the shared
    columns too, the shared experts' part would be 2.5x), then the whole model in graphs against transformers."""
    hf = make_model("glm4_moe", n_shared_experts=n_shared, routed_scaling_factor=2.5)
    block = next(m for m in hf.modules() if fused_moe.is_moe_block(m))
    stand_in = FusedMoE(block, fused_moe.moe_specs(block, hf.config)[0])
    assert stand_in.spec.router.num_shared == n_shared and stand_in.spec.experts.gate_up.shape[0] == 8 + n_shared
    x = torch.randn(1, 37, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = block(x), stand_in(x)
        w, ids = stand_in.spec.router.route(x[0], "torch")
    assert max_diff(got, want) <= 1e-5 * want.abs().max().item()
    assert torch.equal(ids[:, 2:], torch.arange(8, 8 + n_shared).expand(37, n_shared))
    assert torch.equal(w[:, 2:], torch.ones(37, n_shared)) and w[:, :2].sum(-1).allclose(torch.tensor(2.5))
    stand_in.unjoin()

    want = reference_logits(reference_copy(hf), prompts())
    eng = Engine(hf, backend="eager", **SMALL)
    assert any(f"shared experts as {n_shared} more routed expert" in n for n in eng.telemetry.notes)
    assert not any(isinstance(m, FusedMLP) for m in hf.model.layers[1].mlp.modules())  # no MLP of their own
    assert max_diff(eng.prefill(prompts()).logits, want) <= 1e-4


def test_stacked_experts_hold_the_weights_once_and_restore_gives_them_back():
    hf = make_model("glm4_moe")

    def stored_bytes() -> int:
        return sum({storage_key(p): p.untyped_storage().nbytes() for p in hf.parameters()}.values())

    before, state = stored_bytes(), {k: v.clone() for k, v in hf.state_dict().items()}
    model = HFCausalLM(hf)
    fused = hf.model.layers[1].mlp
    assert isinstance(fused, FusedMoE) and fused.spec.stacks_shared
    stack = fused.spec.experts.gate_up
    assert {storage_key(fused.experts.gate_up_proj), storage_key(fused.shared_experts.gate_proj.weight),
            storage_key(fused.shared_experts.up_proj.weight)} == {storage_key(stack)}
    assert list(hf.state_dict()) == list(state) and stored_bytes() == before
    model.restore()
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in state.items())
    assert len({storage_key(p) for p in hf.parameters()}) == len(list(hf.parameters()))


def test_shared_experts_of_another_width_run_as_their_own_fused_mlp():
    """Not a multiple of the routed width: the block adds its shared MLP as before, itself fused (its parent is the
    fused block by then), and the notes say why."""
    hf = make_model("glm4_moe")
    torch.manual_seed(1)
    for layer in hf.model.layers[1:]:
        layer.mlp.shared_experts = SharedMLP(64, 48)
        for p in layer.mlp.shared_experts.parameters():
            nn.init.normal_(p, 0.0, 0.08)
    want = reference_logits(reference_copy(hf), prompts())
    eng = Engine(hf, backend="eager", **SMALL)
    why = "shared experts as their own MLP (their intermediate size 48 is not a multiple of the routed experts' 32)"
    assert any(why in n for n in eng.telemetry.notes), eng.telemetry.notes
    fused = hf.model.layers[1].mlp
    assert isinstance(fused, FusedMoE) and isinstance(fused.shared_experts, FusedMLP)
    assert max_diff(eng.prefill(prompts()).logits, want) <= 1e-4

