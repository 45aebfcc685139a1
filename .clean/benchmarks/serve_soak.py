"""A server's life under load in miniature: thousands of requests submitted from many threads through
``Engine.submit``, sharing random prefixes, with transient island failures and whole failing forwards injected, every
answer checked against an eager prefill of that prompt alone, memory and KV slots watched.

Per preset one graph engine (prefix cache on, a small KV pool so that cached prefixes are evicted all the time) and
one eager reference engine (cache off) are built. ``--threads`` client threads then submit ``--requests`` requests in
all, each keeping up to ``--outstanding`` in flight: most open with one of ``--prefixes`` shared system prompts (cut
at a random token, so hits end anywhere), followed by their own tokens; some repeat an earlier prompt exactly (all
of it cached: its last token runs again); a few clients call ``prefill()`` on the same engine meanwhile. With
``--failure-rate p`` each island call of a breakable replay raises with probability p (the runner must rerun that
forward eagerly and answer exactly as before); with ``--forward-failure-rate q`` a whole forward raises with
probability q (exactly the requests of that forward must fail, with that error, and no other). Every answer must equal
the eager engine's prefill of its prompt (logits within the tolerance, the same greedy token). Resident memory is
sampled after a warm-up; once every request ended no KV slot may be held by anything but the prefix cache, and none
once the cache is cleared. Every bucket must have captured (a capture that fails at build is a bug; its batches would
quietly run in another bucket).

Usage::

    python benchmarks/serve_soak.py                      # 5,000 requests from 8 threads (CPU, emulated graphs)
    python benchmarks/serve_soak.py --quick              # the CI smoke run: a few hundred requests, seconds
    python benchmarks/serve_soak.py --device cuda --presets tiny-dense --dtype bfloat16   # the CUDA tier
    python benchmarks/serve_soak.py --quick --attention-backend varlen --dtype bfloat16  # FlashAttention's reference

Prints a table per preset and the memory samples, and as its last line one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

# The checkout this script sits in comes first, before any installed bcg: its tests run it as a subprocess and must
# soak this checkout's code.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import Injector, matches, rss_bytes  # the prefill soak's fault injector and checks

from bcg.bench.tables import table
from bcg.runtime import Engine


class ForwardFailure(RuntimeError):
    """A whole forward failed (injected by the soak)."""


class ForwardInjector:
    """Makes ``eng.runner.forward`` raise with probability ``rate``; counts the requests of the failed forwards."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate, self.rng, self.lock = rate, random.Random(seed), threading.Lock()
        self.forwards = self.requests = 0

    def install(self, eng: Engine) -> None:
        if self.rate <= 0:
            return
        real, runner = eng.runner.forward, eng.runner

        def forward(batch: Any) -> Any:
            with self.lock:
                fail = self.rng.random() < self.rate and threading.current_thread().name == "bcg-scheduler"
                if fail:
                    self.forwards += 1
                    self.requests += batch.num_requests
            if fail:
                raise ForwardFailure("forward failed (injected by the soak)")
            return real(batch)

        runner.forward = forward


