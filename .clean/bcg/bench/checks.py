"""Checks of the ``bcg bench`` / ``bcg analyze`` / ``bcg verify`` flags that need more than a type: lists of lengths,
the model (and the lengths its context holds), the device, the dtype and the output folder.

Each check raises ``ValueError`` with one line naming the flag, the bad value and the fix; the CLI prints it as a
usage error (exit status 2) before anything is built or measured. Importing it does not import torch: argparse
calls its parsers while it reads the flags, and a mistyped flag must fail fast.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

__all__ = ["DTYPES", "MAX_CHUNK", "MAX_LENGTH", "TRACE_KEYS", "check_chunk", "check_context", "check_counts",
           "check_device", "check_dtype", "check_lengths", "check_model", "check_out_dir", "check_threads",
           "parse_int_list", "parse_size", "read_lengths_file"]

DTYPES = ("bfloat16", "float16", "float32")
# Bounds on what one flag can make a run do: a chunk of 16384 tokens is a 74-bucket ladder (a 131072-token one
# would be 298 captures), and a 128k-token prompt is a long-context request, not a typo.
MAX_CHUNK = 16384
MAX_LENGTH = 131072
# The fields of a request in a trace file that give its prompt length, in the order they are looked for (the names
# benchmark traces use); "prompt" may also be the token ids themselves.
TRACE_KEYS = ("input_len", "input_length", "prompt_len", "prompt_tokens", "num_prompt_tokens", "prompt_token_ids",
              "prompt")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_int_list(text: str) -> list[int]:
    """Parses ``"64,128, 256"`` into positive ints; raises ValueError naming the bad item (not the flag: the
    caller or argparse names it).

    Example::

        >>> parse_int_list("64,128")
        [64, 128]
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("empty; give a comma-separated list such as 64,128,256")
    out = []
    for t in items:
        try:
            v = int(t)
        except ValueError:
            raise ValueError(f"{t!r} is not an integer") from None
        if v < 1:
            raise ValueError(f"{v} must be >= 1")
        out.append(v)
    return out


def parse_size(text: str) -> int:
    """Parses a memory size such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000000"`` (bytes) into bytes; raises
    ValueError naming the bad text.

    Example::

        >>> parse_size("2GiB"), parse_size("1.5 MB"), parse_size("4096")
        (2147483648, 1500000, 4096)
    """
    t = text.strip().lower().replace(" ", "")
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size; give e.g. 2GiB, 512MiB or a number of bytes") from None
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use B, KiB, MiB, GiB (or kB, MB, GB)")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} must be a positive size")
    return int(value * _UNITS[unit])


