"""The attention's q/k/v projection at short prompts: cuBLAS's GEMM then bcg's RoPE kernel (two launches), against
bcg's one kernel with the RoPE, the split and the K/V write in the projection's epilogue
(``bcg/ops/kernels/triton_qkv_rope.py``).

For the q/k/v layers of the llama-dense, Llama-3.2-1B and Qwen3-0.6B (per-head q/k norms) shapes and of gptoss-moe
(a bias), bf16, each writing its K/V into a KV pool as the models do, at each row count: the kernels each path
launches and its device time inside a CUDA graph (``benchmarks/fused_ops.py``'s ``graph_us``: ``--calls`` back to back
in one graph, the median of ``--replays`` replays, divided), and the one kernel's largest difference from the two
steps. The one kernel runs through its launcher, past the entry point's row limit too. Consecutive calls read
different copies of the weight, more of them than the L2 cache holds, as a model's layers do: a kernel timed on one
weight, hot in L2, looks faster than it runs in a forward (round 10's first sweep did, by up to 1.5x).

``--sweep`` times the one kernel under other tilings at the given row counts and records what Triton compiled for
each (registers, spills, shared memory, cp.async, wgmma): the tiling rule is chosen from that table. The last line
printed is one JSON object (``--out`` too).

Usage::

    python benchmarks/qkv_kernels.py --rows 16,64,128,256 --out qkv_kernels.json
    python benchmarks/qkv_kernels.py --sweep --rows 16,64 --out qkv_sweep.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's fused_ops.py and mlp_kernels.py
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the checkout's bcg, not an installed one
from fused_ops import graph_us
from mlp_kernels import compiled_facts, kernel_names

from bcg.ops.kernels import qkv_norm_rope

# model -> (hidden, heads, kv_heads, head_dim, per-head q/k norms, bias)
SHAPES = {"llama-dense": (1024, 16, 4, 64, False, False), "llama-3.2-1b": (2048, 32, 8, 64, False, False),
          "qwen3-0.6b": (1024, 16, 8, 128, True, False), "gptoss-moe": (1024, 16, 2, 64, False, True)}
COLD_BYTES = 256 * 2**20  # weight copies read in turn: several times the H200's 50 MB of L2


class Layer:
    """One q/k/v layer's weights, input, outputs and KV pool, and its two paths (the one kernel's tiling
    overridable)."""

    def __init__(self, shape: tuple, rows: int, gen: torch.Generator) -> None:
        from bcg.ops.kernels import triton_qkv_rope  # Triton: imported where a GPU runs it

        self.kernel = triton_qkv_rope
        hidden, self.heads, self.kv_heads, dim, norm, bias = shape
        self.rows, self.hidden, self.dim, self.norm = rows, hidden, dim, norm
        self.width = width = (self.heads + 2 * self.kv_heads) * dim
        kw = {"device": "cuda", "generator": gen}
        copies = max(1, min(32, -(-COLD_BYTES // (2 * width * hidden))))  # more weight than L2 holds, in turn
        self.weights = [(torch.randn(width, hidden, **kw) * hidden**-0.5).bfloat16() for _ in range(copies)]
        self.turn = 0
        self.bias = (torch.randn(width, **kw) * 0.1).bfloat16() if bias else None
        self.q_w = (torch.rand(dim, **kw) + 0.5).bfloat16() if norm else None
        self.k_w = (torch.rand(dim, **kw) + 0.5).bfloat16() if norm else None
        self.x = torch.randn(rows, hidden, **kw).bfloat16()
        self.positions = torch.arange(rows, device="cuda") + 100
        self.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim)
        self.outs = [torch.empty(rows, n, dim, device="cuda", dtype=torch.bfloat16)
                     for n in (self.heads, self.kv_heads, self.kv_heads)]
        pool = [torch.zeros(4 * rows + 16, self.kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        self.cache = (*pool, torch.randperm(4 * rows + 16, device="cuda")[:rows])
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.set_plan({})

    def set_plan(self, overrides: dict) -> None:
        self.plan = self.kernel.tiling(self.rows, self.hidden, self.heads + 2 * self.kv_heads, self.dim, self.norm,
                                       self.num_sms, **overrides)
        self.partials = torch.empty(max(1, self.plan.split_k * self.rows * self.width), device="cuda")
        self.counters = torch.zeros(self.plan.tiles, dtype=torch.int32, device="cuda")

    def weight(self) -> torch.Tensor:
        """The next copy of the weight (a capture binds each call to the copy it read)."""
        self.turn = (self.turn + 1) % len(self.weights)
        return self.weights[self.turn]

    def two_steps(self) -> torch.Tensor:
        qkv_norm_rope(F.linear(self.x, self.weight(), self.bias), self.positions, self.inv_freq, self.heads,
                      self.kv_heads, q_weight=self.q_w, k_weight=self.k_w, eps=1e-6, out=self.outs, cache=self.cache)
        return self.outs[0]

    def one_kernel(self) -> object:
        return self.kernel.qkv_rope(self.x, self.weight(), self.bias, self.positions, self.inv_freq, self.q_w,
                                    self.k_w, 1e-6, *self.outs, self.cache, self.partials, self.counters, self.plan)


def reference(layer: Layer) -> list[torch.Tensor]:
    """The two steps' outputs on the first weight copy."""
    layer.turn = -1
    layer.two_steps()
    return [o.float() for o in layer.outs]


