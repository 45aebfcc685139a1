"""From what ``bcg analyze`` measured to what it reports: every variant's predicted latency per length, the
recommendation, the seed's four parameters, the islands and what each costs, the Amdahl point and the per-core-count
table, as plain data (the JSON of results.json).

:func:`findings` is pure: it takes :class:`~bcg.bench.measurements.Measurements` (host times per core count, profiled
forwards, the machine's costs, the workload, optionally the validation; re-exported here) and computes; tests feed it
synthetic ones with known answers. The sections about the model beside the predictions (islands, parameters, Amdahl
point, fusion check) are :mod:`bcg.bench.diagnostics`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bcg.bench import amdahl
from bcg.bench.diagnostics import amdahl_point, fusion_check, islands, parameters
from bcg.bench.forecast import Forecast, ForecastContext, forecast
from bcg.bench.measurements import Measurements
from bcg.bench.predict import HostTimes, islands_by_setting, replay_islands
from bcg.bench.recommend import Recommendation, eager_curve, expected_ms, recommend
from bcg.bench.validate import errors
from bcg.bench.variants import parse_variant
from bcg.runtime.runner.buckets import BucketTable, default_ladder

__all__ = ["EAGER_OF", "Measurements", "findings"]

EAGER_OF = {"torch": "eager", "fused": "eager+fused"}  # the eager variant of each kernels setting


def _setting(variant: str) -> str:
    return parse_variant(variant).kernels


def _forecasts(m: Measurements, k: int | None) -> dict[str, Forecast]:
    ctx = ForecastContext(m.costs[k], m.emulated, m.tc_compiler, m.num_params, m.warmup)
    # islands at the host cost a replay pays, not an eager forward's (one whose kernels differ by setting: its own)
    own = islands_by_setting({s: by_size[m.length].trace for s, by_size in m.profiles.items() if m.length in by_size})
    hosts = replay_islands(m.hosts[k], own)
    out = {}
    for v in m.variants:
        setting = _setting(v)
        profiles = {n: replace(p, host=hosts[setting][n]) for n, p in m.profiles[setting].items()}
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


def _refused_when_built(m: Measurements, fcs: dict[str, Forecast]) -> dict[str, Forecast]:
    """``fcs`` with every variant the validation could not build marked unavailable, with its build's error: a
    backend predicted to capture but refused when built (torch.compile specialising the token count while compiling,
    say) must not be recommended. Without a validation, ``fcs`` as they are."""
    if m.measured is None:
        return fcs
    refused = {v: x.error for v, x in m.measured.items() if not x.available and v in fcs and fcs[v].available}
    return {v: replace(fc, available=False, reason=f"predicted to capture, but its build failed: {refused[v]}")
            if v in refused else fc for v, fc in fcs.items()}


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
    rec = _recommend(m, _refused_when_built(m, fcs))
    params = parameters(m, rec, fcs)
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
        "islands": islands(m, fcs, predicted),
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
                                 "replay_short": x.replay_short, "fallbacks": dict(x.fallbacks)}
                             for v, x in m.measured.items()}
    out["fusion_check"] = fusion_check(m)
    out["amdahl"] = amdahl_point(m, params["dynamic_share"], predicted, measured)
    if m.cores:
        out["cpu_cores"] = _cores(m)
    return out