def make_prompt(rng: random.Random, prefixes: list[list[int]], history: list[list[int]], vocab: int,
                max_len: int, duplicate_rate: float) -> list[int]:
    if history and rng.random() < duplicate_rate:
        return list(history[rng.randrange(len(history))])
    own = [rng.randrange(vocab) for _ in range(max(1, int(math.exp(rng.uniform(0, math.log(max_len))))))]
    if rng.random() < 0.85:
        head = prefixes[rng.randrange(len(prefixes))]
        return head[: rng.randint(len(head) // 2, len(head))] + own
    return own


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--threads", type=int, default=8, help="client threads submitting")
    p.add_argument("--outstanding", type=int, default=8, help="requests each client keeps in flight")
    p.add_argument("--presets", default="tiny-dense,tiny-moe")
    p.add_argument("--backend", default="breakable", help="breakable, full or tc_piecewise (tc_compiler traced)")
    p.add_argument("--attention-backend", default=None,
                   help="attention backend of both engines (sdpa, varlen...; default: the device's); varlen on a CPU "
                   "runs FlashAttention's reference and needs --dtype bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=640, help="a small pool: the cache evicts under pressure")
    p.add_argument("--prefixes", type=int, default=6, help="shared system prompts")
    p.add_argument("--max-prefix", type=int, default=150)
    p.add_argument("--max-len", type=int, default=90, help="a request's own tokens, log-uniform in 1..max-len")
    p.add_argument("--duplicate-rate", type=float, default=0.05, help="share of exact repeats of an earlier prompt")
    p.add_argument("--prefill-rate", type=float, default=0.02, help="share of client calls that are prefill()")
    p.add_argument("--failure-rate", type=float, default=0.01, help="probability an island call of a replay raises")
    p.add_argument("--forward-failure-rate", type=float, default=0.003,
                   help="probability a whole forward raises (its requests must fail, no other)")
    p.add_argument("--sample-every", type=int, default=500)
    p.add_argument("--warmup", type=int, default=500, help="requests before the first memory sample")
    p.add_argument("--max-growth-mib", type=float, default=64.0, help="resident growth over the samples counted ok")
    p.add_argument("--tolerance", type=float, default=None, help="as in soak.py (default 1e-4 fp32, 2e-2 half)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run for CI: 240 requests from 4 threads, tiny-dense, "
                   "more faults")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.threads, args.presets, args.warmup, args.sample_every = 240, 4, "tiny-dense", 60, 60
        args.failure_rate, args.forward_failure_rate, args.max_growth_mib = 0.05, 0.03, 256.0
    return args


def soak_preset(args: argparse.Namespace, name: str, count: int, index: int, samples: list[dict]) -> dict[str, Any]:
    common = dict(device=args.device, dtype=args.dtype, chunked_prefill_size=args.chunked_prefill_size,
                  progress=False, seed=0)
    extra = {"tc_compiler": "traced"} if args.backend == "tc_piecewise" else {}
    eng = Engine(name, backend=args.backend, kv_tokens=args.kv_tokens, prefix_cache=True,
                 attention_backend=args.attention_backend, **common, **extra)
    ref = Engine(name, backend="eager", prefix_cache=False, attention_backend=args.attention_backend, **common)
    for e in (eng, ref):
        e.telemetry.max_batches = 1000
    # Buckets disabled before any traffic failed their capture: a bug, not a fault the soak injected.
    not_captured = {n: r.disabled_reason for n, r in eng.telemetry.buckets.items() if r.disabled_reason}
    islands = Injector(args.failure_rate, args.seed + 1000 + index)
    islands.install(eng)
    forwards = ForwardInjector(args.forward_failure_rate, args.seed + 2000 + index)
    forwards.install(eng)
    vocab = eng.model.config.vocab_size
    rng0 = random.Random(args.seed * 31 + index)
    prefixes = [[rng0.randrange(vocab) for _ in range(rng0.randint(8, args.max_prefix))] for _ in range(args.prefixes)]
    s = dict(requests=0, answered=0, failed=0, failed_wrong_error=0, prefills=0, tokens=0, cached_tokens=0,
             duplicates=0, batches=0, graph_batches=0, failed_replays=0, reenabled=0, mismatches=0, max_diff=0.0)
    lock, done = threading.Lock(), [0]
    batch_ids: set[int] = set()

    def check(prompt: list[int], fut: Any) -> None:
        exc = fut.exception()
        expected = ref.prefill([prompt])
        with lock:
            s["requests"] += 1
            done[0] += 1
            if exc is not None:
                s["failed"] += 1
                s["failed_wrong_error"] += not isinstance(exc, ForwardFailure)
            else:
                res = fut.result()
                s["answered"] += 1
                s["tokens"] += res.num_tokens
                s["cached_tokens"] += res.cached_tokens
                s["duplicates"] += res.cached_tokens == res.num_tokens - 1
                s["max_diff"] = max(s["max_diff"], (res.logits - expected.logits).abs().max().item())
                s["mismatches"] += not matches(res, expected, eng.dtype, args.tolerance)
                for b in res.batches:
                    if id(b) not in batch_ids:
                        batch_ids.add(id(b))
                        s["batches"] += 1
                        s["graph_batches"] += b.graph_used
                        s["failed_replays"] += b.reason == "replay_failed"
            for n, record in eng.telemetry.buckets.items():
                if record.disabled_reason and record.disabled_reason.startswith("replay failed"):
                    eng.enable_bucket(n)  # what an operator would do after a transient fault
                    s["reenabled"] += 1
            if len(batch_ids) > 20_000:
                batch_ids.clear()
            total = done[0]
            if total >= args.warmup and (total - args.warmup) % args.sample_every == 0:
                samples.append({"preset": name, "requests": total, "rss_mib": rss_bytes() / 2**20}
                               | ({"cuda_allocated_mib": torch.cuda.memory_allocated() / 2**20}
                                  if args.device.startswith("cuda") else {}))

    def client(t: int, share: int) -> None:
        rng = random.Random(args.seed * 7919 + 97 * index + t)
        history: list[list[int]] = []
        inflight: deque = deque()
        for _ in range(share):
            prompt = make_prompt(rng, prefixes, history, vocab, args.max_len, args.duplicate_rate)
            history = (history + [prompt])[-32:]
            if rng.random() < args.prefill_rate:  # a prefill() beside the served requests: same engine, same pool
                res, expected = eng.prefill([prompt]), ref.prefill([prompt])
                with lock:
                    s["prefills"] += 1
                    s["mismatches"] += not matches(res, expected, eng.dtype, args.tolerance)
                continue
            inflight.append((prompt, eng.submit(prompt)))
            if len(inflight) >= args.outstanding:
                check(*inflight.popleft())
        while inflight:
            check(*inflight.popleft())

    client_errors: list[str] = []

    def guarded_client(t: int, share: int) -> None:
        # A client that raises (a prefill() or the reference failing, not a served request) must fail the soak,
        # not end its thread quietly with its requests unchecked.
        try:
            client(t, share)
        except Exception as e:  # every error is reported, with its type
            with lock:
                client_errors.append(f"client {t}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    shares = [count // args.threads + (t < count % args.threads) for t in range(args.threads)]
    threads = [threading.Thread(target=guarded_client, args=(t, n)) for t, n in enumerate(shares)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s["elapsed_s"] = time.perf_counter() - t0
    s["attention_backend"] = eng.telemetry.attention_backend
    s["buckets_not_captured"] = not_captured
    s["client_errors"] = client_errors
    s["unchecked"] = count - s["requests"] - s["prefills"]  # every request and prefill() checked against eager
    pool, cache = eng.kv_pool, eng.prefix_cache
    # Every request ended: the cache holds what is not free, and nobody locks it.
    s["slots_held_outside_cache"] = pool.num_slots - pool.num_free - cache.num_cached_tokens
    s["locked_after"] = cache.num_locked_tokens
    s["evicted_tokens"] = cache.num_evicted_tokens
    s["injected_island_failures"] = islands.injected
    s["injected_forward_failures"] = forwards.forwards
    s["requests_in_failed_forwards"] = forwards.requests
    eng.close()
    s["pool_leak"] = pool.num_slots - pool.num_free
    return s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    samples: list[dict[str, Any]] = []
    stats = {}
    t0 = time.perf_counter()
    counts = [args.requests // len(presets) + (i < args.requests % len(presets)) for i in range(len(presets))]
    for i, (name, count) in enumerate(zip(presets, counts)):
        offset = sum(counts[:i])
        before = len(samples)
        stats[name] = soak_preset(args, name, count, i, samples)
        for row in samples[before:]:
            row["requests"] += offset
    elapsed = time.perf_counter() - t0
    ok = True
    for s in stats.values():
        s["ok"] = (s["mismatches"] == 0 and s["failed_wrong_error"] == 0 and s["pool_leak"] == 0
                   and s["slots_held_outside_cache"] == 0 and s["locked_after"] == 0 and not s["buckets_not_captured"]
                   and not s["client_errors"] and s["unchecked"] == 0
                   and s["failed"] == s["requests_in_failed_forwards"] and s["answered"] + s["failed"] == s["requests"])
        ok &= s["ok"]
    for n, s in stats.items():
        for bucket, reason in s["buckets_not_captured"].items():
            print(f"{n}: bucket {bucket} was not captured: {reason}")
        for error in s["client_errors"]:
            print(f"{n}: {error}")
    print(table(["preset", "requests", "answered", "failed", "in failed fwds", "prefill()", "cached %", "repeats",
                 "batches", "graph %", "island faults", "failed replays", "re-enabled", "evicted", "mismatches",
                 "max |diff|", "leaked slots", "ok"],
                [[n, s["requests"], s["answered"], s["failed"], s["requests_in_failed_forwards"], s["prefills"],
                  f"{100 * s['cached_tokens'] / max(s['tokens'], 1):.1f}", s["duplicates"], s["batches"],
                  f"{100 * s['graph_batches'] / max(s['batches'], 1):.1f}", s["injected_island_failures"],
                  s["failed_replays"], s["reenabled"], s["evicted_tokens"], s["mismatches"], f"{s['max_diff']:.2e}",
                  s["pool_leak"] + s["slots_held_outside_cache"], s["ok"]] for n, s in stats.items()],
                title=f"Serving soak: {args.backend} against eager on {args.device}, "
                f"{'/'.join(sorted({s['attention_backend'] for s in stats.values()}))} attention, "
                f"{args.threads} client threads, "
                f"island failure rate {args.failure_rate}, forward failure rate {args.forward_failure_rate}"))
    mem_key = "cuda_allocated_mib" if args.device.startswith("cuda") else "rss_mib"
    # Per preset (each builds its own engines): from its first sample after the warm-up to its last.
    per_preset = {n: [r[mem_key] for r in samples if r["preset"] == n] for n in presets}
    growth = max((v[-1] - v[0] for v in per_preset.values() if len(v) >= 2), default=0.0)
    if samples:
        print()
        print(table(["preset", "after requests", mem_key], [[r["preset"], r["requests"], f"{r[mem_key]:.1f}"]
                                                             for r in samples], title="Memory (MiB)"))
    flat = growth <= args.max_growth_mib
    ok &= flat
    print(f"\n{args.requests} requests in {elapsed:.1f} s; {mem_key} grew at most {growth:+.1f} MiB over a preset's "
          f"samples (at most {args.max_growth_mib:g} counted flat); "
          f"{'every answer equal to eager, only failed forwards failed, no slot leaked' if ok else 'FAILED'}")
    result = {"kind": "serve_soak", "config": vars(args), "ok": ok, "elapsed_s": elapsed, "stats": stats,
              "memory": samples, "growth_mib": growth, "memory_flat": flat}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
