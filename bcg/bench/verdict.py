"""The judgment of ``bcg analyze``: does breakable pay, with which capture ceiling, in one sentence.

:mod:`bcg.bench.analyze` measures; this module only reads its plain-data result, so the judgment can be tested
without an engine (:mod:`bcg.bench.text` prints it with the rest of the analysis).
"""

from __future__ import annotations

from typing import Any

from bcg.bench.tables import fmt

__all__ = ["MEMORY_SHARE_LIMIT", "PAYS_THRESHOLD", "verdict"]

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
