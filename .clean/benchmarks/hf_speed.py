"""Transformers models at native speed: issue 21's targets measured in one run on one GPU.

Random weights written by transformers and loaded from disk by path, bf16, one request per call, median of
``--runs`` whole calls after ``--warmup`` (host timer around a device sync), default kernels (``kernels="fused"``
where Triton runs), and for every engine the CUDA kernels one call runs (the profiler's device activities, graph
replays included: kernels, copies and sets):

1. **by path** (Qwen3-0.6B and Llama-3.2-1B shapes by default; ``--shapes`` takes any of
   ``scripts/make_checkpoint.py``'s, the Qwen3-30B-A3B and gpt-oss-20b MoE shapes included, with kernels per layer
   reported for each path; gpt_oss has no native model, so it runs the transformers path alone): transformers' own
   forward, ``Engine(model, backend="breakable")`` (the transformers path, fused at load) and
   ``Engine(path, model_impl="native", backend="breakable")`` at ``--lengths`` (target: transformers path within
   1.15x of native), then both with ``compile="inductor"`` (target: compile at most 15 s; compile and capture times
   are reported apart, with the number of layer graphs compiled);
2. **every architecture** (``--archs``): each at a realistic width with ``--arch-layers`` layers (the ratio is per
   layer; fewer layers keep the run short), transformers' forward against breakable at ``--arch-lengths`` (target:
   at least 5x at 64-256 tokens), with the fusion's notes.

Every step is guarded: a failure is printed and recorded and the rest goes on; no step starts after
``--max-seconds``. Prints the tables, then one JSON line (also written to ``--out``). Inductor's cache goes to a fresh
folder unless ``--warm-cache``, so compile times are cold.

    PYTHONPATH=$PWD python benchmarks/hf_speed.py --out hf_speed.json     # one H200, about 4 minutes
    python benchmarks/hf_speed.py --smoke                                   # tiny shapes on the CPU (CI)
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the repository root is importable

from bcg.errors import first_line  # noqa: E402

DENSE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
NO_HEAD_DIM = {k: v for k, v in DENSE.items() if k != "head_dim"}
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS: dict[str, tuple[str, dict]] = {  # realistic widths (about 1B-class layers); the layer count is --arch-layers
    "llama": ("LlamaConfig", DENSE),
    "mistral": ("MistralConfig", {**DENSE, "sliding_window": 4096}),
    "qwen2": ("Qwen2Config", NO_HEAD_DIM),
    "qwen3": ("Qwen3Config", DENSE),
    "qwen3_moe": ("Qwen3MoeConfig", {**DENSE, "moe_intermediate_size": 768, "num_experts": 32,
                                     "num_experts_per_tok": 4, "norm_topk_prob": True}),
    "phi3": ("Phi3Config", {**NO_HEAD_DIM, **TOKENS}),
    "gemma2": ("Gemma2Config", dict(vocab_size=32000, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=256, sliding_window=4096,
                                    query_pre_attn_scalar=256, max_position_embeddings=8192)),
    "gemma3_text": ("Gemma3TextConfig", dict(vocab_size=32000, hidden_size=1152, intermediate_size=6912,
                                             num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                             sliding_window=512, max_position_embeddings=8192)),
    "olmo2": ("Olmo2Config", {**NO_HEAD_DIM, **TOKENS}),
    "granite": ("GraniteConfig", {**NO_HEAD_DIM, "embedding_multiplier": 12.0, "attention_multiplier": 0.015625,
                                  "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "gpt_oss": ("GptOssConfig", dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                     num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=4,
                                     sliding_window=128, max_position_embeddings=8192)),
    "glm4_moe": ("Glm4MoeConfig", {**DENSE, "moe_intermediate_size": 768, "n_routed_experts": 32,
                                   "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                   "n_group": 1, "topk_group": 1, "use_qk_norm": True}),
    "mixtral": ("MixtralConfig", {**DENSE, "intermediate_size": 2048, "num_local_experts": 8,
                                  "num_experts_per_tok": 2}),
}
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8)
BY_PATH = ("qwen3-0.6b", "llama-3.2-1b")


class Run:
    """Results, the deadline, and a guard that runs one step and records its error instead of raising."""

    def __init__(self, max_seconds: float) -> None:
        self.deadline = time.monotonic() + max_seconds
        self.errors: list[str] = []

    def step(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() > self.deadline:
            self.errors.append(f"{name}: skipped (past --max-seconds)")
            return None
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # one model failing must not lose the others
            traceback.print_exc()
            self.errors.append(f"{name}: {first_line(e)}")
            return None
        finally:
            print(f"hf_speed: {name} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Any, device: torch.device, runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _kernels(fn: Any, device: torch.device) -> tuple[int, dict[str, int]] | None:
    """CUDA device activities (kernels, copies, sets) of one call and their count by name (cut to 90 characters:
    enough to tell a cast from a copy), or None on a CPU or if the profiler fails."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        names = [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(names), dict(collections.Counter(names).most_common())
    except Exception:  # a profiler failure must not end the run: the timings stand
        return None


