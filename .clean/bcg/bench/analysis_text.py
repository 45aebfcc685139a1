"""What ``bcg analyze`` prints: the machine's costs, the seed's four parameters, every variant's predicted (and with
``--validate`` measured) latency, the islands and what each costs, the workload's options and the recommendation,
the per-core-count table, and the verdict. It only formats the analysis dict (:func:`bcg.bench.analyze.run_analyze`),
so every line is tested without an engine.
"""

from __future__ import annotations

from typing import Any

from bcg.bench.tables import fmt, fmt_bytes, table

__all__ = ["format_analysis"]

CPU_NOTE = "CPU emulation: these costs are the emulation's and mean nothing for a GPU"
# What each entry of the machine cache (bcg.bench.machine_cache) holds, as the timings line names it.
_CACHED = {"machine": "microbenchmarks", "paths": "replay-path costs", "device": "kernel device times"}


def _buckets(buckets: list[int]) -> str:
    if not buckets:
        return "-"
    return f"{len(buckets)} ({buckets[0]}..{buckets[-1]})" if len(buckets) > 4 else ", ".join(map(str, buckets))


def _replay_line(variant: str, r: dict[str, Any]) -> str:
    """One measured replay, step by step (:func:`bcg.bench.validate.replay_breakdown`)."""
    return (f"Measured replay of {variant}, bucket {r['bucket']}: {r['num_segments']} segments "
            f"{fmt(r['segments_ms'], 3)} ms, {r['num_breaks']} islands {fmt(r['islands_ms'], 3)} ms (p = "
            f"{fmt(r['p'], 3)} of the replay), the whole replay {fmt(r['replay_ms'], 3)} ms launched in "
            f"{fmt(r['replay_host_ms'], 3)} ms of host time, the eager work around it {fmt(r['outside_ms'], 3)} ms.")


def _chain(c: dict[str, Any], prefix: str = "") -> str:
    """The mixed (or, with ``prefix`` "fused_", the fused) chain's kernels alone and in a graph, µs per kernel ("-"
    where not measured)."""
    n, alone = c.get(f"{prefix}chain_kernels"), c.get(f"{prefix}chain_kernel_us")
    graph = c.get(f"graph_{prefix}chain_us")
    if not n or alone is None or graph is None:
        return "-"
    triton = f", {fmt(c['fused_chain_triton'], 0)} of them Triton's" if prefix and c.get("fused_chain_triton") else ""
    return f"{fmt(alone / n)} / {fmt(graph / n)} ({fmt(n, 0)} kernels{triton})"


def _machine(a: dict[str, Any]) -> str:
    c = a["machine"]["None"]
    rows = [["eager launch (host) / kernel (wall)", f"{fmt(c['eager_launch_us'])} / {fmt(c['eager_kernel_us'])}"],
            ["kernel in a replayed graph (device)", fmt(c["graph_kernel_us"])],
            ["tiny kernel alone (device)", fmt(c["tiny_kernel_us"])],
            ["medium kernel alone / in a graph (device)",
             f"{fmt(c['medium_kernel_us'])} / {fmt(c['graph_medium_kernel_us'])}"],
            ["mixed chain's kernels alone / in a graph (device, per kernel)", _chain(c)],
            ["fused chain's kernels alone / in a graph (device, per kernel)", _chain(c, "fused_")],
            ["graph launch (host) / per node",
             f"{fmt(c['graph_launch_us'])} / {fmt(c['graph_launch_per_node_us'], 3)}"],
            ["break at replay (host) / a segment's start after it (device)",
             f"{fmt(c['break_us'])} / {fmt(c.get('segment_start_us'))}"],
            ["piecewise piece call (host)", fmt(c["piece_us"])],
            ["capture per node / per graph", f"{fmt(c['capture_per_node_us'])} / {fmt(c['capture_per_graph_us'])}"],
            ["graph memory per node / per graph", f"{fmt_bytes(c['graph_node_bytes'])} / "
                                                  f"{fmt_bytes(c['graph_bytes'])}"],
            ["dynamo guards per call (+ per parameter)", f"{fmt(c['guard_us'])} (+{fmt(c['guard_per_param_us'], 3)})"]]
    for compiler, (fixed, per_kernel) in (c.get("compile_ms") or {}).items():
        rows.append([f"compile with {compiler}: fixed (ms) / per kernel (ms)", f"{fmt(fixed, 0)} / "
                                                                                  f"{fmt(per_kernel, 2)}"])
    title = f"Machine (µs unless named; {fmt(c['seconds'], 1)} s of microbenchmarks)"
    if c["emulated"]:
        title += f" - {CPU_NOTE}"
    return table(["cost", "value"], rows, title=title)


