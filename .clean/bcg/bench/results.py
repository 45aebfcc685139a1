"""The JSON of ``bcg bench`` and ``bcg analyze``: ``results.json`` and the one-line summary each command prints last.

Every non-finite float is written as ``null``, so any JSON reader accepts the files. The ``results.json`` of
``bcg bench`` (schema ``bcg.bench/3``) holds:

- ``config``: the resolved :class:`~bcg.bench.config.BenchConfig` (every flag); ``environment``: torch, Python,
  platform, CUDA, device name, torch threads, whether the graphs were emulated, the model implementation.
- ``builds``: one :class:`~bcg.bench.engines.BuildRecord` per variant: ``available``, ``error``, ``refused_reason``,
  ``ceiling``, ``load_ms``, ``build_ms`` (= ``compile_ms`` + ``capture_ms`` and the rest), ``num_buckets``,
  ``num_captured``, ``graph_memory_bytes`` (CUDA), ``num_segments``/``num_breaks`` of the largest captured bucket.
- ``rows`` (one request per length) and ``batch_rows`` (``batch_requests`` requests of the same total tokens): one
  :class:`~bcg.bench.rows.LatencyRow` each, with ``backend`` (the variant name), ``input_len``, ``num_requests``,
  ``num_tokens``; ``wall`` (``median_ms``, ``min_ms``, ``q1_ms``, ``q3_ms``, ``max_ms``, ``mean_ms``, ``stdev_ms``,
  ``runs``); ``graph_used``, ``bucket`` and ``reason`` (the runner's reason code); ``speedup`` (``over_eager``,
  ``low``, ``high``; ``null`` without an eager row of the same shape); ``device`` (``ms``, ``host_ms``,
  ``wall_over_device``, ``floor_ms``, ``fused_floor_ms``, ``launch_gap_share``: ``null`` on a CPU or with
  ``--no-profile``); ``greedy`` (``next_tokens``, ``equal_eager``, ``eager_top2_gap``).
- ``memory``: the :class:`~bcg.bench.memory.MemoryResult` (``null`` with ``--no-memory``); ``speedup_note``: what
  the speedups cannot show (CPU emulation), or ``null``; ``plots``: the PNGs written beside it.

The ``results.json`` of ``bcg analyze`` (schema ``bcg.analyze/2``) is the dict :func:`bcg.bench.analyze.run_analyze`
returns, with its ``config`` and ``plots`` (lengths are JSON object keys, so strings):

- ``model`` (its sizes, its automatic islands), ``machine`` (the :class:`~bcg.bench.machine.MachineCosts` per core
  count, ``"None"`` for the process as it ran), ``workload`` (``source``, ``num_prompts``), ``lengths``, ``length``;
- ``predictions``: variant -> length -> predicted prefill ms of one request (the eager variants measured);
  ``unavailable``: variant -> why it cannot run the model; ``forecasts``: per variant ``available``, ``reason``,
  ``graph_memory_bytes``, ``build_ms`` and ``compile_ms`` with the default ladder, ``parts`` (host and device µs per
  part of the program at the representative length), ``graph`` (length -> whether it replays);
- ``recommendation``: ``backend``, ``ceiling``, ``buckets``, ``expected_ms`` and ``eager_expected_ms`` per prompt of
  the workload, ``speedup``, ``graph_memory_bytes``, ``build_ms``, ``memory_budget_bytes``, ``reason``; ``options``:
  the best ladder of every variant that was weighed;
- ``parameters``: the seed's four: ``launch_gap_share`` (and ``launch_gap_by_length``), ``dynamic_share`` with
  ``s_max``, ``bucket_coverage`` (the recommended ladder on the workload: the
  :class:`~bcg.bench.coverage.Coverage` fields, ``forward_graph``, ``num_buckets``), ``resident_graph_memory_bytes``
  (and ``resident_graph_memory_by_variant``); ``islands``: per island ``name``, ``calls``, ``host_us``,
  ``device_us`` and ``share``; ``amdahl``: ``p``, ``s_max``, ``predicted_speedup``/``predicted_n`` (and measured);
- with ``--validate``: ``measured`` and ``errors`` (``predicted / measured - 1``) shaped like ``predictions``, and
  ``validation`` per variant (availability, build time and graph memory measured; the breakable backends' replay
  step by step at the representative length, ``replay``, and at the shortest, ``replay_short``);
- with ``--cpu-cores``: ``cpu_cores``: core count -> ``launch_gap_share``, ``predictions`` (and ``measured``) ms per
  variant at ``length``;
- ``memory`` (free and total device memory, the budget), ``verdict``;
- ``timings``: ``predict_s`` and ``validate_s``; ``parts_s`` (seconds by part: ``eager engines``, ``machine``,
  ``replay paths``, ``host times``, ``profiles``, ``machine (device)``, ``composition``); ``profiles_s`` (of the
  profiles: ``run``, the profiled forwards, of which ``start`` and ``stop``, the profiler's own, and ``read``, their
  records turned into traces); ``machine_cache``
  (``mode``, ``dir``, per cost ``sources`` "disk", "measured" or "process", and ``files``); ``repeats`` (per eager
  variant and size, ``host_warmups``, ``host_runs`` and ``profiles``);
- ``inputs_file``: inputs.json beside it, what the predictions were computed from (:mod:`bcg.bench.replay`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from bcg.bench.rows import CPU_SPEEDUP_NOTE, geomean_speedups

__all__ = ["analyze_summary", "bench_results", "bench_summary", "jsonable", "summary_line", "write_json"]

BENCH_SCHEMA = "bcg.bench/3"


def jsonable(obj: Any) -> Any:
    """Converts dataclasses, paths, tuples and non-finite floats into plain JSON values.

    Example::

        >>> jsonable({"a": float("inf"), "b": (1, 2), "c": Path("x")})
        {'a': None, 'b': [1, 2], 'c': 'x'}
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (os.PathLike,)):
        return os.fspath(obj)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2) -> Path:
    """Writes ``data`` as JSON, indented unless ``indent`` is None (creating parent folders), and returns the path.

    Example::

        write_json("out/bench/results.json", {"rows": rows})
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(jsonable(data), indent=indent, separators=None if indent else (",", ":"))
    path.write_text(text + "\n")
    return path


def summary_line(data: dict[str, Any]) -> str:
    """One compact JSON line (the last line a CLI command prints, for scripts to parse).

    Example::

        >>> summary_line({"speedup": 1.5, "bad": float("nan")})
        '{"speedup": 1.5, "bad": null}'
    """
    return json.dumps(jsonable(data), separators=(", ", ": "))


def bench_results(cfg: Any, environment: dict[str, Any], lat: Any, mem: Any) -> dict[str, Any]:
    """The content of ``bcg bench``'s results.json as plain data (its ``plots`` filled in when they are drawn)."""
    return jsonable({"schema": BENCH_SCHEMA, "kind": "bench", "config": vars(cfg), "environment": environment,
                     "speedup_note": CPU_SPEEDUP_NOTE if cfg.emulated else None, "builds": lat.builds,
                     "rows": lat.rows, "batch_rows": lat.batch_rows, "memory": mem, "plots": []})