def _put_kernels(row: dict, counted: tuple[int, dict[str, int]] | None) -> None:
    if counted is not None:
        row["kernels"], row["kernel_names"] = counted


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _prompts(lengths: list[int], vocab: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randint(0, vocab, (n,), generator=g) for n in lengths}


def _hf_rows(hf: Any, prompts: dict[int, torch.Tensor], args: argparse.Namespace) -> dict[int, dict]:
    """transformers' own forward (its default attention): ms, greedy token, kernels at the shortest length."""
    device = next(hf.parameters()).device
    rows = {}
    with torch.inference_mode():
        for n, p in prompts.items():
            ids = p[None].to(device)
            logits = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
            top2 = logits.topk(2).values
            rows[n] = {"ms": _median_ms(lambda ids=ids: hf(input_ids=ids, use_cache=False), device, args.runs,
                                        args.warmup), "token": int(logits.argmax()),
                       "top2_gap": float(top2[0] - top2[1]), "max_logit": float(logits.abs().max())}
        first = min(prompts)
        _put_kernels(rows[first], _kernels(lambda: hf(input_ids=prompts[first][None].to(device), use_cache=False),
                                           device))
    return rows


def _engine_rows(eng: Any, prompts: dict[int, torch.Tensor], args: argparse.Namespace, kernels_at: list[int],
                 hf_rows: dict[int, dict] | None = None) -> dict:
    tel = eng.telemetry
    out: dict[str, Any] = {"build_ms": eng.build_ms, "compile_ms": tel.compile_ms, "capture_ms": tel.capture_ms,
                           "compile_error": tel.compile_error, "refused": tel.refused_reason, "notes": tel.notes,
                           "kernels_option": eng.config.kernels, "by_length": {}}
    layers = getattr(eng.runner.step.layers, "num_graphs", None)
    if layers is not None:
        out["layer_graphs"] = layers
    for n, p in prompts.items():
        res = eng.prefill([p])
        row = {"ms": _median_ms(lambda p=p: eng.prefill([p]), eng.device, args.runs, args.warmup),
               "graph_used": all(b.graph_used for b in res.batches), "token": int(res.next_tokens[0])}
        if hf_rows and n in hf_rows:
            row["token_equal"] = row["token"] == hf_rows[n]["token"]
        if n in kernels_at:
            _put_kernels(row, _kernels(lambda p=p: eng.prefill([p]), eng.device))
        out["by_length"][n] = row
    return out


def _opts(args: argparse.Namespace, lengths: list[int], **kw: Any) -> dict:
    top = max(lengths)
    return dict(backend="breakable", device=args.device, dtype="bfloat16", chunked_prefill_size=top,
                buckets=sorted(set(lengths)), kv_tokens=2 * top, progress=False, **kw)


