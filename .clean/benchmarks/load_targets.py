"""The serving targets of issue 22, judged from the results.json of ``bcg load`` runs on the GPU.

- At 900 req/s the breakable variant's p99 TTFT is at most 30 ms on llama-dense and 45 ms on gptoss-moe.
- Its saturation throughput (the most prompt tokens per second it answered at any rate; run rates past its capacity)
  is at least 1.3x the issue's table: 235k tokens/s on llama-dense, 234k on gptoss-moe.
- With a shared 1,000-token system prompt on every request, its p50 TTFT with the prefix cache is at most 1/3 of the
  same run without it (two runs, ``--prefix-cache`` and ``--no-prefix-cache``, at the same rates: every rate both
  have is compared, and the target needs all of them).

Usage::

    python benchmarks/load_targets.py --runs out/load/llama-dense out/load/gptoss-moe \\
        --prefix-on out/load/prefix-on --prefix-off out/load/prefix-off

Prints one line per target with its numbers and verdict, and as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

P99_AT_900_MS = {"llama-dense": 30.0, "gptoss-moe": 45.0}
ISSUE_TOKENS_PER_S = {"llama-dense": 235e3, "gptoss-moe": 234e3}  # breakable (fused kernels) at 900 req/s
SATURATION_FACTOR = 1.3
PREFIX_RATIO = 1 / 3


def _rows(results: dict[str, Any], variant: str) -> list[dict[str, Any]]:
    return [r for r in results["rows"] if r["backend"] == variant and not r["skipped"] and r["ttft_ms"]]


def judge(runs: list[dict[str, Any]], prefix_on: dict[str, Any] | None, prefix_off: dict[str, Any] | None,
          variant: str = "breakable+fused") -> tuple[list[str], dict[str, Any]]:
    """(lines to print, verdicts) for load results (parsed results.json), as the module docstring says."""
    lines, verdict = [], {}
    for results in runs:
        model = results["config"]["model"]
        rows = _rows(results, variant)
        at_900 = [r for r in rows if r["rate"] == 900]
        if model in P99_AT_900_MS:
            if at_900:
                p99, behind = at_900[0]["ttft_ms"]["p99"], at_900[0]["fell_behind"]
                ok = p99 <= P99_AT_900_MS[model] and not behind
                lines.append(f"{model} {variant}: p99 TTFT at 900 req/s {p99:.1f} ms (target <= "
                             f"{P99_AT_900_MS[model]:g} ms){' - fell behind' if behind else ''}: "
                             f"{'met' if ok else 'MISSED'}")
            else:
                ok = None
                lines.append(f"{model} {variant}: no 900 req/s row (run --rates with 900)")
            verdict[f"{model}_p99_at_900"] = ok
        if model in ISSUE_TOKENS_PER_S and rows:
            best = max(r["tokens_per_s"] or 0.0 for r in rows)
            need = SATURATION_FACTOR * ISSUE_TOKENS_PER_S[model]
            saturated = any(r["fell_behind"] for r in rows)
            ok = best >= need
            lines.append(f"{model} {variant}: {best / 1e3:.0f}k tokens/s at most (target >= {need / 1e3:.0f}k)"
                         f"{'' if saturated else ' - no rate saturated it: run higher rates'}: "
                         f"{'met' if ok else 'MISSED'}")
            verdict[f"{model}_saturation"] = ok
    if prefix_on is not None and prefix_off is not None:
        on = {r["rate"]: r for r in _rows(prefix_on, variant)}
        off = {r["rate"]: r for r in _rows(prefix_off, variant)}
        ratios = {rate: on[rate]["ttft_ms"]["p50"] / off[rate]["ttft_ms"]["p50"] for rate in sorted(set(on) & set(off))}
        ok = bool(ratios) and all(x <= PREFIX_RATIO for x in ratios.values())
        shared = prefix_on["config"]["shared_prefix"]
        cells = ", ".join(f"{rate:g} req/s {on[rate]['ttft_ms']['p50']:.1f}/{off[rate]['ttft_ms']['p50']:.1f} ms "
                          f"({x:.2f})" for rate, x in ratios.items())
        lines.append(f"shared {shared}-token prefix, {variant}: p50 TTFT cache on/off {cells or 'no common rate'} "
                     f"(target <= {PREFIX_RATIO:.2f}): {'met' if ok else 'MISSED'}")
        verdict["prefix_p50_ratio"] = ok
        verdict["prefix_ratios"] = {f"{k:g}": v for k, v in ratios.items()}
    return lines, verdict


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="*", default=[], help="bcg load --out folders (llama-dense, gptoss-moe)")
    p.add_argument("--prefix-on", default=None, help="the --shared-prefix 1000 run with the cache")
    p.add_argument("--prefix-off", default=None, help="the same run with --no-prefix-cache")
    p.add_argument("--variant", default="breakable+fused")
    args = p.parse_args(argv)

    def load(folder: str | None) -> dict[str, Any] | None:
        return None if folder is None else json.loads((Path(folder) / "results.json").read_text())

    lines, verdict = judge([load(f) for f in args.runs], load(args.prefix_on), load(args.prefix_off), args.variant)
    print("\n".join(lines))
    verdict["all_met"] = all(v is True for k, v in verdict.items() if k != "prefix_ratios")
    print(json.dumps(verdict))
    return verdict


if __name__ == "__main__":
    raise SystemExit(0 if main()["all_met"] else 1)
