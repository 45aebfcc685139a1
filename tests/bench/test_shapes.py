"""bcg.bench.shapes: models for benchmarks by name, with config overrides."""

from __future__ import annotations

import pytest

from bcg.bench.shapes import model_spec


def test_model_spec_replaces_config_fields_and_names_a_bad_one() -> None:
    spec = model_spec("llama-dense+vocab_size=151936+tie_word_embeddings=True+rope_theta=1e6")
    assert (spec.vocab_size, spec.tie_word_embeddings, spec.rope_theta, spec.num_layers) == (151936, True, 1e6, 28)
    assert model_spec("qwen3-0.6b+qk_norm=False").head_dim == 128  # a real model's shape
    assert model_spec("tiny-dense") == "tiny-dense"  # no overrides: the name, as Engine takes it
    with pytest.raises(ValueError, match="not field=value of a ModelConfig field"):
        model_spec("llama-dense+vocab=5")
    with pytest.raises(ValueError, match="no int, float or True/False"):
        model_spec("llama-dense+vocab_size=lots")
