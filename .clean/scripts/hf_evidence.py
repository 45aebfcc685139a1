"""Transformers models through bcg on one GPU: transformers' own forward, bcg's transformers path and the native path.

For each model shape (a Qwen3-0.6B-shaped checkpoint written by ``scripts/make_checkpoint.py`` and loaded from disk by
transformers; a gpt-oss-shaped model built by transformers in memory, since its checkpoint is ~22 GB to write and
read) and each input length, one request:

* ``hf``: ``model(input_ids)`` under ``torch.inference_mode()``, the model's own forward (its default attention);
* ``tf_breakable``: ``Engine(model, backend="breakable")``, the transformers path (the same modules and weights);
* ``native_breakable``: ``Engine(path, model_impl="native", backend="breakable")`` where bcg has the architecture;

median of ``--runs`` timed runs after ``--warmup`` (CUDA events, whole calls), the greedy token against the model's
own, and the largest logit difference relative to the largest logit. With ``--fp32-reference`` every row (the
model's own bf16 forward too) is also compared with the same model's forward in fp32, the truth bf16 paths round
away from: a bf16 reference whose own error is as large as the engine's cannot tell a wrong answer from rounding.
``--ungraphed`` adds ``Engine(model, backend="eager")``, the same attention islands without graphs. Every
measurement is guarded (an error is printed and recorded, the rest goes on) and the whole run stops starting new
steps after ``--max-seconds``. Prints a table, then one JSON object (also written to ``--out``).

    PYTHONPATH=$PWD python scripts/hf_evidence.py --out hf_evidence.json       # on the GPU machine
    python scripts/hf_evidence.py --smoke                                        # tiny shapes on the CPU (CI)
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bcg.bench.engines import make_prompts, release_memory  # noqa: E402 - after the repository root is importable
from bcg.bench.results import summary_line  # noqa: E402
from bcg.bench.timing import time_fn  # noqa: E402
from bcg.errors import first_line  # noqa: E402
from bcg.runtime import Engine  # noqa: E402

SMOKE_SHAPES = {  # the same config classes at CPU test size
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=True)),
    "gpt-oss-small": ("GptOssConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
}
NATIVE = {"qwen3-0.6b"}  # shapes bcg's native loader maps


def _make_checkpoint() -> Any:
    """scripts/make_checkpoint.py as a module (its SHAPES and main)."""
    spec = importlib.util.spec_from_file_location("make_checkpoint", ROOT / "scripts" / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shapes(smoke: bool) -> dict[str, tuple[str, dict]]:
    return SMOKE_SHAPES if smoke else _make_checkpoint().SHAPES


class Run:
    """The results, the deadline, and a guard that runs one step and records its error instead of raising."""

    def __init__(self, max_seconds: float) -> None:
        self.deadline = time.monotonic() + max_seconds
        self.errors: list[str] = []

    def step(self, name: str, fn: Any, *args: Any) -> Any:
        if time.monotonic() > self.deadline:
            self.errors.append(f"{name}: skipped (past --max-seconds)")
            print(f"hf_evidence: {name}: skipped, past --max-seconds", file=sys.stderr, flush=True)
            return None
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as e:  # every measurement is guarded; the rest still runs
            traceback.print_exc()
            self.errors.append(f"{name}: {first_line(e)}")
            out = None
        print(f"hf_evidence: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return out


def _build_hf(shape: str, cls: str, fields: dict, folder: Path | None, device: str, smoke: bool) -> Any:
    import transformers

    if folder is not None:
        if not (folder / "config.json").exists():
            if smoke:  # the same thing at test size
                _in_memory(transformers, cls, fields, "cpu").save_pretrained(folder)
            else:
                _make_checkpoint().main([shape, str(folder)])
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    return _in_memory(transformers, cls, fields, device)


def _in_memory(transformers: Any, cls: str, fields: dict, device: str) -> Any:
    config = getattr(transformers, cls)(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _hf_forward(hf: Any, prompts: dict[int, torch.Tensor], args: argparse.Namespace, run: Run) -> dict[int, dict]:
    """transformers' own forward per length: time, last-token logits (kept for the comparisons)."""
    out: dict[int, dict] = {}
    device = next(hf.parameters()).device
    for n, p in prompts.items():
        ids = p[None].to(device)

        def measure(ids: torch.Tensor = ids) -> dict:
            with torch.inference_mode():
                logits = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
                timing = time_fn(lambda: hf(input_ids=ids, use_cache=False), device, args.runs, args.warmup)
            return {"ms": timing.median_ms, "logits": logits}

        out[n] = run.step(f"hf forward {n}", measure) or {}
    return out


