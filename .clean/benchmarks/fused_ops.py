"""Fused kernels against the plain-torch code they replace, per op, at the GPU presets' shapes.

For each preset (llama-dense, llama-dense-2k, gptoss-moe) and token count, every op runs as the models run it
today ("torch": the unfused kernels, e.g. ``h = h + x; F.rms_norm(h)``) and fused (``bcg.ops.kernels``). Each
variant is captured as one CUDA graph of ``--repeats`` back-to-back calls, so launch overhead is excluded and what
is measured is device time per call (median over ``--replays`` replays, CUDA events). The table also gives the
kernels each variant launches (torch.profiler, one eager call), how close fused is to torch on the same bf16
inputs (fraction of bit-identical elements, max |diff|) and the host time to enqueue one eager call (``host_t``,
``host_f``: what the eager backend and a capture pay). The last line printed is one JSON object; ``--out``
writes it to a file too.

Usage::

    python benchmarks/fused_ops.py --tokens 64,512,2048 --out kernels.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from bcg.ops import kernels
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bcg.ops import kernels

from bcg.bench.results import write_json
from bcg.models.config import get_preset
from bcg.ops.kernels.rope import rope_angles, rotate

DTYPE = torch.bfloat16
PRESETS = ("llama-dense", "llama-dense-2k", "gptoss-moe")


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(DTYPE)


def cases(preset: str, tokens: int) -> tuple[dict, dict]:
    """``op -> (torch variant, fused variant)``, closures over fixed inputs and outputs, and ``op -> check`` for
    the ops whose variants cannot simply be called and compared."""
    cfg = get_preset(preset)
    hidden, heads, kv_heads, dim, eps = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    w = rand(hidden, scale=0.1) + 1
    x, h = rand(tokens, hidden), rand(tokens, hidden, scale=4.0)
    checks: dict[str, Callable[[], tuple[object, object]]] = {}  # op -> (torch result, fused result) where the
    # variants write shared buffers or work in place
    out: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "rms_norm": (lambda: F.rms_norm(h, (hidden,), w, eps), lambda: kernels.rms_norm(h, w, eps, impl="fused")),
    }
    # The residual add + norm: `h = h + x; n = norm(h)` (the add allocates) against the in-place fused kernel.
    x2, h2 = x.clone(), h.clone()
    out["add_rms_norm"] = (lambda: F.rms_norm(h + x, (hidden,), w, eps),
                           lambda: kernels.fused_add_rms_norm(x2, h2, w, eps, impl="fused"))
    checks["add_rms_norm"] = lambda: (F.rms_norm(h + x, (hidden,), w, eps),
                                      kernels.fused_add_rms_norm(x.clone(), h.clone(), w, eps, impl="fused")[0])

    qkv = rand(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim))
    cos, sin = rope_angles(positions, inv_freq)  # once per forward in the models, so not timed
    qk_buf, v_buf = torch.empty(tokens, heads + kv_heads, dim, dtype=DTYPE, device="cuda"), torch.empty(
        tokens, kv_heads, dim, dtype=DTYPE, device="cuda")
    fused_out = (qk_buf[:, :heads], qk_buf[:, heads:], v_buf)

    def rope_torch() -> None:  # QKVProjection.rotated + carry into the bridge buffers (two casting copies)
        qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        qk_buf.copy_(rotate(qk, cos, sin))
        v_buf.copy_(qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))

    out["qkv_rope"] = (rope_torch, lambda: kernels.qkv_norm_rope(qkv, positions, inv_freq, heads, kv_heads,
                                                                  out=fused_out, impl="fused"))
    checks["qkv_rope"] = lambda: (_run_then(rope_torch, qk_buf), _run_then(out["qkv_rope"][1], qk_buf))
    q_w, k_w = rand(dim, scale=0.1) + 1, rand(dim, scale=0.1) + 1

    def rope_norm_torch() -> None:  # the q/k-norm path (Qwen3): norms, two rotations, cat, copies
        qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        parts = []
        for part, weight in ((qk[:, :heads], q_w), (qk[:, heads:], k_w)):
            normed = F.rms_norm(part, (dim,), weight, eps)
            parts.append(rotate(normed, cos, sin).to(DTYPE))
        qk_buf.copy_(torch.cat(parts, dim=1))
        v_buf.copy_(qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim))

    out["qkv_norm_rope"] = (rope_norm_torch, lambda: kernels.qkv_norm_rope(
        qkv, positions, inv_freq, heads, kv_heads, q_weight=q_w, k_weight=k_w, eps=eps, out=fused_out, impl="fused"))
    checks["qkv_norm_rope"] = lambda: (_run_then(rope_norm_torch, qk_buf), _run_then(out["qkv_norm_rope"][1], qk_buf))

    if not cfg.is_moe:
        gate_up = rand(tokens, 2 * cfg.intermediate_size)
        out["silu_and_mul"] = (lambda: kernels.silu_and_mul_reference(gate_up),
                               lambda: kernels.silu_and_mul(gate_up, impl="fused"))
        return out, checks
    experts, top_k, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    logits = rand(tokens, experts)
    out["router_topk"] = (lambda: kernels.router_topk_reference(logits, top_k, True, DTYPE),
                          lambda: kernels.router_topk(logits, top_k, impl="fused"))
    weights, ids = kernels.router_topk_reference(logits.float(), top_k, True, DTYPE)  # fp32: no ties

    def order_torch():  # MoEFFN.forward: stable sort, token of each row, group ends
        sorted_ids, order = ids.flatten().sort(stable=True)
        arange = torch.arange(experts, device="cuda", dtype=sorted_ids.dtype)
        return order // top_k, torch.searchsorted(sorted_ids, arange, right=True, out_int32=True), order

    out["expert_order"] = (order_torch, lambda: kernels.expert_order(ids, experts, impl="fused"))
    gate_up = rand(tokens * top_k, 2 * inter)
    out["silu_and_mul"] = (lambda: kernels.silu_and_mul_reference(gate_up),
                           lambda: kernels.silu_and_mul(gate_up, impl="fused"))
    y_sorted = rand(tokens * top_k, hidden)
    order = order_torch()[2]
    slot = kernels.expert_order(ids, experts, impl="torch").slot

    def combine_torch():  # MoEFFN.forward: un-sort by scatter, weighted sum by einsum
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return torch.einsum("tkh,tk->th", y.view(tokens, top_k, hidden), weights)

    out["moe_combine"] = (combine_torch, lambda: kernels.moe_combine(y_sorted, slot, weights, impl="fused"))
    return out, checks


def _run_then(fn: Callable[[], object], buf: torch.Tensor) -> torch.Tensor:
    fn()
    return buf.clone()


def first_tensor(result: object) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    return None


def graph_us(fn: Callable[[], object], repeats: int, replays: int) -> float:
    """Device time of one call: a CUDA graph of ``repeats`` calls, median replay over ``replays``, divided."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile (Triton) and warm the allocator outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / repeats)
    del graph
    return statistics.median(samples)


