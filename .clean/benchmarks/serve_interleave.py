"""Random interleavings of everything a server calls on one engine, checked for hangs and for wrong answers.

Rounds of ``--round-s`` seconds until ``--duration`` is spent. Each round builds a graph engine (breakable, prefix
cache on, a small KV pool, ``--inflight`` forwards in flight) and ``--threads`` caller threads that pick at random:
``submit`` (prompts sharing a few prefixes, cut anywhere), ``prefill`` of one to three prompts, ``recapture`` and
``enable_bucket`` of a random bucket, ``cancel`` of a pending future. Done-callbacks of the submitted futures do the
same with probability ``--callback-rate`` (the engine must let a callback call anything). The round ends with
``close()``, called from the main thread, a caller thread or a done-callback at random, while work is in flight.

Checks: every answer (a future's, a prefill's) equals a lone eager prefill of that prompt (fp32, 1e-5, the same greedy
token); every future ends (a result, EngineClosedError after the close, or cancelled); every thread ends; no KV slot
is held once the engine closed. A wait longer than ``--hang-s`` is a hang: the script dumps every thread's stack,
prints its JSON line with ``"hangs": 1`` and exits 1 (a hung thread cannot be stopped).

Usage::

    python benchmarks/serve_interleave.py --duration 300      # minutes of interleavings (CPU, emulated graphs)
    python benchmarks/serve_interleave.py --quick             # CI: a few seconds

Prints one line per round and, last, one JSON object with every count.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's bcg, even beside an installed one

from bcg.runtime import Engine, EngineClosedError

TOL = 1e-5
BUCKETS = [8, 16, 32]
COMMON = dict(device="cpu", buckets=BUCKETS, chunked_prefill_size=32, seed=0, progress=False)


class Round:
    """One engine's life: callers and callbacks acting at random, then a close from somewhere."""

    def __init__(self, args: argparse.Namespace, seed: int, reference: Engine, counts: Counter) -> None:
        self.args, self.reference, self.counts = args, reference, counts
        self.rng = random.Random(seed)
        self.eng = Engine("tiny-dense", backend="breakable", kv_tokens=args.kv_tokens,
                          max_inflight_batches=args.inflight, **COMMON)
        g = torch.Generator().manual_seed(seed)
        self.prefixes = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (24, 40, 60)]
        self.lock = threading.Lock()
        self.futures: list[tuple[list[int], Any]] = []
        self.answers: list[tuple[list[int], Any]] = []  # (prompt, logits row, next token) to check
        self.errors: list[str] = []
        self.closing = threading.Event()
        self.close_from_callback = threading.Event()
        self.callback_budget = args.callback_actions

    # ---------------------------------------------------------------- actions
    def prompt(self, rng: random.Random) -> list[int]:
        head = rng.choice(self.prefixes)
        cut = rng.randint(0, len(head))
        return head[:cut] + [rng.randrange(256) for _ in range(rng.randint(1, 30))]

    def act(self, rng: random.Random, where: str) -> None:
        r = rng.random()
        try:
            if r < 0.55:
                self.submit(self.prompt(rng))
            elif r < 0.70:
                prompts = [self.prompt(rng) for _ in range(rng.randint(1, 1 if where == "callback" else 3))]
                res = self.eng.prefill(prompts)
                with self.lock:
                    self.answers += [(p, res.logits[i : i + 1], res.next_tokens[i]) for i, p in enumerate(prompts)]
                self.counts["prefills"] += 1
            elif r < 0.82:
                with self.lock:
                    pending = [f for _, f in self.futures if not f.done()]
                if pending and rng.choice(pending).cancel():
                    self.counts["cancelled_by_caller"] += 1
            elif r < 0.86:
                record = self.eng.recapture(rng.choice(BUCKETS))
                self.counts["recaptures"] += 1
                if record.disabled_reason is not None:  # the pool had no room for the dummy batch: enable later
                    self.counts["recaptures_refused"] += 1
            else:
                try:
                    self.eng.enable_bucket(rng.choice(BUCKETS))
                    self.counts["enables"] += 1
                except ValueError:  # its capture failed: only a recapture helps
                    self.counts["enables_refused"] += 1
            self.counts[f"actions_from_{where}"] += 1
        except EngineClosedError:
            if not self.closing.is_set():
                self.errors.append(f"EngineClosedError before close() from {where}")
        except ValueError as e:
            if "at once but the pool holds" in str(e):  # prompts that together exceed the pool: a fair refusal
                self.counts["prefills_refused"] += 1
            else:
                self.errors.append(f"{where}: ValueError: {e}")
        except Exception as e:
            self.errors.append(f"{where}: {type(e).__name__}: {e}")

    def submit(self, prompt: list[int]) -> None:
        future = self.eng.submit(prompt)
        with self.lock:
            self.futures.append((prompt, future))
        self.counts["submitted"] += 1
        future.add_done_callback(self.on_done)

    def on_done(self, future: Any) -> None:
        if self.close_from_callback.is_set():
            self.close_from_callback.clear()
            self.counts["closed_from_callback"] += 1
            self.eng.close()
            return
        with self.lock:
            go = self.callback_budget > 0 and self.rng.random() < self.args.callback_rate
            self.callback_budget -= go
            rng = random.Random(self.rng.random())
        if go:
            self.act(rng, "callback")

    def caller(self, index: int) -> None:
        rng = random.Random(self.rng.random() + index)
        while not self.closing.is_set():
            self.act(rng, "caller")
            time.sleep(rng.random() * 0.01)
            if index == 0 and self.closer == "caller" and time.monotonic() > self.close_at:
                self.closing.set()
                self.eng.close()

    # ---------------------------------------------------------------- the round
    def run(self) -> None:
        args = self.args
        self.closer = self.rng.choice(["main", "caller", "callback"])
        self.close_at = time.monotonic() + args.round_s
        callers = [threading.Thread(target=self.caller, args=(i,), daemon=True) for i in range(args.threads)]
        for t in callers:
            t.start()
        while time.monotonic() < self.close_at:
            time.sleep(0.01)
        if self.closer == "main":
            self.closing.set()
            self.eng.close()
        elif self.closer == "callback":
            self.closing.set()
            self.close_from_callback.set()
            self.submit([1, 2, 3])  # at least one more future to carry the close
        self.counts[f"closed_by_{self.closer}"] += 1
        end = time.monotonic() + args.hang_s
        for t in callers:
            t.join(max(0.0, end - time.monotonic()))
            if t.is_alive():
                hang("a caller thread")
        while not self.eng._closed:  # the callback's close, or the caller's
            if time.monotonic() > end:
                hang("close()")
            time.sleep(0.01)
        self.eng.close()  # joins the engine's threads (a second close is a no-op besides)
        for prompt, future in self.futures:
            try:
                res = future.result(timeout=max(0.01, end - time.monotonic()))
            except TimeoutError:
                hang("a future")
            except EngineClosedError:
                self.counts["closed_before_answer"] += 1
                continue
            except Exception as e:
                if future.cancelled():
                    self.counts["cancelled"] += 1
                else:
                    self.errors.append(f"a future failed: {type(e).__name__}: {e}")
                continue
            self.answers.append((prompt, res.logits, res.next_tokens[0]))
            self.counts["answered"] += 1
        self.check()

    def check(self) -> None:
        eng = self.eng
        if eng.prefix_cache is not None and eng.prefix_cache.num_cached_tokens:
            self.errors.append(f"{eng.prefix_cache.num_cached_tokens} tokens cached after close()")
        if eng.kv_pool.num_free != eng.kv_pool.num_slots:
            self.errors.append(f"{eng.kv_pool.num_slots - eng.kv_pool.num_free} KV slots held after close()")
        gate = eng._gate
        if gate.num_active or gate.num_holders or gate.num_recaptures:
            self.errors.append(f"gate unbalanced: {gate.num_active} active, {gate.num_holders} holders, "
                               f"{gate.num_recaptures} recaptures")
        for prompt, logits, token in self.answers:
            ref = self.reference.prefill([prompt])
            diff = (logits.float() - ref.logits).abs().max().item()
            if diff > TOL or int(token) != int(ref.next_tokens[0]):
                self.counts["mismatches"] += 1
                self.errors.append(f"answer of a {len(prompt)}-token prompt differs from eager by {diff:.2e}")


