"""A server's life in miniature: thousands of prefills of random shape, transient faults injected, every answer
checked against eager, memory watched.

For each preset one graph engine and one eager engine are built; then ``--prefills`` prefills (spread over the
presets) of 1..``--max-prompts`` prompts of 1..``--max-len`` tokens each (log-uniform, so both single tokens and
chunked prompts occur) run through the graph engine and the eager engine, and their logits and greedy tokens are
compared. A graph pads a batch to its bucket, and rounding at the padded shape can differ from the unpadded eager
run's in the last bits; the DSA indexer's top-k can then pick another key on a near-tie. So an answer beyond the
tolerance is checked again against eager *at the same padded shapes* (a breakable engine in debug mode, which runs
the whole layer stack eagerly through the same runner path): if it matches that exactly, it is counted as a padding
flip, not a mismatch. With ``--failure-rate p`` each island call of a breakable replay (each replay for the other
backends) raises with probability ``p``: the runner must run that batch eagerly, keep the bucket unless it failed
``max_replay_failures`` times in a row, and answer exactly as before; a bucket disabled anyway is re-enabled (as an
operator would) and counted. After every prefill the KV pool must be whole again. Resident memory (RSS; on CUDA also
``torch.cuda.memory_allocated``) is sampled every ``--sample-every`` prefills after a warm-up, and its growth is
reported. Telemetry keeps its last 1,000 batch records per engine (its bounded history), so the records themselves do
not show up as growth.

Usage::

    python benchmarks/soak.py --prefills 10000 --failure-rate 0.01            # CPU, emulated graphs
    python benchmarks/soak.py --device cuda --presets tiny-dense --threads 2   # the CUDA tier

Prints a table per preset, the memory samples, and as its last line one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

try:
    import bcg  # noqa: F401
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bcg.bench.tables import table
from bcg.graph import EagerStep
from bcg.runtime import Engine


class Injector:
    """Makes island calls (breakable) or whole replays (other backends) raise with probability ``rate``."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self.rng, self.injected, self.lock = rate, random.Random(seed), 0, threading.Lock()

    def maybe_fail(self) -> None:
        with self.lock:
            fail = self.rate > 0 and self.rng.random() < self.rate
            self.injected += fail
        if fail:
            raise RuntimeError("transient island failure (injected by the soak)")

    def wrap_island(self, fn: Any) -> Any:
        def flaky(*args: Any, **kwargs: Any) -> Any:
            self.maybe_fail()
            return fn(*args, **kwargs)

        return flaky

    def install(self, eng: Engine) -> None:
        if self.rate <= 0:
            return
        if eng.config.backend == "breakable":
            for handle in eng.runner.handles.values():
                for step in handle.steps:
                    if isinstance(step, EagerStep):
                        step.fn = self.wrap_island(step.fn)
            return
        backend, real = eng.runner.backend, eng.runner.backend.replay

        def replay(handle: Any, n: int) -> None:
            real(handle, n)  # the graph ran and wrote its outputs, then something failed
            self.maybe_fail()

        backend.replay = replay


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:  # not Linux: peak RSS instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def matches(res: Any, ref: Any, dtype: torch.dtype, tolerance: float | None = None) -> bool:
    """Logits within the tolerance and the same greedy tokens (in half precision: where eager's choice is clear)."""
    half = dtype in (torch.bfloat16, torch.float16)
    tol = (tolerance if tolerance is not None else 2e-2 if half else 1e-4) * max(1.0, ref.logits.abs().max().item())
    if (res.logits - ref.logits).abs().max().item() > tol:
        return False
    if not half:
        return torch.equal(res.next_tokens, ref.next_tokens)
    top2 = ref.logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    return torch.equal(res.next_tokens[clear], ref.next_tokens[clear])


