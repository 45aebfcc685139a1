"""What ``bcg load`` prints and writes: the header, the table per variant and rate, ``results.json`` (schema
``bcg.load/1``), the one-line summary and ``load.png`` (time to first token and throughput against offered load).

``results.json`` holds ``config`` (every flag, resolved), ``environment``, ``workload`` (lengths, shared prefix,
rates or the trace, requests and tokens per rate), ``builds`` (one :class:`~bcg.bench.engines.BuildRecord` per
variant), ``rows`` (one :class:`~bcg.bench.load_run.LoadRow` per variant and rate: ``ttft_ms`` and ``queue_ms``
percentiles, ``tokens_per_s``, ``requests_per_s``, ``cached_share``, ``graph_share``, ``cold_forwards``,
``fell_behind``, ``skipped``), ``warmups`` (one :class:`~bcg.bench.load_run.Warmup` per variant: what ran before the
measured windows, and for how long), ``note`` (what a CPU run cannot show, else null) and ``plots``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bcg.bench.results import jsonable
from bcg.bench.tables import fmt, table

__all__ = ["CPU_LOAD_NOTE", "LOAD_PLOTS", "LOAD_SCHEMA", "format_load", "load_figure", "load_header",
           "load_results", "load_summary"]

LOAD_SCHEMA = "bcg.load/1"
LOAD_PLOTS = ("load.png",)
CPU_LOAD_NOTE = ("CPU smoke test: graphs are emulated and the threads share the CPU with the model, so these times "
                 "say the load path works, not how a GPU serves")


def load_header(cfg: Any, env: dict[str, Any], workload: dict[str, Any]) -> str:
    """The first line of a run: what runs where, the workload, how long it may take, what each variant's engine runs
    (kernels, attention backend, compiler, buckets: :meth:`~bcg.bench.engines.EngineSpec.describe`), and on a CPU
    that it is a smoke test."""
    arrivals = (f"the trace {cfg.trace}" if cfg.trace else
                f"Poisson arrivals at {', '.join(f'{r:g}' for r in cfg.rates)} req/s for {cfg.duration:g} s each")
    prefix = f" after a shared prefix of {cfg.shared_prefix} tokens" if cfg.shared_prefix else ""
    where = "the CPU, under the CUDA-graph emulation" if cfg.emulated else f"{env['device_name']} ({cfg.device})"
    line = (f"bcg load: {cfg.model} on {where}; {arrivals}; prompts {workload['lengths']}{prefix}; token budget "
            f"{cfg.chunked_prefill_size} (--chunked-prefill-size), prefix cache {'on' if cfg.prefix_cache else 'off'}, "
            f"{cfg.schedule_policy} order; a variant falls behind once a request waits {cfg.max_wait:g} s. "
            f"Engines: {cfg.engine_spec().describe(cfg.backends)}.")
    return line + (f" {CPU_LOAD_NOTE}." if cfg.emulated else "")


def format_load(rows: Sequence[Any], builds: Sequence[Any], warmups: Sequence[Any] = ()) -> str:
    """The table of every variant and rate, a line per variant's warm-up (outside the measured windows), and a line
    per variant that could not be measured."""
    cells = []
    for r in rows:
        t, q = r.ttft_ms, r.queue_ms
        status = ("skipped (fell behind below)" if r.skipped else "FELL BEHIND" if r.fell_behind else
                  f"error: {r.error}" if r.error and not r.completed else "ok")
        cells.append([r.backend, fmt(r.rate, 0 if r.rate >= 10 else 1), r.submitted, r.completed,
                      fmt(t.get("p50"), 1), fmt(t.get("p90"), 1), fmt(t.get("p99"), 1), fmt(q.get("p50"), 1),
                      fmt(q.get("p99"), 1), fmt(r.requests_per_s, 1), fmt(r.tokens_per_s, 0),
                      _share(r.cached_share), _share(r.graph_share), fmt(r.mean_batch_tokens, 0),
                      _cold(r.cold_forwards, r.cold_ttft_ms_max), status])
    out = table(["backend", "req/s offered", "sent", "answered", "TTFT p50 ms", "p90", "p99", "queue p50 ms", "p99",
                 "req/s done", "tokens/s", "cached", "graph", "tokens/fwd", "cold fwd (worst TTFT ms)", "status"],
                cells, title="Time to first token under load")
    warm = [f"{w.backend}: warm-up before the measured windows: {w.requests} requests, then one forward each of "
            f"{', '.join(map(str, w.prefill_tokens))} tokens, {w.wall_ms:.0f} ms in all" for w in warmups]
    missing = [f"{b.backend}: not measured ({b.error})" for b in builds if not b.available]
    paused = [f"{r.backend} at {fmt(r.rate, 0)} req/s: the garbage collector held every thread for up to "
              f"{r.gc_pause_ms_max:.1f} ms ({r.gc_full_collections} full collection(s)) inside the window"
              for r in rows if r.gc_pause_ms_max >= GC_PAUSE_NOTED_MS]
    return out + "".join("\n" + line for line in warm + paused + missing)


GC_PAUSE_NOTED_MS = 5.0  # a collection this long shows in a p99 at serving rates: said under the table


def _cold(count: int, worst: float | None) -> str:
    return "0" if not count else f"{count} ({fmt(worst, 1)})"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def load_results(cfg: Any, env: dict[str, Any], workload: dict[str, Any], result: Any) -> dict[str, Any]:
    """The content of results.json as plain data (``plots`` filled in when drawn)."""
    return jsonable({"schema": LOAD_SCHEMA, "kind": "load", "config": vars(cfg), "environment": env,
                     "workload": workload, "note": CPU_LOAD_NOTE if cfg.emulated else None,
                     "builds": result.builds, "rows": result.rows, "warmups": result.warmups, "plots": []})


def load_summary(cfg: Any, results: dict[str, Any], path: Any) -> dict[str, Any]:
    """The one-line summary: per variant and rate the TTFT p50/p99 and tokens/s, each variant's best tokens/s (its
    saturation throughput when a rate fell behind), what could not be measured."""
    per: dict[str, dict[str, Any]] = {}
    for r in results["rows"]:
        if r["skipped"] or r["rate"] is None:
            continue
        per.setdefault(r["backend"], {})[f"{r['rate']:g}"] = {
            "ttft_p50_ms": r["ttft_ms"].get("p50"), "ttft_p99_ms": r["ttft_ms"].get("p99"),
            "tokens_per_s": r["tokens_per_s"], "fell_behind": r["fell_behind"]}
    best = {b: max((v["tokens_per_s"] or 0.0 for v in rates.values()), default=None) for b, rates in per.items()}
    return {"kind": "load", "model": cfg.model, "device": results["environment"]["device_name"],
            "emulated": cfg.emulated, "note": results["note"], "prefix_cache": cfg.prefix_cache,
            "shared_prefix": cfg.shared_prefix, "rates": per, "max_tokens_per_s": best,
            "unavailable": {b["backend"]: b["error"] for b in results["builds"] if not b["available"]},
            "results": str(path), "plots": results["plots"]}


def load_figure(rows: Sequence[dict], title: str = "", note: str | None = None) -> Any:
    """TTFT p50 (solid) and p99 (dashed) against offered load per variant, log y, a cross where it fell behind;
    beside it the tokens per second answered.

    Example::

        load_figure(results["rows"], "llama-dense on H200").savefig("load.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r["skipped"] and r["rate"] is not None and r["ttft_ms"]]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    for i, b in enumerate(backends):
        mine = sorted((r for r in rows if r["backend"] == b), key=lambda r: r["rate"])
        x, color = [r["rate"] for r in mine], f"C{i % 10}"
        ax.plot(x, [r["ttft_ms"]["p50"] for r in mine], "o-", color=color, label=f"{b} p50")
        ax.plot(x, [r["ttft_ms"]["p99"] for r in mine], "s--", color=color, label=f"{b} p99")
        behind = [r for r in mine if r["fell_behind"]]
        ax.plot([r["rate"] for r in behind], [r["ttft_ms"]["p99"] for r in behind], "kx", ms=10,
                label="fell behind" if i == 0 and behind else None)
        ax2.plot(x, [r["tokens_per_s"] for r in mine], "o-", color=color, label=b)
    for a in (ax, ax2):
        a.set_xlabel("offered load (requests/s)")
        a.grid(True, which="both", alpha=0.3)
    if rows and all(r["ttft_ms"]["p50"] > 0 for r in rows):
        ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT against offered load")
    ax2.set_ylabel("prompt tokens answered per second")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Throughput")
    for a in (ax, ax2):
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    return fig

