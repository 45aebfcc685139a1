"""Every bad prompt, option and checkpoint gets a clear error naming the argument, and leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_cache import EngineCache

from bcg.models.loader import CheckpointError
from bcg.runtime import Engine, EngineConfig

engine = EngineCache(buckets=[8, 16], chunked_prefill_size=16, kv_tokens=256, device="cpu")


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ([(t for t in [1, 2, 3])], TypeError, "prompt 0 is a generator.*list"),
        ([[1, 2], {3, 1, 2}], TypeError, "prompt 1 is a set.*order"),
        ([None], TypeError, "prompt 0 is None"),
        ([7], TypeError, r"prompt 0 is an int.*\[\[7\]\]"),
        ([[1], [2**70]], ValueError, f"prompt 1 has token id {2**70} outside the vocabulary"),
        ([[1, -(2**70)]], ValueError, f"token id {-(2**70)} outside the vocabulary"),
        ([[1], [5, -1]], ValueError, "prompt 1 has token id -1 outside the vocabulary"),
        ([[1, True]], TypeError, "prompt 0 must contain Python ints"),
        ([list(range(200)) * 21], ValueError, "prompt 0 has 4200 tokens.*max_position_embeddings=4096"),
        ((p for p in [[1]]), TypeError, "list of prompts"),
    ],
    ids=["generator", "set", "none", "int", "huge_id", "huge_negative_id", "negative_id", "bool", "too_long",
         "generator_list"],
)
def test_bad_prompts_are_named(bad, error, match) -> None:
    eng = engine("tiny-dense", "breakable")
    free = eng.kv_pool.num_free
    with pytest.raises(error, match=match):
        eng.prefill(bad)
    assert eng.kv_pool.num_free == free


def test_sequences_and_integer_arrays_are_prompts() -> None:
    import numpy as np

    eng = engine("tiny-dense", "breakable")
    expected = eng.prefill([[4, 5, 6]]).logits
    for prompt in ((4, 5, 6), range(4, 7), np.array([4, 5, 6], dtype=np.int32), torch.tensor([4, 5, 6]),
                   [np.int64(4), np.int32(5), 6]):  # numpy's integer scalars, as numpy's integer arrays
        assert torch.equal(eng.prefill([prompt]).logits, expected)
    with pytest.raises(TypeError, match="prompt 0 must contain Python ints or numpy integer scalars"):
        eng.prefill([[4, np.bool_(True)]])


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"chunked_prefill_size": "64"}, TypeError, "chunked_prefill_size must be an int.*'64'"),
        ({"chunked_prefill_size": 64.0}, TypeError, "chunked_prefill_size must be an int"),
        ({"chunked_prefill_size": 0}, ValueError, "chunked_prefill_size must be >= 1"),
        ({"buckets": [True]}, TypeError, "buckets must be a list of positive ints"),
        ({"buckets": 16}, TypeError, "buckets must be a list of positive ints"),
        ({"buckets": [8, 0]}, ValueError, "buckets must be a list of positive ints"),
        ({"buckets": []}, ValueError, "buckets"),
        ({"kv_tokens": 0}, ValueError, "kv_tokens must be >= 1"),
        ({"kv_tokens": -8}, ValueError, "kv_tokens must be >= 1"),
        ({"max_padding_factor": float("nan")}, ValueError, "max_padding_factor must be a number >= 1"),
        ({"max_padding_factor": "2"}, TypeError, "max_padding_factor must be a number"),
        ({"max_padding_tokens": -1}, ValueError, "max_padding_tokens must be >= 0"),
        ({"max_replay_failures": 0}, ValueError, "max_replay_failures must be >= 1"),
        ({"kv_memory_fraction": 1.5}, ValueError, "kv_memory_fraction"),
        ({"kv_memory_fraction": float("nan")}, ValueError, "kv_memory_fraction"),
        ({"device": "meta"}, ValueError, "device 'meta' is not supported.*'cpu' or 'cuda'"),
        ({"device": "gpu0"}, ValueError, "device 'gpu0'"),
        ({"device": 3}, TypeError, "device must be"),
        ({"dtype": "int8"}, ValueError, "dtype must be a floating"),
        ({"dtype": torch.int64}, ValueError, "dtype must be a floating"),
        ({"dtype": 16}, TypeError, "dtype must be"),
        ({"warmup": -1}, ValueError, "warmup must be >= 0"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
        ({"leak_check": "loud"}, ValueError, "leak_check must be one of off, warn, raise"),
        ({"debug": "no"}, TypeError, "debug must be True or False, got 'no'"),
        ({"verify": "false"}, TypeError, "verify must be True or False"),
        ({"auto_islands": 1}, TypeError, "auto_islands must be True or False"),
        ({"progress": None}, TypeError, "progress must be True or False"),
        ({"attention_backend": "flash3"}, ValueError,
         "attention_backend must be one of flash4, sdpa, static, static_triton, triton, varlen"),
        ({"max_logit_rows": 0}, ValueError, "max_logit_rows must be >= 1"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]!r}" for k in v),
)
def test_bad_options_are_named(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        EngineConfig(**options)


@pytest.mark.parametrize("backend", ["breakable", "eager", "tc_piecewise"])
@pytest.mark.parametrize("attention", ["static", "static_triton"])
def test_an_attention_only_whole_graph_capture_holds_is_refused_elsewhere(backend: str, attention: str) -> None:
    """Such an attention was silently swapped for the live default while the resolved config still named it."""
    with pytest.raises(ValueError, match=f"attention_backend='{attention}' attends inside a whole-layer-stack graph"):
        Engine("tiny-dense", backend=backend, attention_backend=attention, dtype="bfloat16", buckets=[16],
               progress=False, tc_compiler="traced")


def test_a_torch_dtype_is_accepted() -> None:
    cfg = EngineConfig(dtype=torch.float32, device="cpu")
    assert cfg.torch_dtype is torch.float32 and cfg.dtype == "float32"
    eng = Engine("tiny-dense", backend="eager", device=torch.device("cpu"), dtype=torch.float64, progress=False)
    assert eng.model.embed_tokens.weight.dtype is torch.float64 and eng.config.device == "cpu"


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        (None, TypeError, "model must be a preset name.*got None"),
        (3.5, TypeError, "model must be a preset name.*float"),
        ("no-such-model", ValueError, "unknown model preset 'no-such-model'.*tiny-dense"),
        ("/no/such/checkpoint", FileNotFoundError, "checkpoint folder /no/such/checkpoint does not exist"),
        ("./missing-folder", FileNotFoundError, "checkpoint folder ./missing-folder does not exist"),
    ],
)
def test_bad_models_are_named(model, error, match) -> None:
    with pytest.raises(error, match=match):
        Engine(model, device="cpu", progress=False)


def test_a_module_that_is_not_a_language_model_is_named() -> None:
    with pytest.raises(TypeError, match="Linear is not a bcg CausalLM.*build_model.*ForCausalLM"):
        Engine(torch.nn.Linear(2, 2), device="cpu", progress=False)


def test_a_config_that_is_not_an_engine_config_is_named() -> None:
    with pytest.raises(TypeError, match="config must be an EngineConfig.*got 'x'"):
        Engine("tiny-dense", config="x")


def test_a_kv_pool_beyond_memory_names_kv_tokens() -> None:
    with pytest.raises(ValueError, match=r"kv_tokens=10000000000000 needs .* of memory.*lower kv_tokens"):
        Engine("tiny-dense", device="cpu", kv_tokens=10**13, progress=False)


def test_a_file_instead_of_a_checkpoint_folder_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file.*folder"):
        Engine(str(path), device="cpu", progress=False)


def _checkpoint(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, vocab_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    return tmp_path


def _corrupt_config(text: str):
    def corrupt(folder: Path) -> None:
        (folder / "config.json").write_text(text)

    return corrupt


def _string_hidden_size(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = "32"
    (folder / "config.json").write_text(json.dumps(config))


def _truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_corrupt_config("{not json"), r"config\.json.* is not valid JSON"),
        (_corrupt_config("[1, 2]"), r"config\.json.* must hold a JSON object, not a list"),
        (_string_hidden_size, r"config\.json.*hidden_size must be a positive int, got '32'"),
        (_truncate_weights, r"model\.safetensors.*cannot be read"),
    ],
    ids=["invalid_json", "not_an_object", "string_hidden_size", "truncated_weights"],
)
def test_bad_checkpoints_name_the_file(tmp_path: Path, corrupt, match: str) -> None:
    folder = _checkpoint(tmp_path)
    corrupt(folder)
    with pytest.raises(CheckpointError, match=match) as info:
        Engine(str(folder), device="cpu", progress=False)
    assert str(folder) in str(info.value)
