"""bcg's varlen attention kernel under each way it reads keys, on the same batch: where the whole-step graphs' time
goes against the islands'.

The islands' kernel reads packed keys directly; the whole-step graphs' reads the KV pool's layer, with four request
slots (three empty sentinels) and the padded tail zeroed in the same launch. On the H200 (round 15) the whole-step
graphs' kernel took 1.13-1.26x the islands' at 2048 tokens even with the address loop (``BCG_KV_READS=runs``); this
times, on one prompt per shape and length, with the same inputs:

* ``direct``: packed keys, one request slot (an island);
* ``direct+slots4``: packed keys with the whole-step graph's four request slots and zeroed tail (what the grid and
  the tail cost);
* ``slots``: keys through a shuffled run of pool slots (``BCG_KV_READS=slots``);
* ``slots+base``: keys at one run of pool rows, read by address through the per-request choice (``runs``: two key
  loops in one kernel);
* ``base``: the same run read by address with the one loop (``runs_only``);
* ``direct+tail``: packed keys, one request slot, the tail zeroed (what the tail alone costs);

and each again on the flat grid (``/flat``, ``BCG_VARLEN_GRID=flat``: one program per row block a sequence has).

Each is captured as one CUDA graph of ``--repeats`` calls (device time per call, the median over ``--replays``
replays, as ``benchmarks/fused_ops.py``), with TFLOP/s and the largest difference from ``direct``. The last line is
one JSON object.

Usage::

    python benchmarks/attention_reads.py --tokens 64,256,1024,2048 --out reads.json

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
from attention_kernels import DTYPE, SHAPES
from fused_ops import graph_us

from bcg.bench.results import write_json
from bcg.ops.kernels.attention import varlen_attention
from bcg.ops.kernels.dispatch import fused_available

BASE_MODES = ("direct", "direct+tail", "direct+slots4", "slots", "slots+base", "base")
MODES = BASE_MODES + tuple(f"{mode}/flat" for mode in BASE_MODES)


def calls(heads: int, kv_heads: int, dim: int, tokens: int, device: str = "cuda") -> tuple[dict, torch.Tensor]:
    """``mode -> callable`` over one prompt of ``tokens``, every mode writing the same ``out`` (on a CPU each runs
    the kernel's reference, which is how the tests check that the modes agree)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=gen).to(device, DTYPE)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen).to(device, DTYPE) for _ in range(2))
    out = torch.empty_like(q)
    one = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    four = torch.tensor([0, tokens, tokens, tokens, tokens], dtype=torch.int32, device=device)
    # A pool twice the prompt: the run at row 17 (an odd start, as a pool's), the shuffled slots anywhere in it.
    rows = 2 * tokens + 64
    run = torch.arange(17, 17 + tokens, device=device)
    shuffled = torch.randperm(rows, generator=gen)[:tokens].to(device)
    pools = {}
    for name, slots in (("run", run), ("shuffled", shuffled)):
        pool_k, pool_v = (torch.zeros(rows, kv_heads, dim, device=device, dtype=DTYPE) for _ in range(2))
        pool_k[slots], pool_v[slots] = k, v
        pools[name] = (pool_k, pool_v)
    base = torch.tensor([17, -1, -1, -1], dtype=torch.int64, device=device)
    tail = dict(zero_tail=True)
    fns = {}
    for flat in (False, True):
        if device == "cpu":  # the reference: one grid as good as another
            attend = varlen_attention
        else:
            from bcg.ops.kernels import triton_attention

            attend = functools.partial(triton_attention.varlen_attention, flat_grid=flat)
        suffix = "/flat" if flat else ""
        fns.update({f"{mode}{suffix}": fn for mode, fn in {
            "direct": lambda a=attend: a(q, k, v, one, one, tokens, tokens, out),
            "direct+tail": lambda a=attend: a(q, k, v, one, one, tokens, tokens, out, **tail),
            "direct+slots4": lambda a=attend: a(q, k, v, four, four, tokens, tokens, out, **tail),
            "slots": lambda a=attend: a(q, *pools["shuffled"], four, four, tokens, tokens, out, kv_slots=shuffled,
                                        **tail),
            "slots+base": lambda a=attend: a(q, *pools["run"], four, four, tokens, tokens, out, kv_slots=run,
                                             kv_base=base, **tail),
            "base": lambda a=attend: a(q, *pools["run"], four, four, tokens, tokens, out, kv_base=base, **tail),
        }.items()})
    return fns, out


def run(shapes: list[str], tokens: list[int], repeats: int, replays: int) -> list[dict]:
    rows = []
    print(f"{'shape':<15} {'T':>5} {'mode':<14} {'device_us':>9} {'TFLOP/s':>8} {'x direct':>8} {'maxdiff':>8}")
    for shape in shapes:
        heads, kv_heads, dim = SHAPES[shape]
        for t in tokens:
            fns, out = calls(heads, kv_heads, dim, t)
            fns["direct"]()
            want = out.float().clone()
            flops = 4.0 * t * (t + 1) / 2 * heads * dim
            direct_us = None
            for mode, fn in fns.items():
                row = {"shape": shape, "tokens": t, "mode": mode}
                try:
                    us = graph_us(fn, repeats, replays)
                    out.fill_(float("nan"))
                    fn()
                    direct_us = us if mode == "direct" else direct_us
                    row.update(device_us=us, tflops=flops / us / 1e6,
                               over_direct=us / direct_us if direct_us else None,
                               max_diff_vs_direct=(out.float() - want).abs().max().item())
                    print(f"{shape:<15} {t:>5} {mode:<14} {us:>9.2f} {row['tflops']:>8.1f} "
                          f"{row['over_direct'] or 0:>8.3f} {row['max_diff_vs_direct']:>8.3g}", flush=True)
                except Exception as exc:  # one broken mode must not cost the whole GPU run
                    row["error"] = repr(exc)[:300]
                    traceback.print_exc()
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-dense,llama-3.2-1b,qwen3-0.6b",
                        help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="64,256,1024,2048")
    parser.add_argument("--repeats", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=30, help="timed replays (median)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not fused_available("cuda"):
        print("benchmarks/attention_reads.py needs a CUDA GPU with triton importable; none found.")
        return 2
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE), "repeats": args.repeats, "replays": args.replays, "modes": list(MODES)}
    rows = run(args.shapes.split(","), [int(t) for t in args.tokens.split(",")], args.repeats, args.replays)
    result = {"meta": meta, "results": rows}
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
