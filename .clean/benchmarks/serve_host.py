"""Where the serving scheduler's host time goes per forward, with the model taken out.

The runner's forward is replaced by a stand-in that returns logits of the right shape at once, so what is left is
the scheduler's and the completer's Python: planning (admission, prefix-cache lookups, packing the batch), the
launch (the stand-in, copying the finished rows and their argmax), the bookkeeping after a launch (prefix inserts,
locks, freeing slots) and the completer resolving futures. ``--queue`` requests (lognormal lengths, median
``--median``) are queued before the scheduler starts, so every forward is full (saturation); each phase is timed per
forward and divided by the requests it handled. Run at several queue lengths it shows whether planning cost depends
on how many wait; ``--clients`` threads submitting meanwhile give the latency of a ``submit()`` call under load.

Usage::

    python benchmarks/serve_host.py                        # queues of 200, 1000 and 4000 requests
    python benchmarks/serve_host.py --queue 2000 --clients 2 --chunked-prefill-size 8192

Prints a table and, last, one JSON object. CPU is enough: nothing here runs the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's bcg, even beside an installed one

from bcg.bench.tables import table
from bcg.runtime import Engine
from bcg.runtime.runner.runner import ForwardOutput
from bcg.runtime.runner.telemetry import BatchRecord


def timed(times: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name].append(time.perf_counter() - t0)

    return wrapper


def run(args: argparse.Namespace, queue: int) -> dict[str, Any]:
    eng = Engine("tiny-dense", backend="eager", device="cpu", seed=0, progress=False,
                 chunked_prefill_size=args.chunked_prefill_size, buckets=[args.chunked_prefill_size],
                 kv_tokens=args.kv_tokens, max_inflight_batches=2)
    vocab = eng.model.config.vocab_size
    logits = torch.randn(4096, vocab)

    def stand_in(batch: Any) -> ForwardOutput:  # a forward that costs nothing: only the host's Python is left
        return ForwardOutput(logits[: batch.num_logit_rows], BatchRecord(batch.num_tokens, batch.num_requests, None,
                                                                         False, "stand_in"))

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(args.median), 0.6, queue + 1), 8, args.max_len).astype(int)
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
    eng.submit(prompts[0]).result()  # starts the threads
    eng.runner.forward = stand_in
    server = eng._server
    times: dict[str, list[float]] = defaultdict(list)
    batcher = server.batcher
    batcher.plan = timed(times, "plan", batcher.plan)
    batcher.launched = timed(times, "after_launch", batcher.launched)
    server._launch = timed(times, "launch", server._launch)
    server._completer._resolve = timed(times, "resolve", server._completer._resolve)
    submit_ms: list[float] = []
    with server._cond:  # (reentrant) the scheduler takes nothing from the inbox until the whole queue is in it
        futures = [eng.submit(p) for p in prompts[1:]]
    stop = threading.Event()

    def client() -> None:
        r = np.random.default_rng(1)
        while not stop.is_set():
            p = r.integers(0, vocab, int(r.integers(50, 300))).tolist()
            t0 = time.perf_counter()
            futures.append(eng.submit(p))
            submit_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.0005)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    t0 = time.perf_counter()
    for c in clients:
        c.start()
    for f in futures[:queue]:
        f.result(timeout=600)
    elapsed = time.perf_counter() - t0
    stop.set()
    for c in clients:
        c.join()
    for f in list(futures):
        f.result(timeout=600)
    eng.close()
    forwards = len(times["launch"])
    requests = sum(len(f.result().batches) for f in futures)  # request-forwards: a chunked request counts per chunk
    row = {"queue": queue, "forwards": forwards, "requests_per_forward": round(requests / max(forwards, 1), 1),
           "requests_per_s": round(queue / elapsed)}
    for name in ("plan", "launch", "after_launch", "resolve"):
        total = sum(times[name])
        row[f"{name}_us_per_forward"] = round(total / max(len(times[name]), 1) * 1e6, 1)
        row[f"{name}_us_per_request"] = round(total / max(requests, 1) * 1e6, 2)
    row["launch_minus_after_us_per_forward"] = round(
        row["launch_us_per_forward"] - row["after_launch_us_per_forward"], 1)
    if submit_ms:
        s = sorted(submit_ms)
        row["submit_ms_p50"] = round(statistics.median(s), 3)
        row["submit_ms_p99"] = round(s[int(0.99 * (len(s) - 1))], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", type=int, nargs="+", default=[200, 1000, 4000], help="requests queued at once")
    p.add_argument("--median", type=float, default=180.0, help="median prompt length (lognormal)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--kv-tokens", type=int, default=65536)
    p.add_argument("--clients", type=int, default=1, help="threads submitting meanwhile (submit() latency)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run(args, q) for q in args.queue]
    cols = ["queue", "forwards", "requests_per_forward", "requests_per_s", "plan_us_per_forward",
            "plan_us_per_request", "launch_minus_after_us_per_forward", "after_launch_us_per_request",
            "resolve_us_per_request", "submit_ms_p99"]
    print(table(cols, [[r.get(c, "") for c in cols] for r in rows]))
    print(json.dumps({"kind": "serve_host", "config": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