def max_rel_diff(layer: Layer, ref: list[torch.Tensor]) -> float:
    return max(float((o.float() - r).abs().max() / r.abs().max()) for o, r in zip(layer.outs, ref))


def measure(rows_list: list[int], calls: int, replays: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model, shape in SHAPES.items():
        for rows in rows_list:
            layer = Layer(shape, rows, gen)
            ref = reference(layer)
            row: dict = {"model": model, "rows": rows, "tiling": layer.plan._asdict()}
            for name, fn in (("two_steps", layer.two_steps), ("one_kernel", layer.one_kernel)):
                layer.turn = -1  # the first copy, which the reference read
                fn()
                row[f"{name}_max_rel_diff"] = max_rel_diff(layer, ref)
                row[f"{name}_us"] = graph_us(fn, calls, replays)
                row[f"{name}_kernels"] = kernel_names(fn)
            results.append(row)
    return results


def sweep_variants(rows: int, dim: int, norm: bool) -> list[dict]:
    """The tilings tried (the default first): K steps and splits, warps, pipeline depth, pairs a program, row tiles."""
    variants: list[dict] = [{}]
    for block_k, warps, stages in ((128, 4, 3), (64, 8, 4), (32, 4, 4)):
        variants.append({"block_k": block_k, "num_warps": warps, "num_stages": stages})
    variants += [{"split_k": 1}, {"programs_per_sm": 1}, {"programs_per_sm": 4}, {"min_k_iters": 2}]
    if not norm:
        variants += [{"half_n": h} for h in (32, 64) if h <= dim // 2]
    if rows <= 64:
        variants += [{"block_m": 32}, {"block_m": 16} if rows > 16 else {"block_m": 64}]
    return variants


def sweep(rows_list: list[int], calls: int, replays: int) -> list[dict]:
    """Per shape and row count: the two steps, then every tiling of the one kernel, each checked against them."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for model, shape in SHAPES.items():
        for rows in rows_list:
            layer = Layer(shape, rows, gen)
            ref = reference(layer)
            two_steps = graph_us(layer.two_steps, calls, replays)
            print(f"{model:<13} {rows:>4} the two steps: {two_steps:.2f} us", flush=True)
            tried = []
            for overrides in sweep_variants(rows, shape[3], shape[4]):
                layer.set_plan(overrides)
                layer.turn = -1
                entry = {"overrides": overrides, "tiling": layer.plan._asdict(), **compiled_facts(layer.one_kernel())}
                entry["max_rel_diff"] = max_rel_diff(layer, ref)
                entry["us"] = graph_us(layer.one_kernel, calls, replays)
                print(f"  {entry['us']:>8.2f} us  {layer.plan}  regs {entry['regs']} spills {entry['spills']} "
                      f"diff {entry['max_rel_diff']:.2e}", flush=True)
                tried.append(entry)
            best = min(tried, key=lambda r: r["us"])
            results.append({"model": model, "rows": rows, "two_steps_us": two_steps, "best": best, "variants": tried})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,64,128,256", help="row counts, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="layers (or kernels) captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="replays timed")
    parser.add_argument("--sweep", action="store_true", help="time the one kernel's other tilings")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("qkv_kernels.py measures CUDA kernels and needs a GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    if args.sweep:
        results = sweep(rows, args.calls, args.replays)
        for r in results:
            print(f"best {r['model']} {r['rows']}: {r['best']['us']:.2f} us against the two steps' "
                  f"{r['two_steps_us']:.2f} us, with {r['best']['overrides']}")
        report = {"kind": "qkv_sweep", "results": results}
    else:
        results = measure(rows, args.calls, args.replays)
        print(f"{'model':<13} {'rows':>5} {'two steps us':>12} {'kernels':>7} {'one kernel us':>13} {'ratio':>6} "
              f"{'max rel diff':>12}")
        for r in results:
            print(f"{r['model']:<13} {r['rows']:>5} {r['two_steps_us']:>12.2f} {len(r['two_steps_kernels']):>7} "
                  f"{r['one_kernel_us']:>13.2f} {r['one_kernel_us'] / r['two_steps_us']:>6.2f} "
                  f"{r['one_kernel_max_rel_diff']:>12.2e}")
        report = {"kind": "qkv_kernels", "results": results}
    report.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
