"""Host time of one ``Engine.prefill`` call with the model taken out: validation, planning, slots, packing, results.

The runner's forward is replaced by a stand-in that returns logits of the right shape at once, so what is timed is
the engine's own Python around the forwards (what ``bcg bench`` adds to every timed prefill besides the runner).
Each case is a number of prompts and their total tokens under a chunk size; the median of ``--runs`` calls is
printed in µs per call and per prompt.

Usage::

    python benchmarks/prefill_host.py                 # the default cases
    python benchmarks/prefill_host.py --runs 2000

A second table times the launch: the real runner (tiny-dense in bf16 with the whole-step graphs, the GPU's default;
``--device cuda`` for the real copy of its metadata to the device) with only its graph replays stubbed out, in µs
from the call until the first replay is called, which is what a short prompt's GPU waits for. "warm" calls run back
to back; "cold" ones each follow a 64 MiB write, as a prefill follows other work on a real host (the same Python
took 4-5x as long after a real forward on the development CPU).

Prints a table and, last, one JSON object. CPU is enough: nothing here runs the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's bcg, even beside an installed one

from bcg.bench.tables import table
from bcg.runtime import Engine
from bcg.runtime.runner.runner import ForwardOutput
from bcg.runtime.runner.telemetry import BatchRecord

# (prompts, tokens in all, chunked_prefill_size): one short prompt, a batch in one forward, a large batch in one
# forward, and long prompts chunked over several forwards.
CASES = [(1, 64, 2048), (16, 1024, 2048), (128, 2048, 2048), (8, 8000, 2048)]


def run_case(num_prompts: int, tokens: int, chunk: int, runs: int) -> dict[str, Any]:
    eng = Engine("tiny-dense", backend="eager", device="cpu", seed=0, progress=False, chunked_prefill_size=chunk,
                 buckets=[chunk], kv_tokens=max(4 * chunk, tokens + chunk))
    vocab = eng.model.config.vocab_size
    logits = torch.randn(max(num_prompts, 1), vocab)

    def stand_in(batch: Any) -> ForwardOutput:  # a forward that costs nothing: only the engine's Python is left
        return ForwardOutput(logits[: batch.num_logit_rows], BatchRecord(batch.num_tokens, batch.num_requests, None,
                                                                         False, "stand_in"))

    eng.runner.forward = stand_in
    g = torch.Generator().manual_seed(0)
    per = tokens // num_prompts
    prompts = [torch.randint(0, vocab, (per + (i < tokens % num_prompts),), generator=g) for i in range(num_prompts)]
    times = []
    for i in range(runs + 20):
        t0 = time.perf_counter()
        res = eng.prefill(prompts)
        t1 = time.perf_counter()
        if i >= 20:
            times.append((t1 - t0) * 1e6)
    assert eng.kv_pool.num_free == eng.kv_pool.num_slots
    us = statistics.median(times)
    return {"prompts": num_prompts, "tokens": tokens, "chunk": chunk, "forwards": len(res.batches),
            "us_per_call": round(us, 1), "us_per_prompt": round(us / num_prompts, 2)}


def launch_case(num_prompts: int, tokens: int, cold: bool, runs: int, device: str) -> dict[str, Any]:
    """Median µs until the first graph replay is called and until ``prefill`` returns, replays stubbed."""
    eng = Engine("tiny-dense", device=device, dtype="bfloat16", seed=0, progress=False, buckets=[16, 32, 64],
                 full_graph_tokens=64, max_requests=4, chunked_prefill_size=64, kv_tokens=1024)
    marks: list[int] = []

    def replay(handle: Any, num_tokens: int) -> None:
        marks.append(time.perf_counter_ns())

    for runner in (eng.runner, eng.runner.full):
        if runner is not None:
            runner.backend.replay = replay  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    per = tokens // num_prompts
    prompts = [torch.randint(0, 200, (per,), generator=g) for _ in range(num_prompts)]
    evict = np.zeros(1 << 23)  # 64 MiB: more than the caches of any host this runs on
    launch, whole, how = [], [], ""
    for i in range(runs + 20):
        if cold:
            evict += 1.0
        marks.clear()
        t0 = time.perf_counter_ns()
        res = eng.prefill(prompts)
        t1 = time.perf_counter_ns()
        if i >= 20 and marks:
            launch.append((marks[0] - t0) / 1e3)
            whole.append((t1 - t0) / 1e3)
        how = res.batches[0].reason
    return {"mode": "cold" if cold else "warm", "prompts": num_prompts, "tokens": tokens, "ran": how,
            "us_to_replay": round(statistics.median(launch), 1), "us_per_call": round(statistics.median(whole), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--device", default="cpu", help="the launch cases' engine (cuda: the real copy to the device)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [run_case(n, t, c, args.runs) for n, t, c in CASES]
    cols = list(rows[0])
    print(table(cols, [[r[c] for c in cols] for r in rows]))
    launches = [launch_case(n, t, cold, args.runs, args.device) for cold in (False, True)
                for n, t in ((1, 60), (4, 60))]
    cols = list(launches[0])
    print(f"\nlaunch on {args.device}: until the first graph replay is called (replays stubbed)")
    print(table(cols, [[r[c] for c in cols] for r in launches]))
    print(json.dumps({"kind": "prefill_host", "runs": args.runs, "rows": rows, "launch": launches}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