def _parameters(a: dict[str, Any]) -> str:
    p, cov = a["parameters"], a["parameters"]["bucket_coverage"]
    gaps = ", ".join(f"{n}: {fmt(g, 2)}" for n, g in p["launch_gap_by_length"].items())
    rows = [["1. launch-gap share (device idle in the eager forward)", f"{fmt(p['launch_gap_share'], 3)} ({gaps})"],
            ["2. dynamic share p (stays eager under breakable)", f"{fmt(p['dynamic_share'], 3)}; S_max = 1/p = "
                                                                 f"{fmt(p['s_max'], 2, 'x')}"],
            ["3. bucket coverage against chunked_prefill_size",
             f"ladder up to {cov['max_bucket']} {'reaches' if cov['reaches_chunk'] else 'stops below'} the chunk "
             f"{cov['chunked_prefill_size']}; {cov['graph_fraction']:.0%} of forwards and "
             f"{cov['graph_token_fraction']:.0%} of tokens replay; padding {cov['padding_waste']:.0%}; "
             f"{len(cov['never_fired'])} of {cov['num_buckets']} buckets never fire"],
            ["4. resident graph memory (recommended ladder)", fmt_bytes(p["resident_graph_memory_bytes"])]]
    return table(["the seed's parameter", "value"], rows, title=f"The four parameters (at {a['length']} tokens)")


def _latency(a: dict[str, Any]) -> str:
    measured, errors = a.get("measured"), a.get("errors") or {}
    intervals = a.get("intervals") or {}
    headers = ["backend", "tokens", "graph", "predicted ms", "interval"] + \
        (["measured ms", "error"] if measured else [])
    rows = []
    for v, by_len in a["predictions"].items():
        graph = (a["forecasts"].get(v) or {}).get("graph", {})
        for n, ms in by_len.items():
            kind = "measured" if v.startswith("eager") else ("yes" if graph.get(n) else "no: eager")
            low, high = (intervals.get(v) or {}).get(n) or (None, None)
            row = [v, n, kind, fmt(ms, 3), "-" if low is None else f"{fmt(low, 3)}-{fmt(high, 3)}"]
            if measured:
                got = (measured.get(v) or {}).get(n)
                err = (errors.get(v) or {}).get(n)
                row += [fmt(got, 3), "-" if err is None else f"{err:+.1%}"]
            rows.append(row)
    title = "Prefill latency, one request (eager: measured; the graph backends: predicted, nothing captured)"
    if measured:
        title = "Prefill latency, one request: predicted before capture, then measured (--validate)"
    return table(headers, rows, title=title)


def _forecasts(a: dict[str, Any]) -> str:
    rows = []
    for v, f in a["forecasts"].items():
        got = (a.get("validation") or {}).get(v) or {}
        rows.append([v, fmt(f["available"]), fmt_bytes(f["graph_memory_bytes"]),
                     fmt(f["build_ms"] and f["build_ms"] / 1e3, 1), fmt(f["compile_ms"] and f["compile_ms"] / 1e3, 1)]
                    + ([fmt(got.get("available")), fmt_bytes(got.get("graph_memory_bytes")),
                        fmt(got.get("build_ms") and got["build_ms"] / 1e3, 1)] if a.get("validation") else []))
    headers = ["backend", "available", "graph memory", "build s", "compile s"]
    if a.get("validation"):
        headers += ["measured: available", "graph memory", "build s"]
    return table(headers, rows, title=f"Each backend with the default ladder up to {a['config']['max_tokens']} "
                                      "(predicted)")


def _islands(a: dict[str, Any]) -> list[str]:
    rows = [[i["name"], i["calls"], fmt(i["host_us"], 1), fmt(i["device_us"], 1), fmt(i["share"], 3)]
            for i in a["islands"]]
    if not rows:
        return ["Islands: none (nothing stays eager)"]
    out = [table(["island", "calls", "host us/call", "device us/call", "share of breakable"], rows,
                 title=f"Islands at {a['length']} tokens (what stays eager under breakable), costliest first")]
    auto = a["model"].get("auto_islands") or []
    if auto:
        out += ["Modules run as automatic islands (a graph cannot capture them):"] + [f"  {m}" for m in auto]
    return out


def _options(a: dict[str, Any]) -> str:
    rec = a["recommendation"]
    rows = [[o["variant"], fmt(o["ceiling"]), fmt(o["num_buckets"]) if o["ceiling"] else "-",
             fmt(o["expected_ms"], 3), fmt_bytes(o["graph_memory_bytes"]), fmt(o["build_ms"] / 1e3, 1),
             "yes" if o["fits"] else "no", "<-" if o["variant"] == rec["backend"] else ""] for o in a["options"]]
    budget = rec["memory_budget_bytes"]
    return table(["option", "ceiling", "buckets", "expected ms", "graph memory", "build s", "fits", ""], rows,
                 title=f"Workload ({a['workload']['source']}): expected ms per prompt, graph-memory budget "
                       f"{fmt_bytes(budget) if budget else 'none'}")


