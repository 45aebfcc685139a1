"""The judgment of ``bcg analyze`` in one paragraph: what to run (backend, capture ceiling, buckets) and why, the
seed's four parameters that decide it, and, after ``--validate``, how the measurement agrees.

:mod:`bcg.bench.findings` computes; this module only reads its plain-data result, so the judgment can be tested
without an engine (:mod:`bcg.bench.text` prints it with the rest of the analysis).
"""

from __future__ import annotations

from typing import Any

from bcg.bench.tables import fmt, fmt_bytes

__all__ = ["MEMORY_SHARE_LIMIT", "PAYS_THRESHOLD", "fastest_measured", "verdict"]

# Below a 5% gain the extra capture time and resident memory are not worth it.
PAYS_THRESHOLD = 1.05
# Resident graphs above this share of the memory the weights leave free eat into the KV cache noticeably: the default
# graph-memory budget.
MEMORY_SHARE_LIMIT = 0.10


def fastest_measured(a: dict[str, Any]) -> tuple[str, float] | None:
    """The variant whose measured expected latency per prompt of the workload is lowest (``--validate``), or None."""
    at = {v: ms for v, ms in (a.get("measured_expected_ms") or {}).items() if ms is not None}
    return min(at.items(), key=lambda kv: kv[1]) if at else None


def verdict(a: dict[str, Any]) -> dict[str, Any]:
    """Judges from an analysis dict; returns ``pays`` (graphs recommended; None on a CPU), the recommended backend
    and ceiling, and the sentence.

    Example::

        verdict(analysis)["sentence"]   # "Use breakable+fused with max_tokens=2048 (42 buckets): predicted ..."
    """
    rec, params = a["recommendation"], a["parameters"]
    cov = params["bucket_coverage"]
    graphs = rec["ceiling"] is not None
    if graphs:
        head = (f"Use {rec['backend']} with max_tokens={rec['ceiling']} ({len(rec['buckets'])} buckets): predicted "
                f"{fmt(rec['expected_ms'], 3)} ms per prompt on this workload against "
                f"{fmt(rec['eager_expected_ms'], 3)} ms eager ({fmt(rec['speedup'], 2, 'x')}), "
                f"{fmt_bytes(rec['graph_memory_bytes'])} of graph memory, {fmt(rec['build_ms'] / 1e3, 1)} s to build; "
                f"{rec['reason']}.")
    else:
        head = f"Run eagerly ({rec['backend']}): {rec['reason']}."
    p = params.get("dynamic_share")
    gap = params.get("launch_gap_share")
    facts = (f" The eager forward is {fmt(gap, 2) if gap is None else f'{gap:.0%}'} launch gap; the dynamic share "
             f"that stays eager is p={fmt(p, 3)} (so at most {fmt(params.get('s_max'), 2, 'x')} over eager); the "
             f"buckets {'reach' if cov['reaches_chunk'] else 'stop below'} chunked_prefill_size "
             f"{cov['chunked_prefill_size']} and {cov['graph_fraction']:.0%} of forwards replay; resident graph "
             f"memory {fmt_bytes(params['resident_graph_memory_bytes'])}.")
    sentence = head + facts
    fastest = fastest_measured(a)
    got = (a.get("measured_expected_ms") or {}).get(rec["backend"])
    if fastest is not None and got:
        name, ms = fastest
        gap = "the fastest measured" if name == rec["backend"] else f"{got / ms - 1:+.1%} against the fastest, {name}"
        sentence += (f" Measured on this workload: {rec['backend']} {fmt(got, 3)} ms per prompt ({gap}, "
                     f"{fmt(ms, 3)} ms).")
    if a["environment"].get("emulated"):
        # CPU timings carry no launch overhead, so they cannot say whether graphs pay on a GPU.
        sentence = ("CPU emulation: these timings show no kernel-launch overhead, so this judgment reflects the "
                    "emulation, not a GPU; run bcg analyze on the GPU. " + sentence)
        return {"pays": None, "backend": rec["backend"], "recommended_ceiling": rec["ceiling"], "sentence": sentence}
    return {"pays": graphs, "backend": rec["backend"], "recommended_ceiling": rec["ceiling"], "sentence": sentence}
