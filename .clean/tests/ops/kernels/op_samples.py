"""Sample arguments for every ``torch.ops.bcg`` kernel op, in the layouts the models pass: 2-D token-major rows,
transformers' ``(1, T, H)`` rows, row-strided views, half precision with fp32 weights (gemma's ``1 + w``), zero
tokens. Shared by the CPU opcheck tests and the Triton-interpreter tier; the CUDA tier moves them to the GPU."""

from __future__ import annotations

import torch
from kernel_cases import gen, inv_freq, randn, row_view


def _ids(rows: int, experts: int, top_k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Router ids: top_k distinct experts per token."""
    return torch.stack([torch.randperm(experts, generator=gen(seed + t))[:top_k] for t in range(rows)]).to(dtype) \
        if rows else torch.empty(0, top_k, dtype=dtype)


def _slot(rows: int, top_k: int, seed: int) -> torch.Tensor:
    """A permutation of ``rows * top_k`` rows as ``(rows, top_k)``: the slots of an expert order."""
    return torch.randperm(rows * top_k, generator=gen(seed)).view(rows, top_k)


def samples(device: str = "cpu") -> dict[str, list[tuple]]:
    """Op name -> argument tuples. Fresh tensors on every call (the in-place op writes its inputs)."""
    bf16, f32 = torch.bfloat16, torch.float32

    def r(*shape: int, dtype: torch.dtype = f32, seed: int = 0) -> torch.Tensor:
        return randn(*shape, dtype=dtype, device=device, seed=seed)

    def w(n: int, dtype: torch.dtype = f32, seed: int = 9) -> torch.Tensor:
        return (torch.rand(n, generator=gen(seed)) + 0.5).to(dtype=dtype, device=device)

    def strided(rows: int, cols: int, dtype: torch.dtype = f32, seed: int = 0) -> torch.Tensor:
        return row_view(rows, cols, dtype=dtype, device=device, seed=seed)

    freqs = inv_freq(16, device=device)
    return {
        "rms_norm": [(r(5, 1000), w(1000), 1e-6), (r(1, 7, 64, dtype=bf16), w(64), 1e-6),
                     (strided(3, 64), w(64), 1e-5), (r(0, 64), w(64), 1e-6)],
        "add_rms_norm": [(r(5, 1000, seed=1), r(5, 1000, seed=2), w(1000), 1e-6),
                         (r(1, 7, 64, dtype=bf16, seed=1), r(1, 7, 64, dtype=bf16, seed=2), w(64), 1e-6),
                         (r(1, 7, 64, dtype=bf16, seed=1), r(1, 7, 64, dtype=bf16, seed=2), w(64, bf16), 1e-6)],
        "fused_add_rms_norm_": [(r(5, 1000, seed=1), r(5, 1000, seed=2), w(1000), 1e-6),
                                (r(1, 7, 64, dtype=bf16, seed=1), r(1, 7, 64, dtype=bf16, seed=2), w(64), 1e-6)],
        "silu_and_mul": [(r(5, 20),), (r(1, 7, 256, dtype=bf16),), (strided(3, 40),), (r(0, 16),)],
        "qkv_norm_rope": [
            (r(5, 128), torch.arange(5, device=device), freqs, w(16), w(16, seed=8), 1e-6, 4, 2),
            (r(3, 128, dtype=bf16), torch.arange(7, 10, device=device), freqs, None, None, 1e-6, 4, 2),
            (strided(4, 96), torch.arange(4, device=device), freqs, None, None, 1e-6, 2, 2),
        ],
        "router_topk": [  # logits, top_k, renormalize, out_dtype, rule, correction bias, groups, scaling, shared
            (r(5, 8), 2, True, bf16, "softmax_topk", None, 1, 1, 1.0, 0),
            (r(9, 6, dtype=bf16), 3, False, bf16, "softmax_topk", None, 1, 1, 1.0, 0),
            (r(0, 8), 2, True, f32, "softmax_topk", None, 1, 1, 1.0, 0),
            (r(7, 8, dtype=bf16), 4, False, bf16, "topk_softmax", None, 1, 1, 1.0, 0),
            (strided(6, 16), 4, True, f32, "sigmoid_topk", r(16, seed=3) * 0.1, 4, 2, 2.5, 0),
            (r(5, 12), 3, False, f32, "sigmoid_topk", None, 1, 1, 1.0, 1),
        ],
        "clamped_swiglu": [  # gate_up, bias, expert, alpha, limit (gpt-oss's); values past the limit get clamped
            (r(5, 16, seed=2) * 6, r(3, 16, seed=3), torch.tensor([0, 2, 2, 1, 0], device=device), 1.702, 7.0),
            (r(4, 32, dtype=bf16, seed=4) * 6, r(2, 32, dtype=bf16, seed=5), torch.tensor([1, 0, 1, 1], device=device),
             1.702, 7.0),
            (strided(3, 8), None, torch.zeros(3, dtype=torch.int64, device=device), 1.0, 2.0),
            (r(0, 8), None, torch.zeros(0, dtype=torch.int64, device=device), 1.702, 7.0),
        ],
        "expert_order": [(_ids(5, 8, 2, torch.int64, 1).to(device), 8), (_ids(7, 6, 3, torch.int32, 2).to(device), 6),
                         (_ids(0, 8, 2, torch.int64, 3).to(device), 8)],
        "moe_combine": [(r(10, 6), _slot(5, 2, 4).to(device), torch.rand(5, 2, generator=gen(5)).to(device)),
                        (r(12, 64, dtype=bf16), _slot(3, 4, 6).to(device),
                         torch.rand(3, 4, generator=gen(7)).to(device=device, dtype=bf16)),
                        # gpt-oss's down bias: each row plus its expert's bias
                        (r(10, 6), _slot(5, 2, 4).to(device), torch.rand(5, 2, generator=gen(5)).to(device),
                         r(3, 6, seed=9), torch.tensor([0, 2, 1, 1, 0, 2, 2, 0, 1, 0], device=device))],
    }
