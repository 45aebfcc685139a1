"""Is a prefill device-bound? Wall time against device time, per model and length, and whether the host ever waits.

For each model (a preset, a checkpoint folder, or one of the real-model shapes below built with random weights) and
backend, one engine is built and kept; at each length one request of that many tokens is prefilled:

* **wall**: median ms of whole ``Engine.prefill`` calls, each followed by a device sync (what a caller sees);
* **host**: median ms until ``prefill`` returns (it does not wait for the GPU);
* **device**: the GPU's busy time during one prefill (the union of its kernels' intervals, from the profiler);
* **wall/device**: 1.0 means the host hides entirely behind the GPU;
* **launch**: median ms from the call until its first graph replay is called (the GPU idles until then);
* **after launch**: wall minus launch, what the GPU takes once the first graph is launched: the graph's kernels,
  the gaps between them (the profiler's kernel times leave those out, and stretch them: under CUPTI a graph's
  kernels sit 3-5 µs apart, not the 0.5 µs they do unprofiled), and the result's way back;
* **span**: median device ms from the first graph replay to the end of the prefill's work, from CUDA events in
  unprofiled prefills: after launch without the host's wake-up from the sync; against **device** (the kernels' own
  time in one profiled prefill) it is what the device side adds: gaps, waits for an island's launch, the clock;
* **gaps**: span minus device: the time the GPU idles between a prefill's kernels once it has the graph (0.3-0.5
  µs a kernel in a graph, less where programmatic dependent launch lets a kernel start while its predecessor ends);
* **syncs**: whether a prefill runs under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation
  from the call to the result), checked once per model;
* **kernels** (the per-kernel view, from one more profiled prefill at each length): how many kernels ran, how many
  of them the host launched one by one (``eager``: island work; the rest replayed from a graph), kernels a layer,
  and the kernels by name (count, total µs, share of the summed kernel time), costliest first. The table prints
  the ``--top-kernels`` costliest names; the JSON has them all. On a CPU the "kernels" are the ops that compute
  (:func:`bcg.bench.trace.kernels_from_events`), every one of them eager: the view's shape, not GPU numbers.

With ``--timeline`` one prefill per model at the first length is written as a Chrome trace (host and device
timelines side by side: load it in chrome://tracing or Perfetto). Build time and graph memory come from the engine's
telemetry. The last line printed is one JSON object with every number.

Usage::

    python benchmarks/device_bound.py --models llama-dense,gptoss-moe,glm-dsa,llama-3.2-1b,qwen3-0.6b \\
        --lengths 64,256,1024,2048 --out OUT/device_bound
    python benchmarks/device_bound.py --models llama-dense,llama-3.2-1b,glm-dsa --lengths 64,2048 --top-kernels 25
    # which field of a shape opens the gaps between its kernels: one bucket each, fields replaced one at a time
    python benchmarks/device_bound.py --models llama-dense,llama-dense+qk_norm=True,llama-dense+head_dim=128 \
        --lengths 64 --buckets 64 --top-kernels 0

Without CUDA it runs tiny-dense on the CPU as a smoke test: CPU timings say nothing about launch overhead.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    import bcg  # noqa: F401
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_path import prefill_times, stage_times  # this folder is the script's own

from bcg.bench.kernel_view import profile_kernels
from bcg.bench.shapes import SHAPES, model_spec
from bcg.bench.timing import gpu_kernel_ms, replay_span_ms, sync
from bcg.errors import first_line
from bcg.runtime import Engine


def sync_free(eng: Engine, prompts: list[torch.Tensor]) -> str:
    """"yes", or where the first host synchronisation happened."""
    if eng.device.type != "cuda":
        return "n/a (CPU)"
    eng.prefill(prompts)
    sync(eng.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.prefill(prompts)
    except RuntimeError as e:
        return f"no: {first_line(e)}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "yes"


def build(name: str, backend: str, engine_args: dict[str, Any], full_graph_tokens: int | None) -> Engine:
    """The engine of ``name`` (:func:`model_spec`) and ``backend``: "breakable+full" also holds the small buckets'
    whole-step graphs (``EngineConfig.full_graph_tokens``, the engine's default on CUDA); "breakable" attends in
    islands at every bucket, as bcg bench names them."""
    base, _, option = backend.partition("+")
    full = {} if base != "breakable" or (option == "full" and full_graph_tokens is None) else {
        "full_graph_tokens": full_graph_tokens if option == "full" else 0}  # (None: the engine's default)
    return Engine(model_spec(name), backend=base, progress=False, **engine_args, **full)


def prompts_for(vocab: int, lengths: list[int]) -> list[list[torch.Tensor]]:
    """One one-request prompt list per length, then one more at the first length (the launch steps'): the same
    tokens in the timed and in the profiled phase."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (n,), generator=gen)] for n in [*lengths, lengths[0]]]


def measure_timed(name: str, backend: str, lengths: list[int], runs: int, engine_args: dict[str, Any],
                  full_graph_tokens: int | None = None) -> dict[str, Any]:
    """One model's timed rows (wall, host, launch, span), its launch steps and whether it syncs; nothing profiled,
    so a later model's timings are not taken under CUPTI (:func:`measure_profiled` comes after every one)."""
    t0 = time.perf_counter()
    eng = build(name, backend, engine_args, full_graph_tokens)
    build_s = time.perf_counter() - t0
    tele = eng.telemetry
    *inputs, stage_prompts = prompts_for(eng.model.config.vocab_size, lengths)
    rows = []
    for n, prompts in zip(lengths, inputs):
        timed = prefill_times(eng, prompts, runs)
        bucket = eng.prefill(prompts).batches[0]
        rows.append({"tokens": n, "wall_ms": timed["wall_ms"], "host_ms": timed["host_ms"],
                     "launch_ms": timed["first_replay_ms"],
                     "span_ms": replay_span_ms(lambda p=prompts, e=eng: e.prefill(p), eng.device, runs),
                     "bucket": bucket.bucket, "graph_used": bucket.graph_used, "ran": bucket.reason})
    # Where the launch goes, step by step, at the shortest length (host_path.py's stage view): the host time before
    # the first replay differs between models on one machine, and only its steps say which one is slower.
    stages = stage_times(eng, stage_prompts, runs)
    result = {"model": name, "backend": backend, "kernels": engine_args.get("kernels") or "default",
              "attention_backend": getattr(tele, "attention_backend", "?"),  # (older engines do not say)
              "build_s": build_s, "capture_ms": tele.capture_ms, "num_layers": eng.model.config.num_layers,
              "compile_ms": tele.compile_ms, "graph_memory_mib": tele.graph_memory_bytes / 2**20,
              "buckets": tele.num_captured, "sync_free": sync_free(eng, stage_prompts), "rows": rows,
              "launch_stages": stages}
    del eng
    free_memory()
    return result


def measure_profiled(result: dict[str, Any], lengths: list[int], out: Path | None, timeline: bool,
                     engine_args: dict[str, Any], full_graph_tokens: int | None = None) -> dict[str, Any]:
    """Adds to :func:`measure_timed`'s ``result`` each row's device time, its gaps and kernel view, from the same
    engine built again. Once the profiler has run, CUPTI stays in the process and opens gaps of about 0.5-0.8 µs
    between a graph's kernels in every later replay (round 17: the first model of a run had none, the later ones
    0.1-0.25 ms at 64 tokens), so a run profiles only after every model's timed phase."""
    name, backend = result["model"], result["backend"]
    eng = build(name, backend, engine_args, full_graph_tokens)
    *inputs, prompts = prompts_for(eng.model.config.vocab_size, lengths)
    for row, p in zip(result["rows"], inputs):
        dev = gpu_kernel_ms(lambda p=p, e=eng: e.prefill(p), eng.device, warmup=1)
        span = row["span_ms"]
        row.update(device_ms=dev, wall_over_device=row["wall_ms"] / dev if dev else None,
                   gaps_ms=span - dev if span is not None and dev else None,
                   kernel_view=profile_kernels(lambda p=p, e=eng: e.prefill(p), eng.device, result["num_layers"]))
    if timeline and out is not None and eng.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        eng.prefill(prompts)
        sync(eng.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.prefill(prompts)
            sync(eng.device)
        path = out / f"timeline-{name.replace('/', '_')}-{backend}-{lengths[0]}.json"
        prof.export_chrome_trace(str(path))
        result["timeline"] = path.name
    del eng
    free_memory()
    return result


def measure(name: str, backend: str, lengths: list[int], runs: int, out: Path | None, timeline: bool,
            engine_args: dict[str, Any], full_graph_tokens: int | None = None) -> dict[str, Any]:
    """One model's timed phase, then its profiled one (a run of several models does every timed phase first)."""
    result = measure_timed(name, backend, lengths, runs, engine_args, full_graph_tokens)
    return measure_profiled(result, lengths, out, timeline, engine_args, full_graph_tokens)


def free_memory() -> None:
    """Gives a dropped engine's graphs and memory back before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_result(r: dict[str, Any], top: int) -> None:
    """The table of one model and backend, then its costliest ``top`` kernels at each length."""
    print(f"\n{r['model']} / {r['backend']} ({r['attention_backend']} attention): build {r['build_s']:.1f} s, "
          f"graph memory {r['graph_memory_mib']:.0f} MiB, {r['buckets']} buckets, sync-free: {r['sync_free']}")
    print(f"  {'tokens':>6} {'wall ms':>8} {'host ms':>8} {'launch ms':>9} {'after ms':>8} {'span ms':>8} "
          f"{'device ms':>9} {'gaps ms':>7} {'wall/device':>11} {'kernels':>7} {'eager':>6} {'k/layer':>7} "
          f"{'eager/layer':>11}")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for row in r["rows"]:
        ratio = "-" if row["wall_over_device"] is None else f"{row['wall_over_device']:.2f}"
        k = row["kernel_view"]
        launch = row.get("launch_ms")
        after = None if launch is None else row["wall_ms"] - launch
        print(f"  {row['tokens']:>6} {row['wall_ms']:>8.3f} {row['host_ms']:>8.3f} {ms(launch):>9} {ms(after):>8} "
              f"{ms(row.get('span_ms')):>8} {ms(row['device_ms']):>9} {ms(row.get('gaps_ms')):>7} {ratio:>11} "
              f"{k['kernels']:>7} {k['eager_kernels']:>6} {k['kernels_per_layer']:>7.1f} {k['eager_per_layer']:>11.1f}")
    stages = r.get("launch_stages") or []
    if stages:  # µs after prefill was called at which each step started, and what it took
        print(f"  {r['rows'][0]['tokens']} tokens, host steps (start+took µs): " + " | ".join(
            f"{st['stage'].strip()} {st['start_us']:.0f}+{st['us']:.0f}" for st in stages if st["stage"] != "prefill"))
    for row in r["rows"] if top > 0 else []:
        k = row["kernel_view"]
        eager = ", ".join(f"{e['op']} x{e['count']}" for e in k["eager_by_op"][:top])
        print(f"  {row['tokens']} tokens: {k['eager_kernels']} launched by the host: {eager}")
        print(f"  {row['tokens']} tokens: {k['kernels']} kernels, {k['kernel_ms']:.3f} ms summed; costliest:")
        for entry in k["by_name"][:top]:
            share = "-" if entry["share"] is None else f"{100 * entry['share']:.1f}%"
            name = entry["name"] if len(entry["name"]) <= 90 else entry["name"][:87] + "..."
            print(f"    {entry['count']:>5} x {entry['us']:>9.1f} us {share:>6}  {name}")
    sys.stdout.flush()


def profile(result: dict[str, Any], lengths: list[int], args: argparse.Namespace, engine_args: dict[str, Any]) -> None:
    """:func:`measure_profiled` of one timed ``result`` (none after an error), then its table."""
    if "error" in result:
        return
    try:
        measure_profiled(result, lengths, args.out, args.timeline, engine_args, args.full_graph_tokens)
    except Exception as e:
        result["error"] = f"profiling: {first_line(e)}"
        print(f"{result['model']} {result['backend']}: {result['error']}", flush=True)
        return
    result["profiled"] = "each" if args.profile_each else "after every timed run"
    print_result(result, args.top_kernels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--models", default="llama-dense,gptoss-moe,glm-dsa,llama-3.2-1b,qwen3-0.6b" if cuda
                   else "tiny-dense", help="comma list: presets, checkpoint folders, or " + ", ".join(SHAPES) +
                   "; a preset or shape may take +field=value overrides of its config (e.g. llama-dense+qk_norm=True)")
    p.add_argument("--backends", default="breakable+full" if cuda else "breakable",
                   help="comma list of backends: breakable attends in islands at every bucket, breakable+full adds "
                        "the small buckets' whole-step graphs (the engine's default on CUDA)")
    p.add_argument("--lengths", default="64,256,1024,2048" if cuda else "16,64")
    p.add_argument("--runs", type=int, default=20 if cuda else 3)
    p.add_argument("--kernels", default=None, help="fused or torch (default: the engine's)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--buckets", default=None, help="comma list of token buckets to capture (default: the engine's)")
    p.add_argument("--chunked-prefill-size", type=int, default=2048 if cuda else 256)
    p.add_argument("--full-graph-tokens", type=int, default=None,
                   help="breakable+full: the buckets up to this many tokens hold a whole-step graph (default: the "
                        "engine's, by the model's attention width, on CUDA)")
    p.add_argument("--timeline", action="store_true", help="write one prefill per model as a Chrome trace")
    p.add_argument("--top-kernels", type=int, default=12,
                   help="costliest kernel names printed per model and length (0: none; the JSON has them all)")
    p.add_argument("--profile-each", action="store_true",
                   help="profile each model right after its timed phase (the order before round 17, which timed "
                        "every model after the first under CUPTI): to measure what that order cost")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not cuda:
        print("device_bound: no CUDA, a smoke test on the CPU; these timings say nothing about launch overhead")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    engine_args = {"kernels": args.kernels, "chunked_prefill_size": args.chunked_prefill_size}
    if args.buckets:
        engine_args["buckets"] = [int(x) for x in args.buckets.split(",")]
    if args.attention_backend:  # (older engines have no such option)
        engine_args["attention_backend"] = args.attention_backend
    results = []
    # Every model's timed phase first, then every profiled phase: CUPTI, once loaded, stays (measure_profiled).
    for name in args.models.split(","):
        for backend in args.backends.split(","):
            try:
                results.append(measure_timed(name, backend, lengths, args.runs, engine_args, args.full_graph_tokens))
            except Exception as e:  # one model failing must not lose the others
                results.append({"model": name, "backend": backend, "error": first_line(e)})
                print(f"{name} {backend}: {first_line(e)}", flush=True)
            if args.profile_each:
                profile(results[-1], lengths, args, engine_args)
    if not args.profile_each:
        for result in results:
            profile(result, lengths, args, engine_args)
    summary = {"kind": "device_bound", "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if cuda else "cpu", "results": results}
    if args.out is not None:
        (args.out / "device_bound.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