def random_prefill(rng: random.Random, vocab: int, max_prompts: int, max_len: int) -> list[list[int]]:
    lengths = [max(1, int(math.exp(rng.uniform(0, math.log(max_len))))) for _ in range(rng.randint(1, max_prompts))]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefills", type=int, default=10_000)
    p.add_argument("--presets", default="tiny-dense,tiny-moe,tiny-dsa")
    p.add_argument("--backend", default="breakable", help="breakable, full or tc_piecewise (tc_compiler eager)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunked-prefill-size", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=6)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--failure-rate", type=float, default=0.01,
                   help="probability each island call of a breakable replay (each replay for the other backends) "
                   "raises")
    p.add_argument("--threads", type=int, default=1, help="threads sharing each engine")
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--warmup", type=int, default=300, help="prefills before the first memory sample")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |logits - eager| accepted, relative to max(1, max |eager|) (default 1e-4 in fp32, "
                   "2e-2 in bf16/fp16, whose tokens are compared only where eager's top-2 margin clears it)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    extra = {"tc_compiler": "traced"} if args.backend == "tc_piecewise" else {}
    common = dict(device=args.device, chunked_prefill_size=args.chunked_prefill_size, progress=False, seed=0)
    engines, refs, injectors = {}, {}, {}
    t_build = time.perf_counter()
    for i, name in enumerate(presets):
        engines[name] = Engine(name, backend=args.backend, max_requests=args.max_prompts, **common, **extra)
        refs[name] = Engine(name, backend="eager", **common)
        for e in (engines[name], refs[name]):
            e.telemetry.max_batches = 1000
        injectors[name] = Injector(args.failure_rate, args.seed + 1000 + i)
        injectors[name].install(engines[name])
    build_s = time.perf_counter() - t_build

    stats = {name: dict(prefills=0, prompts=0, tokens=0, batches=0, graph_batches=0, failed_replays=0,
                        reenabled=0, mismatches=0, padding_flips=0, max_diff=0.0, pool_leaks=0) for name in presets}
    # Eager at the graph's padded shapes (built now, so its memory is not counted as growth), asked on a mismatch.
    padded_refs = {name: Engine(name, backend="breakable", debug=True, **common) for name in presets}
    samples: list[dict[str, Any]] = []
    lock, done = threading.Lock(), [0]

    def sample(count: int) -> None:
        row = {"prefills": count, "rss_mib": rss_bytes() / 2**20}
        if device.type == "cuda":
            row["cuda_allocated_mib"] = torch.cuda.memory_allocated(device) / 2**20
        samples.append(row)

    def worker(t: int, count: int) -> None:
        rng = random.Random(args.seed * 7919 + t)
        for k in range(count):
            name = presets[(k * args.threads + t) % len(presets)]
            eng, ref = engines[name], refs[name]
            prompts = random_prefill(rng, eng.model.config.vocab_size, args.max_prompts, args.max_len)
            res, expected = eng.prefill(prompts), ref.prefill(prompts)
            diff = (res.logits - expected.logits).abs().max().item()
            same = matches(res, expected, eng.dtype, args.tolerance)
            flip = False
            if not same and all(b.graph_used for b in res.batches):  # is it the padded shapes' rounding?
                with lock:
                    padded = padded_refs[name].prefill(prompts)
                flip = torch.equal(padded.logits, res.logits)
            with lock:
                s = stats[name]
                s["prefills"] += 1
                s["prompts"] += len(prompts)
                s["tokens"] += sum(map(len, prompts))
                s["batches"] += len(res.batches)
                s["graph_batches"] += sum(b.graph_used for b in res.batches)
                s["failed_replays"] += sum(b.reason == "replay_failed" for b in res.batches)
                s["max_diff"] = max(s["max_diff"], diff)
                s["padding_flips"] += flip
                s["mismatches"] += not (same or flip)
                if args.threads == 1 and eng.kv_pool.num_free != eng.kv_pool.num_slots:
                    s["pool_leaks"] += 1
                for n, record in eng.telemetry.buckets.items():
                    if record.disabled_reason and record.disabled_reason.startswith("replay failed"):
                        eng.enable_bucket(n)  # what an operator would do after a transient fault
                        s["reenabled"] += 1
                done[0] += 1
                if done[0] >= args.warmup and (done[0] - args.warmup) % args.sample_every == 0:
                    sample(done[0])

    t0 = time.perf_counter()
    shares = [args.prefills // args.threads + (t < args.prefills % args.threads) for t in range(args.threads)]
    threads = [threading.Thread(target=worker, args=(t, n)) for t, n in enumerate(shares)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if not samples or samples[-1]["prefills"] != done[0]:
        sample(done[0])
    for name in presets:
        stats[name]["pool_leaks"] += engines[name].kv_pool.num_free != engines[name].kv_pool.num_slots
        stats[name]["injected"] = injectors[name].injected
        rec = engines[name].telemetry.buckets
        stats[name]["replay_failures_recorded"] = sum(r.num_replay_failures for r in rec.values())

    mem_key = "cuda_allocated_mib" if device.type == "cuda" else "rss_mib"
    first, last = samples[0], samples[-1]
    growth = {k: last[k] - first[k] for k in first if k != "prefills"}
    per_1k = {k: v / max(last["prefills"] - first["prefills"], 1) * 1000 for k, v in growth.items()}
    print(table(["preset", "prefills", "prompts", "tokens", "batches", "graph %", "injected", "failed replays",
                 "re-enabled", "mismatches", "padding flips", "max |diff|", "pool leaks"],
                [[n, s["prefills"], s["prompts"], s["tokens"], s["batches"],
                  f"{100 * s['graph_batches'] / max(s['batches'], 1):.1f}", s["injected"], s["failed_replays"],
                  s["reenabled"], s["mismatches"], s["padding_flips"], f"{s['max_diff']:.2e}", s["pool_leaks"]]
                 for n, s in stats.items()], title=f"Soak: {args.backend} vs eager on {args.device}, "
                f"{args.threads} thread(s), failure rate {args.failure_rate}"))
    print()
    print(table(["after prefills", *[k for k in first if k != "prefills"]],
                [[r["prefills"], *[f"{r[k]:.1f}" for k in r if k != "prefills"]] for r in samples],
                title="Memory (MiB)"))
    ok = all(s["mismatches"] == 0 and s["pool_leaks"] == 0 for s in stats.values())
    print(f"\n{done[0]} prefills in {elapsed:.1f} s ({done[0] / elapsed:.1f}/s; build {build_s:.1f} s); "
          f"{mem_key} grew {growth[mem_key]:+.1f} MiB over the sampled window; "
          f"{'every answer equal to eager' if ok else 'MISMATCHES OR LEAKS'}")
    result = {"kind": "soak", "config": vars(args), "ok": ok, "elapsed_s": elapsed, "build_s": build_s,
              "prefills_per_s": done[0] / elapsed, "stats": stats, "memory": samples, "growth_mib": growth,
              "growth_mib_per_1k_prefills": per_1k}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
