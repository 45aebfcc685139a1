"""Notes `bcg analyze` prints beside its predictions: where the profile or the prediction model is known to fall
short for this model, said rather than left silent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bcg.bench.findings import EAGER_OF, Measurements
from bcg.bench.trace import regions
from bcg.bench.variants import parse_variant

__all__ = ["compile_notes", "trace_notes"]


def trace_notes(m: Measurements) -> list[str]:
    """What the profile of ``m`` could not attribute: an island none of whose calls got a kernel (every island the
    models mark launches at least one), so its device time was counted as graph work."""
    notes = []
    for setting, by_size in m.profiles.items():
        rs = [r for r in regions(by_size[m.length].trace) if r.island is not None]
        names = {r.island.name for r in rs} - {r.island.name for r in rs if r.kernels}
        notes += [f"{EAGER_OF[setting]}: the profile matched no kernel to island {n} (neither its launches' "
                  "correlation ids nor their ops were recorded); its kernels count as graph work in the predictions"
                  for n in sorted(names)]
    return notes


def compile_notes(backends: Sequence[str], model: dict[str, Any]) -> list[str]:
    """What a compiled variant among ``backends`` runs that the eager profile of ``model`` (results.json's ``model``)
    does not show: islands that only compiling creates, whose host time the predictions leave out.

    Example::

        compile_notes(["breakable", "breakable+inductor"], {"compile_only_islands": ["sparse attention"]})
        # ['breakable+inductor: compiled, this model runs its sparse attention as an island in every layer ...']
    """
    extra = model.get("compile_only_islands") or []
    compiled = [v for v in backends if parse_variant(v).compile and parse_variant(v).backend == "breakable"]
    if not extra or not compiled:
        return []
    return [f"{', '.join(compiled)}: compiled, this model runs its {', '.join(extra)} as an island in every layer "
            "(bcg/ops/region_islands.py), which its eager profile does not show; the predictions leave out those "
            "islands' host time and are low (on the H200, glm-dsa's compiled replay spent 12.2 ms in 24 of them at "
            "512 tokens, and its prediction was 10-50% under)"]
