"""Checks `bcg analyze --validate` runs against the targets of issue 30 and prints them as markdown tables.

For each results.json given (one model each): the prediction error of every backend at 64-2048 tokens (target: at
most 10%), whether the recommended backend is the fastest measured on the workload or within 3% of it, whether
predicting took at most 5 s, and that no measurement was an eager fallback (a backend whose replays failed under
``--cpu-cores``, say). Also reported: how many measured latencies fell inside their prediction's interval, and what
predicting spent its time on. The last line printed is one JSON object with every number and a verdict per
target.

Usage::

    python benchmarks/analyze_targets.py out/gpu/analyze-*/results.json

Runs of the CPU emulation are read the same way; their numbers mean nothing for the targets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MAX_ERROR = 0.10
WITHIN_FASTEST = 0.03
PREDICT_SECONDS = 5.0
LENGTHS = range(64, 2049)


def check(result: dict) -> dict:
    """The targets of one validated analysis (its results.json as a dict)."""
    name = result["model"]["name"]
    if "errors" not in result:
        raise ValueError(f"{name}: not a --validate run (its results.json has no measured latencies)")
    errors = {v: {int(n): e for n, e in by_len.items() if int(n) in LENGTHS} for v, by_len in result["errors"].items()}
    worst = {v: max((abs(e) for e in by_len.values()), default=None) for v, by_len in errors.items()}
    rec = result["recommendation"]["backend"]
    expected = {v: ms for v, ms in (result.get("measured_expected_ms") or {}).items() if ms}
    fastest = min(expected, key=expected.get) if expected else None
    behind = expected[rec] / expected[fastest] - 1 if fastest and rec in expected else None
    t = result["timings"]
    share = t["predict_s"] / (t["predict_s"] + t["validate_s"]) if t.get("validate_s") else None
    mismatched = [v for v, x in result.get("validation", {}).items() if x["available"] != x["predicted_available"]]
    fallbacks = {f"{v} {key}": why for v, x in result.get("validation", {}).items()
                 for key, why in (x.get("fallbacks") or {}).items()}
    intervals = result.get("intervals") or {}
    inside = [lo <= result["measured"][v][n] <= hi for v, by_len in result["errors"].items() for n in by_len
              if int(n) in LENGTHS and (lo_hi := (intervals.get(v) or {}).get(n)) for lo, hi in [lo_hi]]
    return {
        "model": name, "device": result["environment"].get("device_name"), "worst_error": worst, "errors": errors,
        "recommended": rec, "fastest_measured": fastest, "recommended_behind_fastest": behind,
        "predict_share": share, "predict_s": t["predict_s"], "predict_parts_s": t.get("parts_s"),
        "availability_mismatches": mismatched, "fallbacks": fallbacks,
        "measured_inside_interval": f"{sum(inside)}/{len(inside)}" if inside else None,
        "errors_ok": all(w is not None and w <= MAX_ERROR for w in worst.values()) and not mismatched,
        "recommendation_ok": behind is not None and behind <= WITHIN_FASTEST,
        "predict_time_ok": t["predict_s"] <= PREDICT_SECONDS,
        "no_fallbacks_ok": not fallbacks,
    }


def tables(checks: list[dict], results: list[dict]) -> list[str]:
    """Markdown: predicted / measured / error per model, backend and length; then one line per model's targets."""
    lines = ["| model | backend | tokens | predicted ms | measured ms | error |", "|---|---|---:|---:|---:|---:|"]
    for result in results:
        for v, by_len in result["errors"].items():
            for n, e in by_len.items():
                lines.append(f"| {result['model']['name']} | {v} | {n} | {result['predictions'][v][n]:.3f} | "
                             f"{result['measured'][v][n]:.3f} | {e:+.1%} |")
    lines += ["", "| model | worst error | recommended | fastest measured | behind | predict s | inside interval "
              "| targets (errors/recommendation/time/no fallback) |", "|---|---:|---|---|---:|---:|---:|---|"]
    for c in checks:
        worst = max((w for w in c["worst_error"].values() if w is not None), default=float("nan"))
        behind = "-" if c["recommended_behind_fastest"] is None else f"{c['recommended_behind_fastest']:+.1%}"
        ok = "/".join("yes" if c[k] else "no" for k in ("errors_ok", "recommendation_ok", "predict_time_ok",
                                                         "no_fallbacks_ok"))
        lines.append(f"| {c['model']} | {worst:.1%} | {c['recommended']} | {c['fastest_measured']} | {behind} | "
                     f"{c['predict_s']:.1f} | {c['measured_inside_interval'] or '-'} | {ok} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of bcg analyze --validate runs")
    args = parser.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    try:
        checks = [check(r) for r in results]
    except ValueError as e:
        print(f"analyze_targets: {e}", file=sys.stderr)
        return 2
    print("\n".join(tables(checks, results)))
    summary = {"models": checks, "all_errors_ok": all(c["errors_ok"] for c in checks),
               "all_recommendations_ok": all(c["recommendation_ok"] for c in checks),
               "all_predict_times_ok": all(c["predict_time_ok"] for c in checks),
               "no_fallbacks": all(c["no_fallbacks_ok"] for c in checks)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
