"""The judgment of ``bcg analyze``: the verdict sentence and the readable report of an analysis dict.

:mod:`bcg.bench.analyze` measures; this module only reads its plain-data result, so the judgment can be tested
without an engine.
"""

from __future__ import annotations

from typing import Any

from bcg.bench.report import fmt, fmt_bytes, table

__all__ = ["MEMORY_SHARE_LIMIT", "PAYS_THRESHOLD", "format_analysis", "verdict"]

# Below a 5% gain the extra capture time and resident memory are not worth it.
PAYS_THRESHOLD = 1.05
# Resident graphs above this share of free memory eat into the KV cache noticeably.
MEMORY_SHARE_LIMIT = 0.10


def verdict(a: dict[str, Any]) -> dict[str, Any]:
    """Judges from an analysis dict: does breakable pay, and which capture ceiling to use; one sentence.

    Example::

        verdict(analysis)["sentence"]   # "Breakable graphs pay here: 1.84x measured ..."
    """
    t, am, cov, mem = a["timing"], a["amdahl"], a["coverage"], a["memory"]
    speedup = t.get("measured_speedup")
    pays = speedup is not None and speedup >= PAYS_THRESHOLD
    chunk, ceiling = cov["chunked_prefill_size"], cov["recommended_ceiling"]
    share = mem.get("graph_share_of_free")
    too_big = share is not None and share > MEMORY_SHARE_LIMIT
    where = f"at {t['length']} tokens"
    # S_max = 1/p bounds what capturing the islands too could still win over this replay; the bound over eager
    # (islands and host work kept, everything else free) is the other number a reader compares with.
    bound = (f"islands are p={fmt(am.get('p'))} of a replay, so at most S_max={fmt(am.get('s_max'))}x more from "
             f"capturing them and {fmt(am.get('s_max_over_eager'))}x over eager" if am.get("p") is not None
             else "p unknown")
    if t.get("launch_bound") is not None:
        # What no launch path can beat without fusing kernels: how far a speedup target is reachable at all.
        bound += f"; no graph beats eager by more than {t['launch_bound']:.2f}x here without fusing kernels"
    if pays and not too_big:
        head = (f"Breakable graphs pay here: {speedup:.2f}x measured (predicted {fmt(am.get('predicted_speedup'))}x, "
                f"{bound}) {where}")
    elif pays:
        head = (f"Breakable graphs are faster here ({speedup:.2f}x {where}) but their resident memory is "
                f"{share:.0%} of free memory; lower the ceiling only if the KV cache needs it")
    else:
        head = (f"Breakable graphs do not pay here: {fmt(speedup)}x {where} ({bound}); use backend eager")
    gap = t.get("launch_gap_share")
    if not pays and gap is not None:
        head += f" - the eager forward is only {gap:.0%} launch gap"
    label = "= chunked_prefill_size" if ceiling == chunk else "covers every forward of this workload"
    tail = (f"; if you do use them, set the capture ceiling to {ceiling} ({label}): "
            f"{cov['graph_fraction']:.0%} of forwards replay, {len(cov['never_fired'])} of "
            f"{cov['num_buckets']} buckets never fire")
    if pays and not too_big:
        tail = tail.replace("if you do use them, set", "set")
    sentence = head + tail + "."
    if a["environment"].get("emulated"):
        # CPU timings carry no launch overhead, so they cannot say whether graphs pay on a GPU.
        pays = None
        sentence = (f"CPU emulation: these timings show no kernel-launch overhead, so whether breakable graphs pay "
                    f"cannot be judged here (measured {fmt(speedup)}x, {bound} {where}); run bcg analyze on the "
                    f"GPU. On this workload set the capture ceiling to {ceiling} ({label}): "
                    f"{cov['graph_fraction']:.0%} of forwards replay, {len(cov['never_fired'])} of "
                    f"{cov['num_buckets']} buckets never fire.")
    return {"pays": pays, "recommended_ceiling": ceiling, "sentence": sentence}


