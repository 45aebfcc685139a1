"""What ``bcg analyze`` reports about the model beside the predictions (sections of results.json, computed from
:class:`~bcg.bench.measurements.Measurements` by :func:`~bcg.bench.findings.findings`): the islands and what each
costs, the seed's four parameters, the Amdahl point, and the fusion rule against the fused kernels' own timings.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bcg.bench import amdahl, coverage
from bcg.bench.forecast import Forecast, island_group
from bcg.bench.fusion_rule import fuse
from bcg.bench.measurements import Measurements
from bcg.bench.recommend import Recommendation
from bcg.bench.trace import regions
from bcg.bench.variants import parse_variant
from bcg.runtime.runner.buckets import BucketTable, default_ladder

__all__ = ["amdahl_point", "fusion_check", "islands", "parameters"]


def islands(m: Measurements, fcs: dict[str, Forecast], predicted: dict[str, dict[int, float]]) -> list[dict]:
    """Each island (by module, layer indices merged): calls per forward, host and device µs per call, and the share
    of the predicted breakable prefill its host time is."""
    p = m.profiles["torch"][m.length]
    host = m.hosts[None]["torch"][m.length]
    device: dict[str, float] = defaultdict(float)
    for r in regions(p.trace):
        if r.island is not None:
            device[r.island.name] += sum(k.device_us for k in r.kernels)
    breakable = next((v for v in predicted if parse_variant(v).backend == "breakable"), None)
    total_ms = predicted[breakable][m.length] if breakable else None
    groups: dict[str, dict[str, float]] = {}
    for name, calls in host.island_calls.items():
        g = groups.setdefault(island_group(name), {"calls": 0, "host_us": 0.0, "device_us": 0.0})
        g["calls"] += calls
        g["host_us"] += host.island_us.get(name, 0.0) * calls
        g["device_us"] += device.get(name, 0.0)
    rows = []
    for name, g in groups.items():
        calls = max(int(g["calls"]), 1)
        rows.append({"name": name, "calls": int(g["calls"]), "host_us": g["host_us"] / calls,
                     "device_us": g["device_us"] / calls,
                     "share": g["host_us"] / (total_ms * 1e3) if total_ms else None})
    return sorted(rows, key=lambda r: -(r["host_us"] * r["calls"]))


def parameters(m: Measurements, rec: Recommendation, fcs: dict[str, Forecast], k: int | None = None) -> dict:
    """The seed's four parameters: launch-gap share, dynamic share, bucket coverage, resident graph memory."""
    hosts, profiles = m.hosts[k]["torch"], m.profiles["torch"]
    gap = {n: amdahl.launch_gap_share(profiles[n].trace.device_us / 1e3, hosts[n].forward_ms)
           for n in m.lengths() if n in profiles}
    h = hosts[m.length]
    stays = h.islands_us + h.load_us + h.prefill_overhead_us
    p = amdahl.island_fraction(stays / 1e3, h.prefill_ms) if h.prefill_ms > 0 else None
    fc = fcs.get(rec.backend)
    ladder = rec.buckets or default_ladder(m.chunk)
    table = BucketTable(list(ladder), *m.padding)
    cov = coverage.bucket_coverage(m.workload.lengths, lambda n: (table.choose(n).bucket, table.choose(n).reason),
                                 ladder, m.chunk)
    cov_out = dict(vars(cov))
    cov_out["forward_graph"] = [table.choose(n).bucket is not None for n in cov.forward_sizes]
    cov_out["num_buckets"] = len(ladder)
    cov_out["recommended_ceiling"] = rec.ceiling
    return {
        "launch_gap_share": gap.get(m.length, next(iter(gap.values()), None)), "launch_gap_by_length": gap,
        "dynamic_share": p, "s_max": amdahl.s_max(p) if p is not None else None,
        "bucket_coverage": cov_out,
        "resident_graph_memory_bytes": rec.graph_memory_bytes if fc is not None else 0.0,
        "resident_graph_memory_by_variant": {v: f.graph_memory_bytes(default_ladder(m.max_tokens), m.costs[None])
                                             for v, f in fcs.items() if f.available},
    }


def amdahl_point(m: Measurements, p: float | None, predicted: dict[str, dict[int, float]],
                 measured: dict[str, dict[int, float]] | None) -> dict[str, Any]:
    """The Amdahl point at the representative length: the share ``p`` that stays eager and its ceiling, and the
    breakable variant's predicted (and, validated, measured) speedup over eager with the ``n`` each implies (how much
    faster the graphed rest ran)."""
    breakable = next((v for v in predicted if parse_variant(v).backend == "breakable"), None)
    eager_ms = predicted["eager"][m.length]
    out: dict[str, Any] = {"length": m.length, "variant": breakable, "p": p,
                           "s_max": amdahl.s_max(p) if p is not None else None}
    if breakable is None or p is None:
        return out
    s = eager_ms / predicted[breakable][m.length]
    out.update(predicted_speedup=s, predicted_n=amdahl.implied_n(p, s))
    got = (measured or {}).get(breakable, {}).get(m.length)
    if got:
        out.update(measured_speedup=eager_ms / got, measured_n=amdahl.implied_n(p, eager_ms / got))
    return out


def fusion_check(m: Measurements) -> dict[int, dict[str, float]] | None:
    """The fusion rule against the fused kernels' own timings, per profiled size: the graph work's device µs as
    profiled (torch kernels), as :func:`~bcg.bench.fusion_rule.fuse` predicts a compiler would run it, and as the
    fused kernels (``kernels='fused'``) ran it; None without a fused profile. A diagnostic: the rule is not fitted to
    it."""
    if "fused" not in m.profiles:
        return None
    out = {}
    for n, p in m.profiles["torch"].items():
        fused = m.profiles["fused"].get(n)
        if fused is None:
            continue
        graph = [r.kernels for r in regions(p.trace) if r.island is None]  # fusion stops at every island
        fused_graph = [k for r in regions(fused.trace) if r.island is None for k in r.kernels]
        out[n] = {"torch_us": sum(k.device_us for ks in graph for k in ks),
                  "rule_us": sum(k.device_us for ks in graph for k in fuse(ks)),
                  "fused_kernels_us": sum(k.device_us for k in fused_graph)}
    return out