def bench_summary(cfg: Any, results: dict[str, Any], lat: Any, path: Path | None) -> dict[str, Any]:
    """The fields of the one-line summary ``bcg bench`` prints last."""
    env = results["environment"]
    return {"kind": "bench", "model": cfg.model, "device": env["device_name"], "emulated": cfg.emulated,
            "tp": cfg.tp, "lengths": cfg.lengths, "geomean_speedup": geomean_speedups(lat.rows, cfg.backends),
            "speedup_note": results["speedup_note"],
            "unavailable": {b.backend: b.error for b in lat.builds if not b.available},
            "results": str(path), "plots": results["plots"]}


def analyze_summary(cfg: Any, a: dict[str, Any], path: Path) -> dict[str, Any]:
    """The fields of the one-line summary ``bcg analyze`` prints last: ``predictions`` (variant -> length -> ms),
    ``intervals`` (variant -> length -> [low, high] ms), ``recommendation`` (``backend``, ``ceiling``, ``buckets``),
    and with ``--validate`` ``measured`` and ``errors`` in the shape of ``predictions``; then the four parameters,
    the verdict and where the files are."""
    rec, params = a["recommendation"], a["parameters"]
    out = {"kind": "analyze", "model": cfg.model, "device": a["environment"]["device_name"], "emulated": cfg.emulated,
           "predictions": a["predictions"], "intervals": a.get("intervals", {}),
           "recommendation": {"backend": rec["backend"], "ceiling": rec["ceiling"], "buckets": rec["buckets"]}}
    if "measured" in a:
        out["measured"], out["errors"] = a["measured"], a["errors"]
    out.update({"unavailable": a["unavailable"], "launch_gap_share": params["launch_gap_share"],
                "dynamic_share": params["dynamic_share"], "s_max": params["s_max"],
                "coverage": params["bucket_coverage"]["graph_fraction"],
                "resident_graph_memory_bytes": params["resident_graph_memory_bytes"], "pays": a["verdict"]["pays"],
                "verdict": a["verdict"]["sentence"], "timings": a["timings"], "results": str(path),
                "plots": a["plots"]})
    return out
