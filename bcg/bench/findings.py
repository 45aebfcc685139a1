"""From what ``bcg analyze`` measured to what it reports: every variant's predicted latency per length, the
recommendation, the seed's four parameters, the islands and what each costs, the Amdahl point and the per-core-count
table, as plain data (the JSON of results.json).

:func:`findings` is pure: it takes :class:`Measurements` (host times per core count, profiled forwards, the machine's
costs, the workload, optionally the validation) and computes; tests feed it synthetic ones with known answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bcg.bench import amdahl, coverage
from bcg.bench.forecast import Forecast, ForecastContext, Profiled, forecast, island_group
from bcg.bench.fusion_rule import fuse
from bcg.bench.predict import HostTimes
from bcg.bench.recommend import Recommendation, Workload, eager_curve, expected_ms, recommend
from bcg.bench.trace import regions
from bcg.bench.validate import Measured, errors
from bcg.bench.variants import parse_variant
from bcg.runtime.runner.buckets import BucketTable, default_ladder

__all__ = ["EAGER_OF", "Measurements", "findings"]

EAGER_OF = {"torch": "eager", "fused": "eager+fused"}  # the eager variant of each kernels setting


@dataclass
class Measurements:
    """Everything :func:`findings` computes from.

    Attributes:
        variants: the graph variants to predict; chunk / max_tokens / length / predict_lengths as in AnalyzeConfig.
        costs: the machine's costs per core count (None: the process as it ran).
        hosts: per core count, per kernels setting ("torch", "fused"), per size: the eager forward's host times.
        profiles: per kernels setting, per size: the profiled forward (its host times are those of ``hosts[None]``).
        num_params: parameter tensors of the model (dynamo guards one each).
        padding: the engine's (max_padding_factor, max_padding_tokens); warmup: its warm-up forwards per bucket.
        budget_bytes: the graph-memory budget of the recommendation (None: none).
        measured: the validation, by variant (None without ``--validate``).
    """

    variants: list[str]
    chunk: int
    max_tokens: int
    length: int
    predict_lengths: list[int]
    workload: Workload
    costs: dict[int | None, Any]
    hosts: dict[int | None, dict[str, dict[int, HostTimes]]]
    profiles: dict[str, dict[int, Profiled]]
    num_params: int
    emulated: bool
    tc_compiler: str
    padding: tuple[float, int] = (2.0, 64)
    warmup: int = 2
    budget_bytes: float | None = None
    measured: dict[str, Measured] | None = None
    cores: list[int] = field(default_factory=list)

    def bucket(self, n: int) -> int | None:
        """The bucket a forward of ``n`` tokens replays with the run's default ladder (None: it runs eagerly)."""
        return BucketTable(default_ladder(self.max_tokens), *self.padding).choose(n).bucket

    def lengths(self) -> list[int]:
        """The lengths predicted (and validated): ``predict_lengths`` and the representative ``length``."""
        return sorted({*self.predict_lengths, self.length})

    def sizes(self) -> list[int]:
        """The sizes to profile: every predicted length and the buckets they replay."""
        wanted = set(self.lengths())
        return sorted(wanted | {b for n in wanted if (b := self.bucket(n)) is not None})


def _setting(variant: str) -> str:
    return parse_variant(variant).kernels


def _forecasts(m: Measurements, k: int | None) -> dict[str, Forecast]:
    ctx = ForecastContext(m.costs[k], m.emulated, m.tc_compiler, m.num_params, m.warmup)
    out = {}
    for v in m.variants:
        setting = _setting(v)
        profiles = {n: replace(p, host=m.hosts[k][setting][n]) for n, p in m.profiles[setting].items()}
        out[v] = forecast(v, profiles, ctx)
    return out


def _latency(m: Measurements, fc: Forecast, k: int | None, n: int) -> float:
    """One prefill of ``n`` tokens: a replay of its bucket, or eager on the variant's kernels."""
    b = m.bucket(n)
    return fc.replay_at(b) if b is not None else m.hosts[k][_setting(fc.variant)][n].prefill_ms


def _predictions(m: Measurements, fcs: dict[str, Forecast], k: int | None, lengths: Sequence[int]
                 ) -> dict[str, dict[int, float]]:
    out = {EAGER_OF[s]: {n: hosts[n].prefill_ms for n in lengths} for s, hosts in m.hosts[k].items()}
    for v, fc in fcs.items():
        if fc.available:
            out[v] = {n: _latency(m, fc, k, n) for n in lengths}
    return out