def _cores(a: dict[str, Any]) -> str:
    data = a["cpu_cores"]
    variants = list(next(iter(data.values()))["predictions"])
    has_measured = any("measured" in r for r in data.values())
    headers = ["cores", "launch gap"] + [f"{v} pred" for v in variants] + \
        ([f"{v} meas" for v in variants] if has_measured else [])
    rows = []
    for k, r in data.items():
        row = [k, fmt(r["launch_gap_share"], 3)] + [fmt(r["predictions"].get(v), 3) for v in variants]
        if has_measured:
            row += [fmt((r.get("measured") or {}).get(v), 3) for v in variants]
        rows.append(row)
    text = table(headers, rows, title=f"The host as a variable: pinned to each core count, at {a['length']} tokens "
                                      "(ms)")
    fell = [f"Not measured on {k} cores: {v} ({why})" for k, r in data.items()
            for v, why in (r.get("fallbacks") or {}).items()]
    return "\n".join([text, *fell])


def format_analysis(a: dict[str, Any]) -> str:
    """The analysis as readable text (see the module doc)."""
    m = a["model"]
    out = [f"bcg analyze: {m['name']} ({m['arch']}, {m['num_layers']} layers, {m['num_params'] / 1e6:.1f}M params, "
           f"{m['dtype']} on {m['device']})", "", _machine(a), "", _parameters(a), "", _latency(a)]
    if a.get("notes"):
        out += [""] + [f"Note: {n}" for n in a["notes"]]
    if a["unavailable"]:
        out += ["", "Predicted unavailable:"] + [f"  {v}: {why}" for v, why in a["unavailable"].items()]
    out += ["", _forecasts(a), ""] + _islands(a) + ["", _options(a)]
    rec = a["recommendation"]
    out.append(f"Recommendation: {rec['backend']}, max_tokens={fmt(rec['ceiling'])}, buckets {_buckets(rec['buckets'])}"
               f" ({rec['reason']}).")
    for variant, v in (a.get("validation") or {}).items():
        out += [_replay_line(variant, r) for r in (v.get("replay"), v.get("replay_short"))
                if r and r.get("bucket") is not None]
    fc = (a.get("fusion_check") or {}).get(a["length"]) or (a.get("fusion_check") or {}).get(str(a["length"]))
    if fc:
        out.append(f"Fusion rule at {a['length']} tokens: the graph work's kernels take {fmt(fc['torch_us'], 0)} µs, "
                   f"fused by the rule {fmt(fc['rule_us'], 0)} µs, and the fused kernels ran it in "
                   f"{fmt(fc['fused_kernels_us'], 0)} µs.")
    if a.get("cpu_cores"):
        out += ["", _cores(a)]
    out += ["", _timings(a["timings"]), "", "Verdict: " + a["verdict"]["sentence"]]
    return "\n".join(out)


def _profiler_own(sub: dict[str, float]) -> str:
    """Of the profiled forwards' time, the profiler's own start and stop ("" for a run that did not time them)."""
    if "start" not in sub or "stop" not in sub:
        return ""
    return f" (starting the profiler {fmt(sub['start'], 2)} s, stopping it {fmt(sub['stop'], 2)} s)"


def _timings(t: dict[str, Any]) -> str:
    """Where predicting spent its time, by part, and where the machine's costs came from."""
    line = f"Predicting took {fmt(t['predict_s'], 1)} s"
    if t.get("parts_s"):
        sub = t.get("profiles_s") or {}
        line += " (" + ", ".join(f"{name} {fmt(s, 2)} s" + (
            f" [running {fmt(sub['run'], 2)} s{_profiler_own(sub)}, reading {fmt(sub['read'], 2)} s]"
            if name == "profiles" and sub else "")
            for name, s in t["parts_s"].items()) + ")"
    if t.get("validate_s"):
        line += (f", validating {fmt(t['validate_s'], 1)} s (predicting is {fmt(t['predict_over_validate'], 2)} of "
                 "it)")
    line += "."
    cache = t.get("machine_cache") or {}
    sources = cache.get("sources") or {}
    disk = [_CACHED[what] for what, src in sources.items() if src == "disk"]
    kept = [_CACHED[what] for what in cache.get("files") or {} if sources.get(what) != "disk"]
    if disk:
        line += (f" This machine's {' and '.join(disk)} came from the cache in {cache['dir']} (--machine-cache "
                 "refresh measures them again).")
    if kept:
        line += f" This machine's {' and '.join(kept)} were measured and kept in {cache['dir']} for the next run."
    return line
