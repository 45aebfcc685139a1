"""Markdown tables from `bcg bench` results.json files, for BENCHMARKS.md and the README.

Usage: python scripts/summarize.py RESULTS_DIR [RESULTS_DIR ...]   (each holds a results.json; the folder name is
the title). Per model: one-request median latency of every variant, the kernel floors, each variant's ratio to
tc_piecewise, each breakable variant's ratio to its own kernel floor (plain or fused), each variant's wall time over
its own device time (when profiled), the greedy-token check, and the build table (compile, capture, graph memory).
The rows are read as bcg/bench/results.py documents them (schema bcg.bench/3); older files (bcg.bench/2, flat rows)
are read too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _upgrade(row: dict) -> dict:
    """A row of a bcg.bench/2 results.json (every number at the top level) in the nested shape of bcg.bench/3."""
    if "wall" in row:
        return row
    return {**row, "wall": {"median_ms": row["median_ms"]}, "speedup": {"over_eager": row.get("speedup_vs_eager")},
            "device": {"floor_ms": row.get("kernel_floor_ms"), "fused_floor_ms": row.get("fused_floor_ms")},
            "greedy": {"equal_eager": row.get("tokens_equal_eager"), "eager_top2_gap": row.get("eager_top2_gap")}}


def _speedup(row: dict) -> float | None:
    return (row.get("speedup") or {}).get("over_eager")


def summarize(folder: Path) -> str:
    data = json.loads((folder / "results.json").read_text())
    data["rows"] = [_upgrade(r) for r in data["rows"]]
    data["batch_rows"] = [_upgrade(r) for r in data.get("batch_rows", [])]
    rows = [r for r in data["rows"] if r["num_requests"] == 1]
    variants = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["backend"], r["input_len"]): r for r in rows}
    lengths = sorted({r["input_len"] for r in rows})
    has_fused_floor = any(r["device"].get("fused_floor_ms") for r in rows)
    head = ["tokens", *variants, "kernel floor"] + (["fused floor"] if has_fused_floor else [])
    out = [f"### {folder.name}", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in lengths:
        eager = by.get(("eager", n))
        cells = [str(n)]
        for v in variants:
            r = by.get((v, n))
            cells.append("-" if r is None else _ms(r["wall"]["median_ms"]) + (
                "" if v == "eager" or not _speedup(r) else f" ({_speedup(r):.1f}x)"))
        cells.append(_ms(eager and eager["device"].get("floor_ms")))
        if has_fused_floor:
            cells.append(_ms(eager and eager["device"].get("fused_floor_ms")))
        out.append("| " + " | ".join(cells) + " |")
    if "tc_piecewise" in variants:
        others = [v for v in variants if v not in ("eager", "tc_piecewise")]
        out += ["", "Latency over tc_piecewise's (below 1 is faster):", "",
                "| tokens | " + " | ".join(others) + " |", "|" + "---:|" * (len(others) + 1)]
        for n in lengths:
            tc = by.get(("tc_piecewise", n))
            out.append(f"| {n} | " + " | ".join(
                _x(by[(v, n)]["wall"]["median_ms"] / tc["wall"]["median_ms"]) if tc and (v, n) in by else "-"
                for v in others) + " |")
    floors = [(v, "fused_floor_ms" if "fused" in v else "floor_ms") for v in variants if v.startswith("breakable")]
    if floors:
        out += ["", "Latency over the kernel floor of the same kernels (plain or fused):", "",
                "| tokens | " + " | ".join(v for v, _ in floors) + " |", "|" + "---:|" * (len(floors) + 1)]
        for n in lengths:
            floor = by[("eager", n)]["device"] if ("eager", n) in by else {}
            out.append(f"| {n} | " + " | ".join(
                _x(by[(v, n)]["wall"]["median_ms"] / floor[f]) if (v, n) in by and floor.get(f) else "-"
                for v, f in floors) + " |")
    if any(r["device"].get("wall_over_device") for r in rows):
        out += ["", "Wall time over the variant's own device time (1.00x: the host hides behind the GPU):", "",
                "| tokens | " + " | ".join(variants) + " |", "|" + "---:|" * (len(variants) + 1)]
        for n in lengths:
            out.append(f"| {n} | " + " | ".join(
                _x(by[(v, n)]["device"].get("wall_over_device")) if (v, n) in by else "-" for v in variants) + " |")
    checked = [r for r in data["rows"] + data["batch_rows"] if r["greedy"].get("equal_eager") is not None]
    if checked:
        differ = [r for r in checked if not r["greedy"]["equal_eager"]]
        out += ["", f"Greedy tokens equal eager's in {len(checked) - len(differ)} of {len(checked)} rows"
                + ("." if not differ else ": differ in " + ", ".join(
                    f"{r['backend']} at {r['num_tokens']} tokens (eager's top-2 gap "
                    f"{r['greedy']['eager_top2_gap']:.4f})" for r in differ) + ".")]
    out += ["", "| variant | available | compile s | capture s | buckets | segments/breaks | graph memory |",
            "|---|---|---:|---:|---:|---|---:|"]
    for b in data["builds"]:
        seg = f"{b.get('num_segments')}/{b.get('num_breaks')}" if b.get("num_segments") is not None else "-"
        avail = "yes" if b["available"] else f"no: {(b.get('error') or '')[:80]}"
        buckets = f"{b.get('num_captured')}/{b.get('num_buckets')}"
        out.append(f"| {b['backend']} | {avail} | {_ms((b.get('compile_ms') or 0) / 1e3)} | "
                   f"{_ms((b.get('capture_ms') or 0) / 1e3)} | {buckets} | {seg} | "
                   f"{_bytes(b.get('graph_memory_bytes'))} |")
    return "\n".join(out)


def read_bench(folder: Path) -> None:
    """Raises ValueError, one line naming the folder and the fix, unless ``folder`` holds a bcg bench results.json."""
    path = folder / "results.json"
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder; give the --out folder of a bcg bench run")
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{str(path)!r} cannot be read ({e.strerror}); give the --out folder of a bcg bench run") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{str(path)!r} is not JSON; give the --out folder of a bcg bench run") from None
    schema = str(data.get("schema", "")) if isinstance(data, dict) else ""
    kind = schema.split("/")[0].removeprefix("bcg.") if schema.startswith("bcg.") else None
    if kind != "bench":
        what = f"the results of bcg {kind}" if kind else "no bcg results"
        raise ValueError(f"{str(path)!r} holds {what}; this script tables those of bcg bench (give the --out folder "
                         "of a bcg bench run)")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        for a in argv:
            read_bench(Path(a))
    except ValueError as e:
        print(f"summarize.py: error: {e}", file=sys.stderr)
        return 2
    try:
        print("\n\n".join(summarize(Path(a)) for a in argv), flush=True)
    except BrokenPipeError:  # `| head`: the reader is gone; so is stdout, for the flush at exit too
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