def _intervals(m: Measurements, fcs: dict[str, Forecast], k: int | None, lengths: Sequence[int]
               ) -> dict[str, dict[int, list[float]]]:
    """Each prediction's (low, high): every measured input at the low and the high end of its spread."""
    def eager(h: HostTimes) -> list[float]:
        return [(h.low or h).prefill_ms, (h.high or h).prefill_ms]

    out = {EAGER_OF[s]: {n: eager(hosts[n]) for n in lengths} for s, hosts in m.hosts[k].items()}
    for v, fc in fcs.items():
        if fc.available:
            hosts = m.hosts[k][_setting(v)]
            out[v] = {n: list(fc.interval_at(b)) if (b := m.bucket(n)) is not None else eager(hosts[n])
                      for n in lengths}
    return out


def _curves(m: Measurements, setting: str) -> tuple[Any, Any]:
    hosts = m.hosts[None][setting]
    wall = eager_curve([(n, h.forward_ms) for n, h in hosts.items()])
    host = eager_curve([(n, h.host_ms) for n, h in hosts.items()])
    return wall, host


def _recommend(m: Measurements, fcs: dict[str, Forecast]) -> Recommendation:
    costs = m.costs[None]
    eager = {EAGER_OF[s]: eager_curve([(n, h.prefill_ms) for n, h in hosts.items()])
             for s, hosts in m.hosts[None].items()}
    bounds = {EAGER_OF[s]: (eager_curve([(n, (h.low or h).prefill_ms) for n, h in hosts.items()]),
                            eager_curve([(n, (h.high or h).prefill_ms) for n, h in hosts.items()]))
              for s, hosts in m.hosts[None].items()}
    torch_hosts = m.hosts[None]["torch"]
    overhead = eager_curve([(n, h.prefill_overhead_us / 1e3) for n, h in torch_hosts.items()])

    def build(fc: Forecast, buckets: Sequence[int]) -> float:
        wall, host = _curves(m, _setting(fc.variant))
        return fc.build_ms(buckets, lambda b: (wall(b), host(b)), costs, m.warmup)

    return recommend(m.workload, m.chunk, list(fcs.values()), eager, overhead, lambda v: EAGER_OF[_setting(v)],
                     lambda fc, b: fc.graph_memory_bytes(b, costs), build, m.padding, m.budget_bytes, bounds)


def _islands(m: Measurements, fcs: dict[str, Forecast], predicted: dict[str, dict[int, float]]) -> list[dict]:
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


def _parameters(m: Measurements, rec: Recommendation, fcs: dict[str, Forecast], k: int | None = None) -> dict:
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


def _amdahl(m: Measurements, p: float | None, predicted: dict[str, dict[int, float]],
            measured: dict[str, dict[int, float]] | None) -> dict[str, Any]:
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


def _fusion_check(m: Measurements) -> dict[int, dict[str, float]] | None:
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


def _measured_expected(m: Measurements, measured: dict[str, dict[int, float]]) -> dict[str, float]:
    """Each measured variant's expected latency per prompt of the workload, from its measured latencies (a forward
    that would not replay takes its kernels' measured eager latency), as the recommendation weighed the predicted
    ones; the engine's per-prefill work is not taken off later chunks here, alike for every variant."""
    ladder = default_ladder(m.max_tokens)
    table = BucketTable(ladder, *m.padding)
    eager = {EAGER_OF[s]: eager_curve([(n, h.prefill_ms) for n, h in hosts.items()])
             for s, hosts in m.hosts[None].items()}
    out = {}
    for v, by_len in measured.items():
        curve = eager_curve(list(by_len.items()))
        if parse_variant(v).backend == "eager":
            out[v] = expected_ms(m.workload, m.chunk, curve, curve, lambda n: 0.0, None)
        else:
            out[v] = expected_ms(m.workload, m.chunk, curve, eager[EAGER_OF[_setting(v)]], lambda n: 0.0,
                                 lambda n: (table.choose(n).bucket, table.choose(n).reason))
    return out


