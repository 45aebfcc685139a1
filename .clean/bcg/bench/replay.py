"""What ``bcg analyze`` predicted from, saved and read back: a run's :class:`~bcg.bench.findings.Measurements` as plain
JSON (``inputs.json`` beside ``results.json``), so its predictions can be computed again elsewhere, by a later
prediction model: a GPU run's measurements replayed on a CPU show what a change to the model does to its errors
without a GPU (tests/bench/test_analyze_evidence.py).

The file holds the machine's costs per core count, the host times of every size (with their quartiles), every
profiled trace (each kernel's name, op, device µs at the median and the ends of its interval, island and launch time;
each island call), the workload and the run's settings, and with ``--validate`` what was measured. Strings (kernel
names, ops, islands) are kept once in a table and referred to by index: a 28-layer model's kernels repeat per layer.

Example::

    inputs = dump(measurements)                 # plain data; json.dumps(inputs) is the file
    findings(load(inputs))["predictions"]       # what the run predicted, computed again
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bcg.bench.findings import Measurements
from bcg.bench.forecast import Profiled
from bcg.bench.machine import MachineCosts
from bcg.bench.predict import HostTimes
from bcg.bench.recommend import Workload
from bcg.bench.trace import ForwardTrace, IslandCall, Kernel
from bcg.bench.validate import Measured

__all__ = ["SCHEMA", "dump", "load"]

SCHEMA = "bcg.analyze-inputs/1"
_HOST_FIELDS = [f.name for f in dataclasses.fields(HostTimes) if f.name not in ("low", "high")]
_SETTINGS = ("variants", "chunk", "max_tokens", "length", "predict_lengths", "num_params", "emulated", "tc_compiler",
             "padding", "warmup", "budget_bytes", "cores")


class _Strings:
    """A table of strings referred to by index."""

    def __init__(self, table: list[str] | None = None) -> None:
        self.table = list(table or [])
        self._index = {s: i for i, s in enumerate(self.table)}

    def __call__(self, s: str | None) -> int | None:
        if s is None:
            return None
        if s not in self._index:
            self._index[s] = len(self.table)
            self.table.append(s)
        return self._index[s]

    def get(self, i: int | None) -> str | None:
        return None if i is None else self.table[i]


def _dump_trace(t: ForwardTrace | None, low: ForwardTrace | None, high: ForwardTrace | None, s: _Strings
                ) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"kernels": [[s(k.name), s(k.op), k.device_us, s(k.island), k.is_copy, k.host_us] for k in t.kernels],
            "low": None if low is None else [k.device_us for k in low.kernels],
            "high": None if high is None else [k.device_us for k in high.kernels],
            "calls": [[s(c.name), c.index, c.start_us] for c in t.calls]}


def _load_trace(d: dict[str, Any] | None, s: _Strings) -> tuple[ForwardTrace | None, ...]:
    if d is None:
        return None, None, None
    kernels = [Kernel(s.get(n), s.get(op), us, s.get(island), copy, host) for n, op, us, island, copy, host in
               d["kernels"]]
    calls = [IslandCall(s.get(n), index, start) for n, index, start in d["calls"]]

    def at(times: list[float] | None) -> ForwardTrace | None:
        if times is None:
            return None
        return ForwardTrace([dataclasses.replace(k, device_us=us) for k, us in zip(kernels, times)], list(calls))

    return ForwardTrace(kernels, calls), at(d["low"]), at(d["high"])


def _dump_host(h: HostTimes) -> dict[str, Any]:
    out = {f: getattr(h, f) for f in _HOST_FIELDS}
    out["bounds"] = [None if b is None else {f: getattr(b, f) for f in _HOST_FIELDS} for b in (h.low, h.high)]
    return out


def _load_host(d: dict[str, Any]) -> HostTimes:
    def one(x: dict[str, Any]) -> HostTimes:
        return HostTimes(**{f: x[f] for f in _HOST_FIELDS if f in x})

    h = one(d)
    h.low, h.high = (None if b is None else one(b) for b in d.get("bounds") or (None, None))
    return h


def _dump_profile(p: Profiled, s: _Strings) -> dict[str, Any]:
    return {"size": p.size, "trace": _dump_trace(p.trace, p.trace_low, p.trace_high, s),
            "full_trace": _dump_trace(p.full_trace, p.full_trace_low, p.full_trace_high, s),
            "full_error": p.full_error, "full_islands": list(p.full_islands), "activation_bytes": p.activation_bytes,
            "full_activation_bytes": p.full_activation_bytes, "profiles": p.profiles}


def _load_profile(d: dict[str, Any], host: HostTimes, s: _Strings) -> Profiled:
    trace, low, high = _load_trace(d["trace"], s)
    full, full_low, full_high = _load_trace(d["full_trace"], s)
    return Profiled(d["size"], trace, host, full_trace=full, full_error=d["full_error"],
                    full_islands=list(d["full_islands"]), activation_bytes=d["activation_bytes"],
                    full_activation_bytes=d["full_activation_bytes"], trace_low=low, trace_high=high,
                    full_trace_low=full_low, full_trace_high=full_high, profiles=d.get("profiles", 1))


def _key(k: int | None) -> str:
    return "None" if k is None else str(k)


def _unkey(k: str) -> int | None:
    return None if k == "None" else int(k)


def dump(m: Measurements) -> dict[str, Any]:
    """``m`` as plain JSON data (see the module doc); :func:`load` reads it back."""
    s = _Strings()
    return {
        "schema": SCHEMA,
        "settings": {name: getattr(m, name) for name in _SETTINGS},
        "workload": {"lengths": list(m.workload.lengths), "source": m.workload.source},
        "costs": {_key(k): dataclasses.asdict(c) for k, c in m.costs.items()},
        "hosts": {_key(k): {setting: {str(n): _dump_host(h) for n, h in by_size.items()}
                            for setting, by_size in by_setting.items()} for k, by_setting in m.hosts.items()},
        "profiles": {setting: {str(n): _dump_profile(p, s) for n, p in by_size.items()}
                     for setting, by_size in m.profiles.items()},
        "measured": None if m.measured is None else {v: dataclasses.asdict(x) for v, x in m.measured.items()},
        "strings": s.table,
    }


def _measured(d: dict[str, Any]) -> Measured:
    ints = {f: {int(n): v for n, v in d.get(f, {}).items()} for f in ("ms", "graph_used")}
    by_cores = {int(k): {int(n): v for n, v in by_len.items()} for k, by_len in d.get("by_cores", {}).items()}
    return Measured(**{**d, **ints, "by_cores": by_cores})


def load(d: dict[str, Any]) -> Measurements:
    """The :class:`~bcg.bench.findings.Measurements` :func:`dump` wrote; a ValueError names what is not such a file.

    Example::

        m = load(json.loads(Path("out/analyze/inputs.json").read_text()))
        findings(m)["predictions"]["breakable"]
    """
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ValueError(f"not the inputs of a bcg analyze run (schema {SCHEMA!r} expected, got "
                         f"{d.get('schema') if isinstance(d, dict) else type(d).__name__!r})")
    s = _Strings(d["strings"])
    settings = dict(d["settings"], padding=tuple(d["settings"]["padding"]))
    costs = {}
    for k, c in d["costs"].items():
        c = dict(c, compile_ms={name: tuple(x) for name, x in c.get("compile_ms", {}).items()})
        costs[_unkey(k)] = MachineCosts(**c)
    hosts = {_unkey(k): {setting: {int(n): _load_host(h) for n, h in by_size.items()}
                         for setting, by_size in by_setting.items()} for k, by_setting in d["hosts"].items()}
    profiles = {setting: {int(n): _load_profile(p, hosts[None][setting][int(n)], s) for n, p in by_size.items()}
                for setting, by_size in d["profiles"].items()}
    measured = None if d["measured"] is None else {v: _measured(x) for v, x in d["measured"].items()}
    return Measurements(workload=Workload(tuple(d["workload"]["lengths"]), d["workload"]["source"]), costs=costs,
                        hosts=hosts, profiles=profiles, measured=measured, **settings)
