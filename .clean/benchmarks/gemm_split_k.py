"""Which cuBLAS setting lets the models' GEMMs at short prompts run without a split-K reduce kernel, and at what cost.

At 64 tokens the four GEMMs a layer run at kernel latency, and cuBLAS's heuristics add a split-K reduce kernel
(issue 29: 28 x 1.9 us of a 64-token llama-dense prefill). Each setting runs in its own process (two are environment
variables cuBLAS reads once): ``default``; ``fp32_reduction`` (``allow_bf16_reduced_precision_reduction = False``);
``cublaslt`` (``torch.backends.cuda.preferred_blas_library("cublaslt")``); ``no_workspace``
(``CUBLAS_WORKSPACE_CONFIG=:0:0`` and ``CUBLASLT_WORKSPACE_SIZE=0``: split-K needs a workspace). For each GEMM of the
llama-dense and Llama-3.2-1B layers (bf16, ``F.linear``) at each token count: the kernels one call launches, their
names, and the device time per call (torch.profiler over ``--calls`` back-to-back calls after a warm-up), with a
checksum of the output to compare settings by. The last line printed is one JSON object (``--out`` too).

Usage::

    python benchmarks/gemm_split_k.py --tokens 64,256 --out gemm_split_k.json

CUDA only: on a machine without a GPU it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

SETTINGS = ("default", "fp32_reduction", "cublaslt", "no_workspace")
ENV = {"no_workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}}
# (model, GEMM) -> (in features, out features): q/k/v fused, o, gate/up fused, down
SHAPES = {
    ("llama-dense", "qkv"): (1024, 1536), ("llama-dense", "o"): (1024, 1024),
    ("llama-dense", "gate_up"): (1024, 5632), ("llama-dense", "down"): (2816, 1024),
    ("llama-3.2-1b", "qkv"): (2048, 3072), ("llama-3.2-1b", "o"): (2048, 2048),
    ("llama-3.2-1b", "gate_up"): (2048, 16384), ("llama-3.2-1b", "down"): (8192, 2048),
}


def apply(setting: str) -> None:
    if setting == "fp32_reduction":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    elif setting == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")


def measure(setting: str, tokens: list[int], calls: int) -> list[dict]:
    """One process, one setting: every shape at every token count."""
    from torch.profiler import ProfilerActivity, profile

    apply(setting)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for (model, gemm), (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(5):
                y = F.linear(x, w)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    F.linear(x, w)
                torch.cuda.synchronize()
            count: dict[str, int] = defaultdict(int)
            us: dict[str, float] = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    count[e.name] += 1
                    us[e.name] += e.device_time
            rows.append({"model": model, "gemm": gemm, "tokens": m, "setting": setting,
                         "kernels_per_call": sum(count.values()) / calls, "device_us": sum(us.values()) / calls,
                         "names": {name[:60]: c / calls for name, c in count.items()},
                         "checksum": y.float().sum().item()})
    return rows


def table(rows: list[dict]) -> str:
    base = {(r["model"], r["gemm"], r["tokens"]): r for r in rows if r["setting"] == "default"}
    lines = ["| model | GEMM | tokens | setting | kernels/call | device us | vs default | split-K reduce |",
             "|---|---|---:|---|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["gemm"], r["tokens"], SETTINGS.index(r["setting"]))):
        b = base.get((r["model"], r["gemm"], r["tokens"]))
        ratio = f"{r['device_us'] / b['device_us']:.2f}" if b and b["device_us"] else "-"
        reduce = "yes" if any("reduce" in name.lower() for name in r["names"]) else "no"
        lines.append(f"| {r['model']} | {r['gemm']} | {r['tokens']} | {r['setting']} | {r['kernels_per_call']:.1f} | "
                     f"{r['device_us']:.1f} | {ratio} | {reduce} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one setting, rows as JSON on stdout
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_split_k: needs CUDA (cuBLAS's choices are what it measures)", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.child:
        print(json.dumps(measure(args.child, tokens, args.calls)))
        return 0
    rows, errors = [], []
    for setting in [s for s in args.settings.split(",") if s]:
        if setting not in SETTINGS:
            errors.append(f"{setting}: unknown (known: {', '.join(SETTINGS)})")
            continue
        env = {**os.environ, **ENV.get(setting, {})}
        proc = subprocess.run([sys.executable, __file__, "--child", setting, "--tokens", args.tokens, "--calls",
                               str(args.calls)], env=env, capture_output=True, text=True)
        if proc.returncode:
            errors.append(f"{setting}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
    print(table(rows))
    for e in errors:
        print(f"error: {e}")
    summary = {"kind": "gemm_split_k", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "rows": rows, "errors": errors}
    if args.out:
        args.out.write_text(json.dumps(summary))
    print(json.dumps(summary))
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