def read_lengths_file(path: str, flag: str = "--lengths-file") -> list[int]:
    """Prompt lengths from a file: integers separated by whitespace or commas (``#`` starts a comment), or a trace of
    requests as JSON (a list of lengths or of request objects) or JSON lines (one request object per line), each
    request's length read from the first of :data:`TRACE_KEYS` it has (a list of token ids counts its items). Errors
    name ``flag``, the flag that gave the file.

    Example::

        read_lengths_file("lengths.txt")   # "128\\n512, 2048  # long ones\\n" -> [128, 512, 2048]
        read_lengths_file("trace.jsonl")   # '{"input_len": 300, "output_len": 20}\\n...' -> [300, ...]
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path!r} is not a text file") from None
    if text.lstrip()[:1] in ("[", "{"):
        return _trace_lengths(path, text, flag)
    tokens = [t for line in text.splitlines() for t in line.split("#", 1)[0].replace(",", " ").split()]
    if not tokens:
        raise ValueError(f"{flag} {path!r} holds no lengths")
    try:
        return parse_int_list(",".join(tokens))
    except ValueError as e:
        raise ValueError(f"{flag} {path!r}: {e}") from None


def _trace_lengths(path: str, text: str, flag: str) -> list[int]:
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path!r} is neither JSON nor JSON lines ({e.msg}, line {e.lineno})") \
                from None
    out = []
    for i, r in enumerate(records):
        n = r if isinstance(r, int) and not isinstance(r, bool) else None
        if isinstance(r, dict):
            key = next((k for k in TRACE_KEYS if k in r), None)
            value = r.get(key) if key else None
            n = len(value) if isinstance(value, list) else value if isinstance(value, int) else None
            if isinstance(value, str):
                raise ValueError(f"{flag} {path!r}: request {i} gives its prompt as text ({key!r}); give "
                                 "token counts (one of " + ", ".join(TRACE_KEYS[:5]) + ") or token ids")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{flag} {path!r}: request {i} has no prompt length (a positive integer, or "
                             f"an object with one of {', '.join(TRACE_KEYS)}): {str(r)[:80]}")
        out.append(n)
    if not out:
        raise ValueError(f"{flag} {path!r} holds no requests")
    return out


def check_model(model: str, model_impl: str = "auto") -> str:
    """Accepts a preset name or a loadable checkpoint folder (``config.json`` and ``*.safetensors`` of a model the
    implementation ``model_impl`` picks can run) and returns the implementation that will run it (``"native"`` or
    ``"transformers"``); raises ValueError saying what is missing and listing the presets.

    Example::

        check_model("tiny-dense")          # 'native'
        check_model("/tmp/empty-folder")   # ValueError: --model '/tmp/empty-folder' has no config.json ...
    """
    from bcg.models.config import PRESETS

    if model in PRESETS:
        if model_impl == "transformers":
            raise ValueError(f"--model {model!r} is a preset (one of bcg's own models); --model-impl transformers "
                             "needs a checkpoint folder")
        return "native"
    presets = f"presets: {', '.join(PRESETS)}"
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"--model {model!r} is neither a preset nor a checkpoint folder ({presets})")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model!r} has no config.json, so it is not a Hugging Face checkpoint folder "
                         f"(give a folder with config.json and *.safetensors, or a preset; {presets})")
    hf = _hf_config(model)
    from bcg.models.model_impl import resolve_model_impl

    try:
        impl = resolve_model_impl(folder, model_impl)  # unsupported natively, or no transformers: its own message
    except (ValueError, ImportError) as e:
        raise ValueError(f"--model {model!r}: {e}") from None
    if impl == "transformers":
        import transformers

        if hf.get("model_type") not in transformers.CONFIG_MAPPING:
            what = "not one" if model_impl == "transformers" else "neither one bcg implements natively nor one"
            raise ValueError(f"--model {model!r}: model_type {hf.get('model_type')!r} is {what} transformers "
                             f"{transformers.__version__} knows")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model {model!r} has config.json but no *.safetensors weights")
    return impl


def _hf_config(model: str) -> dict:
    try:
        hf = json.loads((Path(model) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model!r}: config.json cannot be read: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"--model {model!r}: config.json is not a JSON object")
    return hf


def check_context(flag: str, lengths: list[int], model: str, impl: str) -> None:
    """Refuses prompt lengths beyond the model's context (``max_position_embeddings``, which the engine refuses to
    prefill past), naming the longest one allowed; a checkpoint run by transformers that states no context passes.

    Example::

        check_context("--lengths", [64, 8192], "tiny-dense", "native")   # ValueError: ... context of 4096 tokens
    """
    from bcg.models.config import PRESETS

    if model in PRESETS:
        context: int | None = PRESETS[model].max_position_embeddings
    elif impl == "native":
        from bcg.models.loader import config_from_hf

        context = config_from_hf(_hf_config(model)).max_position_embeddings
    else:
        stated = _hf_config(model).get("max_position_embeddings")
        context = stated if isinstance(stated, int) and stated > 0 else None
    longest = max(lengths)
    if context is not None and longest > context:
        raise ValueError(f"{flag}: {longest} tokens is more than {model!r} holds (its context is {context} tokens, "
                         f"max_position_embeddings); give lengths up to {context}")


def check_counts(runs: int, warmup: int, chunk: int) -> None:
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    check_chunk(chunk)


def check_chunk(chunk: int) -> None:
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"--chunked-prefill-size must be in [1, {MAX_CHUNK}], got {chunk}")


def check_lengths(flag: str, lengths: list[int]) -> None:
    if not lengths:
        raise ValueError(f"{flag} is empty; give a comma-separated list such as 64,128,256")
    bad = [n for n in lengths if not 1 <= n <= MAX_LENGTH]
    if bad:
        raise ValueError(f"{flag}: {bad[0]} is outside [1, {MAX_LENGTH}] tokens")


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


def check_device(device: str) -> None:
    """Accepts ``cpu``, ``cuda`` and ``cuda:N`` of a visible GPU; raises ValueError naming the device asked for."""
    import torch  # here, not at the top: the flags' types (parse_int_list, parse_size) run before any torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device (use cuda, cuda:1 or cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {device!r}: only cuda and cpu are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r} was asked for, but no CUDA device is visible "
                             "(use --device cpu)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device!r}: only {count} CUDA device(s) are visible (cuda:0 to "
                             f"cuda:{count - 1})")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose {', '.join(DTYPES)}")


def check_out_dir(out: str) -> Path:
    """Creates ``out`` if needed and proves it writable by writing a file there; raises ValueError otherwise.

    Called before anything is measured, so an unwritable folder never costs a run's results.

    Example::

        check_out_dir("out/bench")   # Path('out/bench'), created
    """
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".bcg-write-check-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if path.exists() and not path.is_dir():
            reason = "it is a file, not a folder"
        raise ValueError(f"--out {out!r} is not a writable folder ({reason}); give one you can write to") from None
    return path
