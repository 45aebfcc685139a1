"""Checks `bcg analyze` runs against the targets of issue 30 and prints them as markdown tables.

For each results.json given (one model each): with ``--validate``, the prediction error of every backend at
64-2048 tokens (target: at most 10%), whether the recommended backend is the fastest measured on the workload or
within 3% of it, among the backends whose measured graph memory fits the run's budget (``--memory-budget``, else the
default share of free memory), and fits it itself (:func:`within_budget`), and that no measurement was an eager
fallback (a backend whose replays failed under ``--cpu-cores``, say); for a run without ``--validate`` whose machine
costs all came from the disk cache (a second run on the machine), whether predicting took at most 5 s. Also reported:
how many measured latencies fell inside their prediction's interval, what predicting spent its time on, and where the
machine's costs came from. The last line printed is one JSON object with every number and a verdict per target (null
where a run cannot say).

``--fixture PATH`` also writes what tests/bench/test_analyze_evidence.py replays on a CPU: per validated model its
machine's costs, each variant's program parts, predictions and measurements at every length and its graph memory
predicted and measured, the measured replay, and the run's inputs.json (every size's traces and host times; or
inputs.json.gz) when it lies beside the results; ``.gz`` compresses.

Usage::

    python benchmarks/analyze_targets.py out/gpu/analyze-*/results.json
    python benchmarks/analyze_targets.py out/gpu/analyze-*/results.json \
        --fixture tests/bench/fixtures/analyze_h200.json.gz

Runs of the CPU emulation are read the same way; their numbers mean nothing for the targets.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

MAX_ERROR = 0.10
WITHIN_FASTEST = 0.03
PREDICT_SECONDS = 5.0
LENGTHS = range(64, 2049)


def _cached(result: dict) -> bool:
    """Whether every machine cost of the run came from the disk cache (what a second run on a machine does)."""
    sources = ((result["timings"].get("machine_cache") or {}).get("sources") or {}).values()
    return bool(sources) and all(s == "disk" for s in sources)


def within_budget(result: dict) -> dict[str, bool | None]:
    """Per validated variant, whether the graph memory its build measured fits the recommendation's budget (None:
    not measured, or the recommendation capped the ladder lower than the validation built it, so the full ladder's
    memory says nothing of it). A recommendation is right when it is the fastest measured of those that fit.

    Example::

        >>> within_budget({"recommendation": {"backend": "full", "ceiling": 2048, "memory_budget_bytes": 100},
        ...                "config": {"max_tokens": 2048},
        ...                "validation": {"full": {"graph_memory_bytes": 80}, "breakable": {"graph_memory_bytes": 120},
        ...                               "eager": {"graph_memory_bytes": None}}})
        {'full': True, 'breakable': False, 'eager': None}
    """
    rec = result["recommendation"]
    budget = rec.get("memory_budget_bytes")
    built = (result.get("config") or {}).get("max_tokens")
    out: dict[str, bool | None] = {}
    for v, x in (result.get("validation") or {}).items():
        mem = x.get("graph_memory_bytes")
        capped = v == rec["backend"] and rec.get("ceiling") is not None and built and rec["ceiling"] < built
        out[v] = None if budget is None or mem is None or capped else mem <= budget
    return out


def check(result: dict) -> dict:
    """The targets one analysis (its results.json as a dict) can say something about."""
    name = result["model"]["name"]
    t = result["timings"]
    validated = "errors" in result
    out = {"model": name, "device": result["environment"].get("device_name"), "validated": validated,
           "predict_s": t["predict_s"], "predict_parts_s": t.get("parts_s"),
           "machine_cache": (t.get("machine_cache") or {}).get("sources"), "recommended":
           result["recommendation"]["backend"],
           "predict_time_ok": t["predict_s"] <= PREDICT_SECONDS if not validated and _cached(result) else None}
    if not validated:
        return {**out, "errors_ok": None, "recommendation_ok": None, "no_fallbacks_ok": None, "worst_error": {}}
    errors = {v: {int(n): e for n, e in by_len.items() if int(n) in LENGTHS} for v, by_len in result["errors"].items()}
    worst = {v: max((abs(e) for e in by_len.values()), default=None) for v, by_len in errors.items()}
    rec = out["recommended"]
    fits = within_budget(result)
    expected = {v: ms for v, ms in (result.get("measured_expected_ms") or {}).items()
                if ms and fits.get(v) is not False}
    fastest = min(expected, key=expected.get) if expected else None
    behind = expected[rec] / expected[fastest] - 1 if fastest and rec in expected else None
    mismatched = [v for v, x in result.get("validation", {}).items() if x["available"] != x["predicted_available"]]
    fallbacks = {f"{v} {key}": why for v, x in result.get("validation", {}).items()
                 for key, why in (x.get("fallbacks") or {}).items()}
    intervals = result.get("intervals") or {}
    inside = [lo <= result["measured"][v][n] <= hi for v, by_len in result["errors"].items() for n in by_len
              if int(n) in LENGTHS and (lo_hi := (intervals.get(v) or {}).get(n)) for lo, hi in [lo_hi]]
    return {
        **out, "worst_error": worst, "errors": errors, "fastest_measured": fastest,
        "recommended_behind_fastest": behind,
        "predict_share": t["predict_s"] / (t["predict_s"] + t["validate_s"]) if t.get("validate_s") else None,
        "availability_mismatches": mismatched, "fallbacks": fallbacks,
        "measured_inside_interval": f"{sum(inside)}/{len(inside)}" if inside else None,
        "errors_ok": all(w is not None and w <= MAX_ERROR for w in worst.values()) and not mismatched,
        "budget_bytes": result["recommendation"].get("memory_budget_bytes"), "fits_budget_measured": fits,
        "recommendation_ok": behind is not None and behind <= WITHIN_FASTEST and fits.get(rec) is not False,
        "no_fallbacks_ok": not fallbacks,
    }


def _yes(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def tables(checks: list[dict], results: list[dict]) -> list[str]:
    """Markdown: predicted / measured / error per model, backend and length; then one line per run's targets and
    one per run's time by part."""
    lines = ["| model | backend | tokens | predicted ms | measured ms | error |", "|---|---|---:|---:|---:|---:|"]
    for result in results:
        for v, by_len in (result.get("errors") or {}).items():
            for n, e in by_len.items():
                lines.append(f"| {result['model']['name']} | {v} | {n} | {result['predictions'][v][n]:.3f} | "
                             f"{result['measured'][v][n]:.3f} | {e:+.1%} |")
    lines += ["", "| model | validated | worst error | recommended | fastest measured | behind | predict s | "
              "inside interval | targets (errors/recommendation/time/no fallback) |",
              "|---|---|---:|---|---|---:|---:|---:|---|"]
    for c in checks:
        worst = max((w for w in c["worst_error"].values() if w is not None), default=None)
        behind = c.get("recommended_behind_fastest")
        ok = "/".join(_yes(c[k]) for k in ("errors_ok", "recommendation_ok", "predict_time_ok", "no_fallbacks_ok"))
        lines.append(f"| {c['model']} | {_yes(c['validated'])} | {'-' if worst is None else f'{worst:.1%}'} | "
                     f"{c['recommended']} | {c.get('fastest_measured') or '-'} | "
                     f"{'-' if behind is None else f'{behind:+.1%}'} | {c['predict_s']:.1f} | "
                     f"{c.get('measured_inside_interval') or '-'} | {ok} |")
    lines += ["", "| model | validated | predict s | machine costs from | time by part (s) |", "|---|---|---:|---|---|"]
    for c in checks:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in (c["predict_parts_s"] or {}).items())
        cache = ", ".join(f"{k}: {v}" for k, v in (c["machine_cache"] or {}).items()) or "-"
        lines.append(f"| {c['model']} | {_yes(c['validated'])} | {c['predict_s']:.2f} | {cache} | {parts} |")
    return lines


