"""bcg's Triton varlen attention kernel against aten's FlashAttention, at the GPU presets' attention shapes.

For each shape (llama-dense, the Llama-3.2-1B shape, llama-dense-2k) and token count, a batch of ``--requests``
equal causal prompts runs through:

* ``flash``: FlashAttention varlen returning a new tensor (what an island would pay with no output buffer);
* ``flash+copy``: the same and a copy into the island's output (torch 2.11's island: no in-place route);
* ``triton``: bcg's kernel written into the output in place (``bcg.ops.kernels.attention``);
* ``triton+softcap``: with gemma2's soft-cap of 50 (FlashAttention has none: the feature path's per-request fp32
  math is what it replaces, ``feature_path`` times that).

Each variant is captured as one CUDA graph of ``--repeats`` calls (device time per call, median over ``--replays``
replays, as ``benchmarks/fused_ops.py``), with TFLOP/s over the visible query-key pairs (4 FLOPs a pair per head
dim), the host time to enqueue one eager call, and the largest difference from ``flash``. ``--block-m/--block-n/
--warps/--stages`` override the kernel's block configuration to tune it. The last line is one JSON object.

``--sweep`` times bcg's kernel alone under many block configurations per shape and token count instead, each the
way the engine runs it: up to 512 tokens (the whole-step graphs) reading keys through a pool's slots with the
padded tail zeroed and four request slots, above that (the island) directly. Beside them ``default`` (what
``block_config`` picks now) and ``before`` (the blocks of the query length alone, every key block masked: the
kernel of round 12), and per shape and length the fastest.

Usage::

    python benchmarks/attention_kernels.py --tokens 64,256,2048 --out attention.json
    python benchmarks/attention_kernels.py --sweep --tokens 64,256,1024,2048 --out sweep.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from fused_ops import graph_us, host_us

from bcg.bench.results import write_json
from bcg.ops.flash import copy_reason, flash_varlen
from bcg.ops.kernels.attention import varlen_attention
from bcg.ops.kernels.dispatch import fused_available

DTYPE = torch.bfloat16
# name -> (query heads, kv heads, head dim)
SHAPES = {"llama-dense": (16, 4, 64), "llama-3.2-1b": (32, 8, 64), "llama-dense-2k": (16, 4, 128),
          "qwen3-0.6b": (16, 8, 128)}
SLOT_MODE_TOKENS = 512  # up to here the engine runs attention inside its whole-step graphs, through the pool's slots


def variants(heads: int, kv_heads: int, dim: int, tokens: int, requests: int, config: object) -> dict:
    """``name -> callable`` over fixed inputs, plus the visible query-key pairs of the batch."""
    lens = [tokens // requests + (1 if r < tokens % requests else 0) for r in range(requests)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(tokens, kv_heads, dim, device="cuda", dtype=DTYPE) for _ in range(2))
    out = torch.empty_like(q)
    longest = max(lens)
    pairs = sum(n * (n + 1) // 2 for n in lens)

    def triton(**features):
        if config is None:
            return lambda: varlen_attention(q, k, v, cu, cu, longest, longest, out, **features)
        from bcg.ops.kernels import triton_attention

        return lambda: triton_attention.varlen_attention(q, k, v, cu, cu, longest, longest, out, config=config,
                                                         **features)

    def feature_path():  # the per-request fp32 math soft-capped layers take without this kernel
        from bcg.ops.attention.features import request_attention, visible_keys

        start = 0
        for n in lens:
            out[start : start + n] = request_attention(q[start : start + n], k[start : start + n],
                                                       v[start : start + n], visible_keys(n, 0, None, "cuda"),
                                                       dim ** -0.5, 50.0)
            start += n

    return {
        "flash": lambda: flash_varlen(q, k, v, cu, cu, longest, longest, is_causal=True),
        "flash+copy": lambda: out.copy_(flash_varlen(q, k, v, cu, cu, longest, longest, is_causal=True)),
        "triton": triton(),
        "triton+softcap": triton(softcap=50.0),
        "feature_path": feature_path,
    }, pairs, out


def run(shapes: list[str], tokens: list[int], requests: int, repeats: int, replays: int, config: object) -> list:
    rows = []
    for shape in shapes:
        heads, kv_heads, dim = SHAPES[shape]
        for t in tokens:
            torch.manual_seed(0)
            fns, pairs, out = variants(heads, kv_heads, dim, t, min(requests, t), config)
            want = fns["flash"]().float()
            flops = 4.0 * pairs * heads * dim
            for name, fn in fns.items():
                if name == "feature_path" and t > 512:
                    continue  # O(T^2) fp32 logits per request: slow and beside the point at long prompts
                row = {"shape": shape, "tokens": t, "requests": min(requests, t), "variant": name}
                try:
                    us = graph_us(fn, repeats, replays)
                    result = fn()
                    got = (result if isinstance(result, torch.Tensor) else out).float()
                    row.update(device_us=us, tflops=flops / us / 1e6, host_us=host_us(fn),
                               max_diff_vs_flash=None if "softcap" in name or name == "feature_path"
                               else (got - want).abs().max().item())
                except Exception as exc:  # one broken variant must not cost the whole GPU run
                    row["error"] = repr(exc)
                    traceback.print_exc()
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def sweep_configs(dim: int, tokens: int) -> dict[str, object]:
    """``name -> BlockConfig``: ``default``, ``before`` and a grid around them sized to the token count (``-masked``:
    every key block masked, no split loop)."""
    from bcg.ops.kernels.triton_attention import BlockConfig, block_config

    configs = {"default": block_config(dim, tokens), "before": before_config(dim, tokens)}
    if tokens <= 64:
        grid = [(m, n, 4, st, False) for m in (16, 32, 64) for n in (32, 64) for st in (2, 3)] + [(64, 64, 4, 3, True)]
    elif tokens <= SLOT_MODE_TOKENS:
        grid = [(m, n, w, 3, split) for m in (32, 64, 128) for n in (32, 64) for w in (4, 8)
                for split in (True, False) if w == 4 or n == 64]
    else:
        grid = [(m, n, w, st, True) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        grid += [(64, 64, 4, 3, False), (128, 64, 8, 3, False), (64, 128, 4, 3, False)]
    for m, n, w, st, split in grid:
        if dim > 128 and n > 64:
            continue
        configs[f"m{m}n{n}w{w}s{st}" + ("" if split else "-masked")] = BlockConfig(m, n, w, st, split)
    return configs


def before_config(dim: int, tokens: int) -> object:
    """The configuration of round 12 (before the split loop): 64-row blocks up to 64 query rows, else 128 (64 at
    head dim 256), every key block masked."""
    from bcg.ops.kernels.triton_attention import BlockConfig

    if dim > 128:
        return BlockConfig(64, 32, 4, 2, False) if tokens <= 64 else BlockConfig(64, 64, 8, 2, False)
    if tokens <= 64:
        return BlockConfig(64, 64, 4, 3, False)
    return BlockConfig(128, 64, 8 if dim > 64 else 4, 3, False)


def sweep(shapes: list[str], tokens: list[int], repeats: int, replays: int) -> list:
    """Every configuration of :func:`sweep_configs` per shape and length, the engine's way (see the docstring)."""
    from bcg.ops.kernels import triton_attention

    rows = []
    for shape in shapes:
        heads, kv_heads, dim = SHAPES[shape]
        for t in tokens:
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(t, heads, dim, generator=gen).to("cuda", DTYPE)
            k, v = (torch.randn(t, kv_heads, dim, generator=gen).to("cuda", DTYPE) for _ in range(2))
            cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
            want = flash_varlen(q, k, v, cu, cu, t, t, is_causal=True).float()
            slots = t <= SLOT_MODE_TOKENS
            if slots:  # the pool: the keys at shuffled rows, four request slots (three sentinels), the tail zeroed
                perm = torch.randperm(t + 64, generator=gen)[:t].to("cuda")
                pool_k, pool_v = (torch.zeros(t + 64, kv_heads, dim, device="cuda", dtype=DTYPE) for _ in range(2))
                pool_k[perm], pool_v[perm] = k, v
                cu_r = torch.tensor([0, t, t, t, t], dtype=torch.int32, device="cuda")
                args, extra = (q, pool_k, pool_v, cu_r, cu_r, t, t), dict(kv_slots=perm, zero_tail=True)
            else:
                args, extra = (q, k, v, cu, cu, t, t), {}
            out = torch.empty_like(q)
            flops = 4.0 * t * (t + 1) / 2 * heads * dim
            results = []
            for name, cfg in sweep_configs(dim, t).items():
                row = {"shape": shape, "tokens": t, "mode": "slots" if slots else "direct", "config": name,
                       "block": repr(cfg)}
                fn = functools.partial(triton_attention.varlen_attention, *args, out, config=cfg, **extra)
                try:
                    us = graph_us(fn, repeats, replays)
                    fn()
                    row.update(device_us=us, tflops=flops / us / 1e6, max_diff_vs_flash=(out.float() - want).abs()
                               .max().item())
                    results.append(row)
                except Exception as exc:  # a configuration that does not compile (registers, shared memory)
                    row["error"] = repr(exc)[:200]
                rows.append(row)
                print(f"{shape:<15} {t:>5} {row['mode']:<6} {name:<14} " + (
                    f"{row['device_us']:>9.2f} {row['tflops']:>7.1f} {row['max_diff_vs_flash']:>8.3g}"
                    if "error" not in row else f"ERROR {row['error'][:80]}"), flush=True)
            if results:
                best = min(results, key=lambda r: r["device_us"])
                by = {r["config"]: r["device_us"] for r in results}
                print(f"  best {best['config']} {best['device_us']:.2f} us; default {by.get('default', 0):.2f}; "
                      f"before {by.get('before', 0):.2f}", flush=True)
    return rows