def _load(folder: Path, device: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()


def _save_random(cls: str, fields: dict, folder: Path, device: str) -> None:
    import transformers

    config = getattr(transformers, cls)(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    _free()


def by_path(shape: str, args: argparse.Namespace, run: Run) -> dict:
    """Section 1: one checkpoint, transformers' forward, the transformers path and the native path."""
    from bcg.runtime import Engine

    folder = Path(args.workdir) / shape
    if not (folder / "config.json").exists():
        if args.smoke:
            cls, fields = _make_checkpoint().SHAPES[shape]
            tiny = {**fields, **{k: v for k, v in SMOKE.items() if k in fields}, "num_hidden_layers": 2}
            _save_random(cls, tiny, folder, "cpu")
        else:
            _make_checkpoint().main([shape, str(folder)])
    hf = _load(folder, args.device)
    prompts = _prompts(args.lengths, hf.config.vocab_size)
    out: dict[str, Any] = {"params": sum(p.numel() for p in hf.parameters()), "layers": hf.config.num_hidden_layers}
    out["hf"] = run.step(f"{shape}: transformers forward", _hf_rows, hf, prompts, args)
    kernels_at = [min(args.lengths), max(args.lengths)]
    eng = run.step(f"{shape}: transformers path build", Engine, hf, **_opts(args, args.lengths))
    if eng is not None:
        out["tf"] = run.step(f"{shape}: transformers path", _engine_rows, eng, prompts, args, kernels_at, out["hf"])
        del eng
        _free()
    if not _native_loads(hf.config.model_type):  # gpt_oss: no native model; the transformers path alone
        del hf
        _free()
        return out
    eng = run.step(f"{shape}: native build", Engine, folder, **_opts(args, args.lengths, model_impl="native"))
    if eng is not None:
        out["native"] = run.step(f"{shape}: native", _engine_rows, eng, prompts, args, kernels_at, out["hf"])
        del eng
        _free()
    compiled = {n: p for n, p in prompts.items() if n <= 256} or prompts
    compile_runs = () if args.no_compile else (("tf_compiled", hf, {}),
                                               ("native_compiled", folder, {"model_impl": "native"}))
    for label, source, extra in compile_runs:
        eng = run.step(f"{shape}: {label} build", Engine, source,
                       **_opts(args, list(compiled), compile=args.compiler, **extra))
        if eng is not None:
            out[label] = run.step(f"{shape}: {label}", _engine_rows, eng, compiled, args, [min(compiled)],
                                  out["hf"])
            del eng
            _free()
    del hf
    _free()
    return out


def one_arch(arch: str, args: argparse.Namespace, run: Run) -> dict:
    """Section 2: one architecture at a realistic width, saved and loaded by path; its forward against breakable."""
    from bcg.runtime import Engine

    cls, fields = ARCHS[arch]
    fields = {**fields, "num_hidden_layers": args.arch_layers}
    if args.smoke:
        fields = {**fields, **{k: v for k, v in SMOKE.items() if k in fields}, "num_hidden_layers": 2}
    folder = Path(args.workdir) / f"arch-{arch}-{args.arch_layers}"
    if not (folder / "config.json").exists():
        _save_random(cls, fields, folder, args.device)
    hf = _load(folder, args.device)
    prompts = _prompts(args.arch_lengths, hf.config.vocab_size)
    out: dict[str, Any] = {"params": sum(p.numel() for p in hf.parameters()), "layers": hf.config.num_hidden_layers}
    out["hf"] = _hf_rows(hf, prompts, args)
    eng = Engine(hf, **_opts(args, args.arch_lengths))
    out["tf"] = _engine_rows(eng, prompts, args, [min(args.arch_lengths)], out["hf"])
    del eng, hf
    _free()
    return out


def _native_loads(model_type: str) -> bool:
    from bcg.models.loader import SUPPORTED_MODEL_TYPES

    return model_type in SUPPORTED_MODEL_TYPES


def _make_checkpoint() -> Any:
    spec = importlib.util.spec_from_file_location("make_checkpoint", ROOT / "scripts" / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ms(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _count(row: dict) -> str:
    return str(row["kernels"]) if row.get("kernels") is not None else "-"


def _per_layer(row: dict, layers: int) -> str:
    """Kernels per layer (the whole call's over the layer count: the MoE target compares these)."""
    return f"{row['kernels'] / layers:.1f}" if row.get("kernels") is not None and layers else "-"


def _token(row: dict, hf: dict) -> str:
    """Whether the greedy token is the forward's; a differing one at a near-tie (top-2 gap under 1%) is marked."""
    if "token_equal" not in row:
        return "-"
    if row["token_equal"]:
        return "yes"
    return "tie" if hf.get("top2_gap", 1.0) < 0.01 * max(hf.get("max_logit", 1.0), 1.0) else "NO"


def _get(d: Any, *keys: Any) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def tables(results: dict) -> str:
    lines = ["## by path: transformers path vs native (breakable, default kernels, no compile)", "",
             "| shape | tokens | transformers forward ms | tf path ms | native ms | tf / native | speedup over "
             "forward | kernels forward / tf / native | per layer tf / native | token = forward's (tf / native) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for shape, r in results.get("by_path", {}).items():
        for n, hf in (_get(r, "hf") or {}).items():
            tf, nat = _get(r, "tf", "by_length", n) or {}, _get(r, "native", "by_length", n) or {}
            ratio = tf["ms"] / nat["ms"] if tf.get("ms") and nat.get("ms") else None
            speed = hf["ms"] / tf["ms"] if tf.get("ms") else None
            kern = " / ".join(_count(x) for x in (hf, tf, nat))
            per = " / ".join(_per_layer(x, r.get("layers", 0)) for x in (tf, nat))
            lines.append(f"| {shape} | {n} | {_ms(hf['ms'])} | {_ms(tf.get('ms'))} | {_ms(nat.get('ms'))} | "
                         f"{_ms(ratio)} | {_ms(speed)}x | {kern} | {per} | {_token(tf, hf)} / {_token(nat, hf)} |")
    lines += ["", "## compile=inductor (layer graphs compiled; compile and capture s; at the shortest length)", "",
              "| shape | path | layer graphs | compile s | capture s | ms | kernels | error |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for shape, r in results.get("by_path", {}).items():
        for label in [x for x in ("tf_compiled", "native_compiled") if x in r]:  # none under --no-compile
            c = r.get(label) or {}
            row = (c.get("by_length") or {}).get(min(c.get("by_length") or {0: 0}), {})
            compile_s, capture_s = (c.get("compile_ms") or 0) / 1e3, (c.get("capture_ms") or 0) / 1e3
            lines.append(f"| {shape} | {label} | {c.get('layer_graphs', '-')} | {_ms(compile_s)} | {_ms(capture_s)} | "
                         f"{_ms(row.get('ms'))} | {_count(row)} | {c.get('compile_error') or ''} |")
    lines += ["", "## every architecture: breakable vs transformers' own forward", "",
              "| arch | params | tokens | forward ms | breakable ms | speedup | kernels forward / breakable | "
              "per layer | token equal | left as written |", "|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for arch, r in results.get("archs", {}).items():
        left = "; ".join(n.removeprefix("left as written: ") for n in (_get(r, "tf", "notes") or [])
                         if n.startswith("left"))
        for n, hf in (_get(r, "hf") or {}).items():
            tf = _get(r, "tf", "by_length", n) or {}
            speed = hf["ms"] / tf["ms"] if tf.get("ms") else None
            lines.append(f"| {arch} | {r['params'] / 1e6:.0f}M | {n} | {_ms(hf['ms'])} | {_ms(tf.get('ms'))} | "
                         f"{_ms(speed)}x | {_count(hf)} / {_count(tf)} | {_per_layer(tf, r.get('layers', 0))} | "
                         f"{_token(tf, hf)} | {left} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,256,1024,2048", help="section 1 lengths (default: %(default)s)")
    ap.add_argument("--arch-lengths", default="64,256", help="section 2 lengths (default: %(default)s)")
    ap.add_argument("--archs", default=",".join(ARCHS), help="section 2 architectures (default: all listed)")
    ap.add_argument("--arch-layers", type=int, default=8, help="section 2 layers per model (default: %(default)s)")
    ap.add_argument("--shapes", default=",".join(BY_PATH), help="section 1 checkpoints (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a fresh temporary folder)")
    ap.add_argument("--max-seconds", type=float, default=225.0, help="no step starts after this (default: 225)")
    ap.add_argument("--no-compile", action="store_true", help="section 1 without the compile=inductor engines")
    ap.add_argument("--warm-cache", action="store_true", help="keep Inductor's usual cache (compile times warm)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, lengths 8,16, one run")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.lengths, args.arch_lengths, args.runs, args.warmup = "8,16", "8,16", 1, 0
        args.archs = "llama,gpt_oss" if args.archs == ",".join(ARCHS) else args.archs
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.arch_lengths = [int(x) for x in args.arch_lengths.split(",") if x.strip()]
    args.compiler = "inductor" if args.device.startswith("cuda") else "traced"  # the emulation records no Inductor
    if not args.warm_cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bcg-inductor-"))
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bcg-hf-speed-") as tmp:
        args.workdir = args.workdir or tmp
        try:
            return _main(args)
        finally:
            torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    import transformers

    run = Run(args.max_seconds)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
           "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(f"hf_speed: {env}", file=sys.stderr, flush=True)
    results: dict[str, Any] = {"by_path": {}, "archs": {}}
    for shape in [s for s in args.shapes.split(",") if s]:
        results["by_path"][shape] = run.step(shape, by_path, shape, args, run) or {}
    for arch in [a for a in args.archs.split(",") if a]:
        if arch not in ARCHS:
            run.errors.append(f"{arch}: unknown architecture (known: {', '.join(ARCHS)})")
            continue
        results["archs"][arch] = run.step(arch, one_arch, arch, args, run) or {}
    print(tables(results))
    for e in run.errors:
        print(f"error: {e}")
    summary = {"environment": env, "lengths": args.lengths, "arch_lengths": args.arch_lengths, "runs": args.runs,
               "results": results, "errors": run.errors}
    text = json.dumps(summary, separators=(", ", ": "), default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