def fixture_entry(result: dict, inputs: dict | None) -> dict:
    """What test_analyze_evidence.py replays of one validated run (see the module doc)."""
    variants = {}
    validation = result.get("validation") or {}
    for v, fc in result["forecasts"].items():
        if fc["available"] and v in (result.get("measured") or {}):
            variants[v] = {"parts": fc["parts"], "parts_by_length": fc.get("parts_by_length") or {},
                           "predicted_ms": result["predictions"][v], "measured_ms": result["measured"][v],
                           "predicted_graph_memory_bytes": fc.get("graph_memory_bytes"),
                           "measured_graph_memory_bytes": (validation.get(v) or {}).get("graph_memory_bytes")}
    replay = next((x["replay"] for x in (result.get("validation") or {}).values() if x.get("replay")), None)
    if inputs is not None:  # the process as it ran: the pinned core counts and the validation are not replayed
        inputs = dict(inputs, costs={"None": inputs["costs"]["None"]}, hosts={"None": inputs["hosts"]["None"]},
                      measured=None, settings=dict(inputs["settings"], cores=[]))
    return {"length": result["length"], "lengths": result["lengths"], "machine": result["machine"]["None"],
            "variants": variants, "replay": replay, "inputs": inputs}


def _inputs_beside(path: Path, result: dict) -> dict | None:
    named = result.get("inputs_file")
    beside = [path.with_name("inputs.json"), path.with_name("inputs.json.gz")]
    for candidate in ([Path(named)] if named else []) + beside:
        if candidate.exists():
            data = candidate.read_bytes()
            return json.loads(gzip.decompress(data) if candidate.suffix == ".gz" else data)
    return None


def write_fixture(dest: Path, paths: list[Path], results: list[dict]) -> Path:
    """Writes the fixture of every validated run among ``results`` to ``dest`` (gzip-compressed for ``.gz``)."""
    models: dict[str, dict] = {}
    for p, r in zip(paths, results):  # a model's plain validated run (no --cpu-cores, no --memory-budget), the first
        plain = not any((r.get("config") or {}).get(k) for k in ("cpu_cores", "memory_budget"))
        if "errors" in r and plain and r["model"]["name"] not in models:
            models[r["model"]["name"]] = fixture_entry(r, _inputs_beside(p, r))
    env = next((r["environment"] for r in results if "errors" in r), {})
    data = {"source": f"bcg analyze --validate on {env.get('device_name')} (torch {env.get('torch')}): "
                      f"{', '.join(str(p) for p in paths)}; written by benchmarks/analyze_targets.py --fixture",
            "models": models}
    text = json.dumps(data, separators=(",", ":") if dest.suffix == ".gz" else None,
                      indent=None if dest.suffix == ".gz" else 1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.suffix == ".gz":
        dest.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        dest.write_text(text + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of bcg analyze runs")
    parser.add_argument("--fixture", type=Path, default=None,
                        help="also write the validated runs as the replay fixture of test_analyze_evidence.py")
    args = parser.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    checks = [check(r) for r in results]
    print("\n".join(tables(checks, results)))
    if args.fixture is not None:
        print(f"fixture: {write_fixture(args.fixture, args.results, results)}")

    def every(key: str) -> bool | None:
        said = [c[key] for c in checks if c[key] is not None]
        return all(said) if said else None

    summary = {"models": checks, "all_errors_ok": every("errors_ok"), "all_recommendations_ok":
               every("recommendation_ok"), "all_predict_times_ok": every("predict_time_ok"),
               "no_fallbacks": every("no_fallbacks_ok")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