def format_row(row: dict) -> str:
    head = f"{row['shape']:<15} {row['tokens']:>5} {row['requests']:>3} {row['variant']:<15}"
    if "error" in row:
        return f"{head} ERROR {row['error'][:80]}"
    diff = "-" if row["max_diff_vs_flash"] is None else f"{row['max_diff_vs_flash']:.3g}"
    return f"{head} {row['device_us']:>9.2f} {row['tflops']:>8.1f} {row['host_us']:>8.1f} {diff:>8}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None,
                        help=f"comma list of {', '.join(SHAPES)} (default: all; with --sweep, the three engine "
                             "presets' shapes, llama-dense-2k aside)")
    parser.add_argument("--tokens", default="64,256,2048")
    parser.add_argument("--requests", type=int, default=1, help="equal prompts the tokens are split into")
    parser.add_argument("--repeats", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=30, help="timed replays (median)")
    parser.add_argument("--block-m", type=int, default=None, help="override the kernel's block configuration")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="time the kernel under many block configurations")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not fused_available("cuda"):
        print("benchmarks/attention_kernels.py needs a CUDA GPU with triton importable; none found.")
        return 2
    import triton

    from bcg.ops.kernels.triton_attention import BlockConfig

    config = None if args.block_m is None else BlockConfig(args.block_m, args.block_n, args.warps, args.stages)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE), "repeats": args.repeats, "replays": args.replays, "config": repr(config),
            "flash_copy_reason": copy_reason(torch.device("cuda"))}
    print(json.dumps(meta))
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        shapes = args.shapes.split(",") if args.shapes else ["llama-dense", "llama-3.2-1b", "qwen3-0.6b"]
        meta["sweep"] = True
        rows = sweep(shapes, tokens, args.repeats, args.replays)
    else:
        print(f"{'shape':<15} {'T':>5} {'req':>3} {'variant':<15} {'device_us':>9} {'TFLOP/s':>8} {'host_us':>8} "
              f"{'maxdiff':>8}")
        rows = run(args.shapes.split(",") if args.shapes else list(SHAPES), tokens, args.requests, args.repeats,
                   args.replays, config)
    result = {"meta": meta, "results": rows}
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
