"""The notes `bcg analyze` prints where the prediction model is known to fall short: islands that only compiling
creates (tiny-dsa under the CPU emulation: compiled, its sparse attention breaks the graph in every layer)."""

from __future__ import annotations

from bcg.bench.engines import BuildRecord, EngineSpec, engine_for
from bcg.bench.notes import compile_notes
from bcg.runtime.config import EngineConfig


def test_a_compiled_dsa_model_breaks_at_its_sparse_attention_in_every_layer() -> None:
    spec = EngineSpec("tiny-dsa", EngineConfig(device="cpu", chunked_prefill_size=16, kv_tokens=64, buckets=[16],
                                               progress=False))
    records = {v: BuildRecord(v) for v in ("breakable", "breakable+traced")}
    for variant, record in records.items():
        with engine_for(spec, variant, record) as eng:
            assert eng is not None, record.error
            islands = eng.model.compile_only_islands
            layers = eng.model.config.num_layers
    assert islands == ("sparse attention",)
    # what the note warns of: one more island a layer once compiled
    assert records["breakable+traced"].num_breaks == records["breakable"].num_breaks + layers


def test_the_note_names_the_compiled_variants_and_the_islands() -> None:
    model = {"compile_only_islands": ["sparse attention"]}
    notes = compile_notes(["breakable", "breakable+fused", "breakable+inductor"], model)
    assert len(notes) == 1 and notes[0].startswith("breakable+inductor: compiled")
    assert "sparse attention" in notes[0] and "leave out" in notes[0]
    assert compile_notes(["breakable", "full"], model) == []  # nothing compiled: nothing left out
    assert compile_notes(["breakable+inductor"], {"compile_only_islands": []}) == []
