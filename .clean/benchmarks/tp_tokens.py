"""Tensor parallel gives the tokens of one GPU: every backend at TP=N against eager at TP=1, same prompts.

Run under torchrun, one process per GPU::

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_tokens.py --model llama-dense-2k --out out/tp-tokens

Every rank builds one engine per backend at ``tp_size=N`` and prefills one seeded prompt per length (the prompts of
``bcg bench``); rank 0 then builds the single-GPU eager reference and compares: greedy tokens, the largest logit
difference relative to the largest logit, and for any token that differs the reference's top-1/top-2 margin (a
difference inside the bf16 rounding of a near tie is not a sharding bug). Rank 0 prints a table and, last, one JSON
line, and writes ``tp_tokens.json``. Also runs on a CPU (``--device cpu``, gloo) for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bcg.bench.checks import parse_int_list
from bcg.bench.engines import make_prompts, release_memory
from bcg.bench.tables import table
from bcg.models.config import get_preset
from bcg.models.loader import config_from_hf
from bcg.ops.parallel import init_tensor_parallel, shutdown_tensor_parallel
from bcg.runtime import Engine

BF16_TOLERANCE = 2e-2  # relative max logit difference accepted between TP=N and TP=1 (the verify allowance)


def _run(model: str, backend: str, tp_size: int, prompts: list[torch.Tensor], args: argparse.Namespace) -> list:
    eng = Engine(model, backend=backend, tp_size=tp_size, device=args.device, dtype=args.dtype, seed=args.seed,
                 max_tokens=max(args.lengths), chunked_prefill_size=max(args.lengths), progress=False)
    out = []
    for prompt in prompts:
        res = eng.prefill([prompt])
        out.append((res.logits[0].float().cpu(), all(b.graph_used for b in res.batches)))
    del eng
    release_memory()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-dense-2k")
    parser.add_argument("--backends", default="eager,breakable,full,tc_piecewise")
    parser.add_argument("--lengths", default="64,512,2048")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/tp-tokens")
    args = parser.parse_args()
    args.lengths = parse_int_list(args.lengths)
    tp_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp = init_tensor_parallel(tp_size, torch.device(args.device))
    if os.path.isdir(args.model):
        vocab = config_from_hf(json.loads((Path(args.model) / "config.json").read_text())).vocab_size
    else:
        vocab = get_preset(args.model).vocab_size
    prompts = [make_prompts([n], vocab, args.seed + n)[0] for n in args.lengths]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {b: _run(args.model, b, tp_size, prompts, args) for b in backends}
    if tp.rank != 0:
        shutdown_tensor_parallel()
        return 0
    reference = [logits for logits, _ in _run(args.model, "eager", 1, prompts, args)]
    rows, records = [], []
    for backend, per_length in results.items():
        for n, (logits, graph), ref in zip(args.lengths, per_length, reference):
            token, ref_token = int(logits.argmax()), int(ref.argmax())
            rel = float((logits - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            top2 = ref.topk(2).values
            margin = float((top2[0] - top2[1]) / ref.abs().max().clamp_min(1e-12))
            ok = token == ref_token and rel <= BF16_TOLERANCE
            records.append({"backend": backend, "tokens": n, "token": token, "ref_token": ref_token,
                            "same_token": token == ref_token, "rel_logit_diff": rel, "ref_top2_margin": margin,
                            "graph_used": graph, "ok": ok})
            rows.append([backend, n, "yes" if token == ref_token else f"no ({token} vs {ref_token})",
                         f"{rel:.2e}", f"{margin:.2e}", "yes" if graph else "no", "ok" if ok else "FAIL"])
    print(table(["backend", "tokens", "same token", "rel logit diff", "ref top-2 margin", "graph", "verdict"], rows,
                title=f"{args.model}: TP={tp_size} against eager at TP=1"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"model": args.model, "tp": tp_size, "tolerance": BF16_TOLERANCE, "rows": records,
               "all_ok": all(r["ok"] for r in records)}
    (out / "tp_tokens.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"model": args.model, "tp": tp_size, "all_ok": summary["all_ok"],
                      "results": str(out / "tp_tokens.json")}))
    shutdown_tensor_parallel()
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