def hang(what: str) -> None:
    """A wait past --hang-s: dump every stack, report, exit (hung threads cannot be stopped)."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(json.dumps({"ok": False, "hangs": 1, "hung": what}), flush=True)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of rounds in all")
    p.add_argument("--round-s", type=float, default=3.0, help="seconds before each round's close()")
    p.add_argument("--threads", type=int, default=4, help="caller threads per round")
    p.add_argument("--inflight", type=int, default=0, help="max_inflight_batches (0: 1 to 3 at random per round)")
    p.add_argument("--kv-tokens", type=int, default=160, help="KV pool of the graph engine (small: slots contend)")
    p.add_argument("--callback-rate", type=float, default=0.2, help="chance a done-callback acts on the engine")
    p.add_argument("--callback-actions", type=int, default=40, help="most actions from callbacks per round")
    p.add_argument("--hang-s", type=float, default=60.0, help="a wait longer than this is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI: two short rounds")
    args = p.parse_args(argv)
    min_rounds = 1
    if args.quick:  # two rounds however long a build takes on a busy machine (a time budget made CI flaky)
        args.duration, args.round_s, min_rounds = 0.0, 1.5, 2
    torch.set_num_threads(1)  # many threads on a few cores: intra-op threads would only contend
    reference = Engine("tiny-dense", backend="eager", prefix_cache=False, kv_tokens=512, **COMMON)
    counts: Counter = Counter()
    errors: list[str] = []
    start, rounds = time.monotonic(), 0
    while rounds < min_rounds or time.monotonic() - start < args.duration:
        seed = args.seed * 1000 + rounds
        rng = random.Random(seed)
        inflight = args.inflight or rng.randint(1, 3)
        round_ = Round(argparse.Namespace(**{**vars(args), "inflight": inflight}), seed, reference, counts)
        round_.run()
        errors += round_.errors
        rounds += 1
        print(f"round {rounds}: inflight {inflight}, closed by {round_.closer}, {len(round_.futures)} submitted, "
              f"{len(round_.errors)} errors", flush=True)
    result = {"ok": not errors, "hangs": 0, "rounds": rounds, "errors": errors[:20], **dict(counts)}
    print(json.dumps(result), flush=True)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