def _cores(m: Measurements) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for k in m.cores:
        fcs = _forecasts(m, k)
        h = m.hosts[k]["torch"][m.length]
        trace = m.profiles["torch"][m.length].trace
        predicted = _predictions(m, fcs, k, [m.length])
        row: dict[str, Any] = {"launch_gap_share": amdahl.launch_gap_share(trace.device_us / 1e3, h.forward_ms),
                               "predictions": {v: ms[m.length] for v, ms in predicted.items()}}
        if m.measured is not None:
            row["measured"] = {v: x.by_cores[k][m.length] for v, x in m.measured.items()
                               if x.available and m.length in x.by_cores.get(k, {})}
            row["measured"]["eager"] = h.prefill_ms
            row["fallbacks"] = {v: x.fallbacks[f"{m.length}@{k}"] for v, x in m.measured.items()
                                if f"{m.length}@{k}" in x.fallbacks}
        out[k] = row
    return out


def findings(m: Measurements) -> dict[str, Any]:
    """Everything ``bcg analyze`` reports, computed from ``m`` (see the module doc).

    Example::

        out = findings(measurements)
        out["predictions"]["breakable"][512], out["recommendation"]["backend"]
    """
    fcs = _forecasts(m, None)
    predicted = _predictions(m, fcs, None, m.lengths())
    rec = _recommend(m, fcs)
    params = _parameters(m, rec, fcs)
    costs = m.costs[None]
    forecasts = {}
    for v, fc in fcs.items():
        ladder = default_ladder(m.max_tokens)
        wall, host = _curves(m, _setting(v))
        forecasts[v] = {"available": fc.available, "reason": fc.reason,
                        "graph_memory_bytes": fc.graph_memory_bytes(ladder, costs) if fc.available else None,
                        "build_ms": fc.build_ms(ladder, lambda b, w=wall, h=host: (w(b), h(b)), costs, m.warmup)
                        if fc.available else None, "compile_ms": fc.compile_ms if fc.available else None,
                        "parts": fc.parts.get(m.bucket(m.length) or -1), "graph": {n: m.bucket(n) is not None
                                                                                   for n in m.lengths()},
                        # every replayed length's program by part: what a replay of this file plays
                        "parts_by_length": {n: fc.parts.get(b) for n in m.lengths()
                                            if (b := m.bucket(n)) is not None and b in fc.parts}}
    out: dict[str, Any] = {
        "predictions": predicted,
        "intervals": _intervals(m, fcs, None, m.lengths()),
        "unavailable": {v: fc.reason for v, fc in fcs.items() if not fc.available},
        "forecasts": forecasts,
        "recommendation": {"backend": rec.backend, "ceiling": rec.ceiling, "buckets": rec.buckets,
                           "expected_ms": rec.expected_ms, "eager_expected_ms": rec.eager_ms, "speedup": rec.speedup,
                           "graph_memory_bytes": rec.graph_memory_bytes, "build_ms": rec.build_ms,
                           "memory_budget_bytes": rec.budget_bytes, "reason": rec.reason},
        "options": [{"variant": o.variant, "ceiling": o.ceiling, "num_buckets": len(o.buckets),
                     "expected_ms": o.expected_ms, "expected_interval_ms": list(o.bounds()),
                     "graph_memory_bytes": o.graph_memory_bytes, "build_ms": o.build_ms,
                     "fits": o.fits, "pruned": o.pruned} for o in rec.options],
        "parameters": params,
        "islands": _islands(m, fcs, predicted),
    }
    measured = None
    if m.measured is not None:
        measured = {v: dict(x.ms) for v, x in m.measured.items() if x.available}
        measured.update({k: v for k, v in predicted.items() if parse_variant(k).backend == "eager"})
        out["measured"] = measured
        out["measured_expected_ms"] = _measured_expected(m, measured)
        out["errors"] = errors({v: ms for v, ms in predicted.items() if v in m.measured}, m.measured)
        out["validation"] = {v: {"available": x.available, "error": x.error, "graph_used": x.graph_used,
                                 "build_ms": x.build_ms, "graph_memory_bytes": x.graph_memory_bytes,
                                 "predicted_available": fcs[v].available, "replay": x.replay,
                                 "fallbacks": dict(x.fallbacks)}
                             for v, x in m.measured.items()}
    out["fusion_check"] = _fusion_check(m)
    out["amdahl"] = _amdahl(m, params["dynamic_share"], predicted, measured)
    if m.cores:
        out["cpu_cores"] = _cores(m)
    return out