def _fp32_logits(hf: Any, prompts: dict[int, torch.Tensor], run: Run) -> dict[int, torch.Tensor]:
    """The same weights in fp32 (a copy; the bf16 model is untouched): last-token logits per length."""
    twin = run.step("fp32 copy", lambda: copy.deepcopy(hf).float())
    if twin is None:
        return {}
    device = next(twin.parameters()).device
    out = {}
    with torch.inference_mode():
        for n, p in prompts.items():
            logits = run.step(f"fp32 forward {n}", lambda p=p, m=twin: m(input_ids=p[None].to(device), use_cache=False)
                              .logits[0, -1].float())
            if logits is not None:
                out[n] = logits
    del twin
    release_memory()
    return out


def _against(got: torch.Tensor, want: torch.Tensor | None, suffix: str = "") -> dict:
    """Greedy-token equality and the largest logit difference relative to the largest logit."""
    if want is None:
        return {}
    return {f"token_equal{suffix}": int(got.argmax()) == int(want.argmax()),
            f"rel_logit_diff{suffix}": float((got.float() - want).abs().max() / want.abs().max())}


def _engine_rows(make: Any, label: str, prompts: dict[int, torch.Tensor], ref: dict[int, dict],
                 args: argparse.Namespace, run: Run) -> dict[int, dict]:
    eng = run.step(f"{label} build", make)
    if eng is None:
        return {}
    rows: dict[int, dict] = {}
    result = {"build_ms": eng.build_ms, "auto_islands": eng.telemetry.auto_islands,
              "refused": eng.telemetry.refused_reason, "notes": eng.telemetry.notes, "by_length": rows}

    def measure(eng: Engine, p: torch.Tensor) -> dict:
        res = eng.prefill([p])
        timing = time_fn(lambda: eng.prefill([p]), eng.device, args.runs, args.warmup)
        row = {"ms": timing.median_ms, "graph_used": all(b.graph_used for b in res.batches),
               "token": int(res.next_tokens[0])}
        want = ref.get(len(p), {}).get("logits")
        if want is not None:
            top2 = want.topk(2).values
            row.update(hf_top2_gap=float(top2[0] - top2[1]), **_against(res.logits[0], want))
        row.update(_against(res.logits[0], ref.get(len(p), {}).get("fp32"), "_fp32"))
        return row

    for n, p in prompts.items():
        rows[n] = run.step(f"{label} {n}", measure, eng, p) or {}
    del eng
    release_memory()
    return result


def _opts(args: argparse.Namespace) -> dict:
    top = max(args.lengths)
    return dict(backend="breakable", device=args.device, dtype="bfloat16", chunked_prefill_size=top,
                buckets=sorted(set(args.lengths)), kv_tokens=2 * top, progress=False)


def run_shape(shape: str, spec: tuple[str, dict], args: argparse.Namespace, run: Run) -> dict:
    cls, fields = spec
    on_disk = shape in NATIVE or args.gpt_oss_on_disk
    folder = Path(args.workdir) / (f"smoke-{shape}" if args.smoke else shape) if on_disk else None
    hf = run.step(f"{shape}: load", _build_hf, shape, cls, fields, folder, args.device, args.smoke)
    if hf is None:
        return {}
    prompts = dict(zip(args.lengths, make_prompts(args.lengths, hf.config.vocab_size, seed=1)))
    result: dict[str, Any] = {"params": sum(p.numel() for p in hf.parameters()), "from_disk": folder is not None,
                              "attn_implementation": hf.config._attn_implementation}
    ref = _hf_forward(hf, prompts, args, run)  # before the engine switches the model's attention to bcg's
    if args.fp32_reference:
        for n, logits in _fp32_logits(hf, prompts, run).items():
            ref.setdefault(n, {})["fp32"] = logits
    result["hf"] = {n: {"ms": r.get("ms"), **_against(r["logits"], r.get("fp32"), "_fp32")} if "logits" in r else {}
                    for n, r in ref.items()}
    result["tf_breakable"] = _engine_rows(functools.partial(Engine, hf, **_opts(args)), f"{shape}: transformers path",
                                          prompts, ref, args, run)
    if args.ungraphed:
        result["tf_eager"] = _engine_rows(functools.partial(Engine, hf, **{**_opts(args), "backend": "eager"}),
                                          f"{shape}: transformers path, no graphs", prompts, ref, args, run)
    del hf
    release_memory()
    if shape in NATIVE and folder is not None and not args.skip_native:
        result["native_breakable"] = _engine_rows(lambda: Engine(folder, model_impl="native", **_opts(args)),
                                                  f"{shape}: native", prompts, ref, args, run)
        if args.native_torch_kernels:  # the native model without its fused kernels: the same kernels' count
            result["native_breakable_torch_kernels"] = _engine_rows(
                lambda: Engine(folder, model_impl="native", kernels="torch", **_opts(args)),
                f"{shape}: native, kernels='torch'", prompts, ref, args, run)
    return result


