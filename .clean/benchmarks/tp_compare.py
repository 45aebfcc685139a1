"""Breakable's speedup at TP=N against TP=1, from two ``bcg bench`` results, with the multi-GPU targets checked.

Usage::

    python benchmarks/tp_compare.py out/bench-tp1/results.json out/bench-tp2/results.json [--out table.md]

Per backend and length: each run's median latency and speedup over eager, and the TP=N speedup as a fraction of
the TP=1 speedup (target: within 10% for breakable at 64-2048 tokens); then each backend's capture time at TP=N
over TP=1 (target: at most 1.5x). Prints a markdown table (for BENCHMARKS.md) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPEEDUP_TOLERANCE, CAPTURE_RATIO = 0.10, 1.5


def _load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("kind") != "bench":
        raise SystemExit(f"{path} is not a bcg bench results.json")
    if data.get("schema") != "bcg.bench/3":
        raise SystemExit(f"{path} has schema {data.get('schema')!r}; this script reads bcg.bench/3 (run bcg bench "
                         "again)")
    return data


def compare(one: dict, many: dict) -> tuple[list[str], dict]:
    """Markdown lines and the verdict of TP=N (``many``) against TP=1 (``one``)."""
    tp = many["config"].get("tp", 1)
    rows_one = {(r["backend"], r["input_len"]): r for r in one["rows"]}
    lines = [f"| backend | tokens | TP=1 ms | TP=1 speedup | TP={tp} ms | TP={tp} speedup | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {}
    for r in many["rows"]:
        base = rows_one.get((r["backend"], r["input_len"]))
        if base is None or r["backend"] == "eager":
            continue
        s1, sn = (x["speedup"] and x["speedup"]["over_eager"] for x in (base, r))
        ratio = sn / s1 if s1 and sn else None
        if ratio is not None:
            ratios.setdefault(r["backend"], []).append(ratio)
        lines.append(f"| {r['backend']} | {r['input_len']} | {base['wall']['median_ms']:.2f} | {s1 or 0:.2f}x | "
                     f"{r['wall']['median_ms']:.2f} | {sn or 0:.2f}x | "
                     f"{ratio if ratio is not None else float('nan'):.2f} |")
    builds_one = {b["backend"]: b for b in one["builds"]}
    lines += ["", f"| backend | capture ms TP=1 | capture ms TP={tp} | ratio |", "|---|---:|---:|---:|"]
    capture: dict[str, float | None] = {}
    for b in many["builds"]:
        base = builds_one.get(b["backend"])
        if base is None or not base.get("capture_ms") or not b.get("capture_ms"):
            continue
        capture[b["backend"]] = b["capture_ms"] / base["capture_ms"]
        lines.append(f"| {b['backend']} | {base['capture_ms']:.0f} | {b['capture_ms']:.0f} | "
                     f"{capture[b['backend']]:.2f} |")
    breakable = ratios.get("breakable", [])
    verdict = {"tp": tp, "speedup_ratios": ratios, "capture_ratios": capture,
               "breakable_speedup_within_10pct": bool(breakable) and all(abs(1 - x) <= SPEEDUP_TOLERANCE
                                                                         for x in breakable),
               "breakable_capture_within_1_5x": capture.get("breakable") is not None
               and capture["breakable"] <= CAPTURE_RATIO}
    return lines, verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tp1")
    parser.add_argument("tpn")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    lines, verdict = compare(_load(args.tp1), _load(args.tpn))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    print(json.dumps(verdict))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