def host_us(fn: Callable[[], object], calls: int = 40) -> float:
    """Host time to enqueue one eager call (what the eager backend and a capture pay per call): median of five
    bursts of ``calls`` calls, few enough that the launch queue never fills and blocks the host."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(samples)


def kernel_count(fn: Callable[[], object]) -> int | None:
    """CUDA kernels one eager call launches (memcpy/memset included), or None if the profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # profiler unavailable in this build or sandbox: the timing still stands
        return None


def agreement(ref: object, fused: object) -> tuple[float | None, float | None]:
    """Fraction of bit-identical elements and max |diff| of the first tensors of two results."""
    r, f = first_tensor(ref), first_tensor(fused)
    if r is None or f is None or r.shape != f.shape or r.numel() == 0:
        return None, None
    diff = (r.double() - f.double()).abs().max().item()
    return (r == f).double().mean().item(), diff


def run(presets: list[str], tokens: list[int], repeats: int, replays: int) -> list[dict]:
    rows = []
    for preset in presets:
        for t in tokens:
            torch.manual_seed(0)
            try:
                ops, checks = cases(preset, t)
            except Exception as exc:  # keep going: one broken case must not cost the whole GPU run
                rows.append({"preset": preset, "tokens": t, "op": "<setup>", "error": repr(exc)})
                traceback.print_exc()
                continue
            for op, (ref_fn, fused_fn) in ops.items():
                row: dict = {"preset": preset, "tokens": t, "op": op}
                try:
                    exact, diff = agreement(*(checks[op]() if op in checks else (ref_fn(), fused_fn())))
                    row.update(torch_us=graph_us(ref_fn, repeats, replays),
                               fused_us=graph_us(fused_fn, repeats, replays),
                               torch_kernels=kernel_count(ref_fn), fused_kernels=kernel_count(fused_fn),
                               torch_host_us=host_us(ref_fn), fused_host_us=host_us(fused_fn),
                               bit_exact=exact, max_abs_diff=diff)
                    row["speedup"] = row["torch_us"] / row["fused_us"]
                except Exception as exc:
                    row["error"] = repr(exc)
                    traceback.print_exc()
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['preset']:<15} {row['tokens']:>5} {row['op']:<14} ERROR {row['error'][:80]}"
    exact = "-" if row["bit_exact"] is None else f"{row['bit_exact']:.4f}"
    diff = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.3g}"
    return (f"{row['preset']:<15} {row['tokens']:>5} {row['op']:<14} {row['torch_us']:>8.2f} {row['fused_us']:>8.2f} "
            f"{row['speedup']:>6.2f}x {str(row['torch_kernels']):>4} {str(row['fused_kernels']):>4} "
            f"{exact:>7} {diff:>8} "
            f"{row['torch_host_us']:>7.1f} {row['fused_host_us']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--tokens", default="64,512,2048")
    parser.add_argument("--repeats", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=30, help="timed replays (median)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/fused_ops.py needs a CUDA GPU (the fused kernels are Triton on CUDA); none found.")
        return 2
    if not kernels.fused_available("cuda"):
        print("benchmarks/fused_ops.py needs triton importable next to torch; it is not.")
        return 2
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE), "repeats": args.repeats, "replays": args.replays}
    print(json.dumps(meta))
    print(f"{'preset':<15} {'T':>5} {'op':<14} {'torch_us':>8} {'fused_us':>8} {'speedup':>7} {'k_t':>4} {'k_f':>4} "
          f"{'exact':>7} {'maxdiff':>8} {'host_t':>7} {'host_f':>7}")
    rows = run(args.presets.split(","), [int(t) for t in args.tokens.split(",")], args.repeats, args.replays)
    result = {"meta": meta, "results": rows}
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