def _table(results: dict, lengths: list[int]) -> str:
    head = ("| shape | tokens | transformers forward ms | transformers path, breakable ms | speedup | "
            "native, breakable ms | tf path / native | token = transformers' | rel. diff to fp32: transformers / tf "
            "path / native | token = fp32's: transformers / tf path / native |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]

    def ms(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    for shape, r in results.items():
        for n in lengths:
            hf = (r.get("hf") or {}).get(n, {}).get("ms")
            tf = (r.get("tf_breakable") or {}).get("by_length", {}).get(n, {})
            nat = (r.get("native_breakable") or {}).get("by_length", {}).get(n, {})
            speed = f"{hf / tf['ms']:.1f}x" if hf and tf.get("ms") else "-"
            ratio = f"{tf['ms'] / nat['ms']:.2f}" if tf.get("ms") and nat.get("ms") else "-"
            tokens = "/".join(str(x.get("token_equal", "-")) for x in (tf, nat) if x)
            own = (r.get("hf") or {}).get(n, {})
            diffs = " / ".join(f"{x['rel_logit_diff_fp32']:.3f}" if "rel_logit_diff_fp32" in x else "-"
                               for x in (own, tf, nat))
            fp32_tokens = " / ".join(str(x.get("token_equal_fp32", "-")) for x in (own, tf, nat))
            lines.append(f"| {shape} | {n} | {ms(hf)} | {ms(tf.get('ms'))} | {speed} | {ms(nat.get('ms'))} | {ratio} "
                         f"| {tokens} | {diffs} | {fp32_tokens} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,gpt-oss-small", help="comma list (default: %(default)s)")
    ap.add_argument("--lengths", default="64,128,256,512", help="input lengths (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workdir", default="/tmp/bcg-hf-evidence", help="where checkpoints are written and reused")
    ap.add_argument("--gpt-oss-on-disk", action="store_true",
                    help="write and load the gpt-oss checkpoint too (~22 GB, minutes) instead of building it in memory")
    ap.add_argument("--skip-native", action="store_true")
    ap.add_argument("--fp32-reference", action="store_true",
                    help="also compare every row with the model's fp32 forward (a copy of the weights in fp32)")
    ap.add_argument("--ungraphed", action="store_true",
                    help="also measure the transformers path with backend='eager' (the islands without graphs)")
    ap.add_argument("--native-torch-kernels", action="store_true",
                    help="also measure the native path with kernels='torch' (no fused kernels)")
    ap.add_argument("--max-seconds", type=float, default=170.0, help="no new step starts after this (default: 170)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, lengths 8,16, one run: checks the script")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.runs, args.warmup = "8,16", 1, 0
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    import transformers

    shapes = _shapes(args.smoke)
    run = Run(args.max_seconds)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(f"hf_evidence: {env}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if shape not in shapes:
            run.errors.append(f"{shape}: unknown shape (known: {', '.join(shapes)})")
            continue
        results[shape] = run.step(shape, run_shape, shape, shapes[shape], args, run) or {}
    print(_table(results, args.lengths))
    for e in run.errors:
        print(f"error: {e}")
    summary = {"environment": env, "lengths": args.lengths, "runs": args.runs, "results": results, "errors": run.errors}
    text = summary_line(summary)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