def format_analysis(a: dict[str, Any]) -> str:
    """The analysis as readable text: timing, islands, coverage, memory and the verdict."""
    t, am, rep, cov, mem = a["timing"], a["amdahl"], a["replay"], a["coverage"], a["memory"]
    m = a["model"]
    out = [f"bcg analyze: {m['name']} ({m['arch']}, {m['num_layers']} layers, {m['num_params'] / 1e6:.1f}M params, "
           f"{m['dtype']} on {m['device']})", ""]
    out.append(table(["quantity", "value"], [
        ["input length (tokens)", t["length"]],
        ["eager forward (ms)", fmt(t["eager_forward_ms"], 3)],
        ["eager kernel time (ms)", fmt(t["eager_kernel_ms"], 3)],
        ["launch-gap share", fmt(t["launch_gap_share"], 3)],
        ["bound without fusion (eager / kernel)", fmt(t.get("launch_bound"), 2, "x")],
        ["breakable forward (ms)", fmt(t["breakable_forward_ms"], 3)],
        ["p (island share of replay)", fmt(am.get("p"), 3)],
        ["S_max = 1/p", fmt(am.get("s_max"), 2, "x")],
        ["S_max over eager", fmt(am.get("s_max_over_eager"), 2, "x")],
        ["predicted speedup", fmt(am.get("predicted_speedup"), 2, "x")],
        ["measured speedup", fmt(t["measured_speedup"], 2, "x")],
        ["prediction error", fmt(am.get("prediction_error"), 3)],
    ], title="Timing and Amdahl"))
    if rep.get("bucket") is not None:
        rows = [[i["name"], i["count"], fmt(i["ms"], 3), fmt(i["share"], 3)] for i in rep["islands"]]
        rows.append(["(segments)", rep["num_segments"], fmt(rep["segments_ms"], 3), "-"])
        rows.append(["(outside graph)", "-", fmt(rep["outside_ms"], 3), "-"])
        out += ["", table(["step", "count", "ms", "share of replay"], rows,
                          title=f"Replay of bucket {rep['bucket']}: islands, costliest first")]
        ratio = rep["host_over_device"]
        bound = ("CPU emulation: the host runs everything" if a["environment"].get("emulated")
                 else "host-bound: cheaper islands would pay" if ratio > 0.9
                 else "device-bound: island host work is hidden")
        out.append(f"Replay launch on the host {fmt(rep['replay_host_ms'], 3)} ms vs {fmt(rep['replay_ms'], 3)} ms "
                   f"on the device (host/device {fmt(ratio, 2)}; {bound}).")
    never = cov["never_fired"]
    out += ["", table(["quantity", "value"], [
        ["prompts / forwards", f"{cov['num_prompts']} / {cov['num_forwards']}"],
        ["forwards replaying a graph", fmt(cov["graph_fraction"], 3)],
        ["tokens through a graph", fmt(cov["graph_token_fraction"], 3)],
        ["padding waste", fmt(cov["padding_waste"], 3)],
        ["ladder reaches chunk", f"{fmt(cov['reaches_chunk'])} (max bucket {cov['max_bucket']}, "
                                 f"chunk {cov['chunked_prefill_size']})"],
        ["eager reasons", ", ".join(f"{k}: {v}" for k, v in cov["eager_reasons"].items()) or "-"],
        ["buckets never fired", f"{len(never)} of {cov['num_buckets']}"
                                + (f" ({', '.join(map(str, never[:12]))}{' ...' if len(never) > 12 else ''})"
                                   if never else "")],
        ["resident graph memory", fmt_bytes(mem["graph_memory_bytes"])],
        ["free device memory", fmt_bytes(mem["free_bytes"])],
        ["graph share of free", fmt(mem["graph_share_of_free"], 4)],
    ], title="Coverage and memory")]
    out += ["", "Verdict: " + a["verdict"]["sentence"]]
    return "\n".join(out)
