"""The flags the ``bcg`` subcommands share, and argparse types for their values (lists, sizes, variants)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["backend_list", "both", "engine_flags", "float_list", "int_list", "measure_flags", "out_dir", "size",
           "tc_compiler_flag"]


def int_list(flag: str) -> Any:
    """An argparse type parsing a comma list of positive ints (``flag`` names it in argparse's errors)."""
    def parse(text: str) -> list[int]:
        from bcg.bench.checks import parse_int_list

        try:
            return parse_int_list(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None  # argparse prefixes "argument --flag:"

    parse.__name__ = flag  # argparse names the type in its error message
    return parse


def backend_list(text: str) -> list[str]:
    from bcg.bench.variants import parse_variant

    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("empty; give e.g. eager,breakable")
    try:
        return [parse_variant(n).name for n in names]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size(text: str) -> int:
    from bcg.bench.checks import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def both(gpu: Any, cpu: Any) -> str:
    """A default that depends on the machine, as help text."""
    return f"{gpu} on CUDA, {cpu} on the CPU"


def engine_flags(p: argparse.ArgumentParser, model_help: str, model: str | None = None) -> None:
    """The flags every command shares: what runs, where, and with which chunk, seed and progress bars."""
    from bcg.bench.checks import DTYPES, MAX_CHUNK
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.models.config import PRESETS
    from bcg.models.impl_names import MODEL_IMPLS

    p.add_argument("--model", default=model, help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face checkpoint "
                   f"folder (config.json and *.safetensors); default: {model_help}")
    p.add_argument("--model-impl", default="auto", choices=list(MODEL_IMPLS),
                   help="what runs a checkpoint folder: bcg's own model classes (native: llama, qwen3, qwen3_moe), "
                   "its transformers code as written (transformers), or native where bcg has the architecture "
                   "(auto) (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help=f"weights and activations (default: {both('bfloat16', 'float32')})")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help=f"tokens per forward, at most {MAX_CHUNK} (default: "
                   f"{both(G.chunked_prefill_size, C.chunked_prefill_size)}, for every command alike)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: on when stderr is a terminal, off in logs and pipes)")


def measure_flags(p: argparse.ArgumentParser, out: str, runs: int | None = None, warmup: int | None = None) -> None:
    """The flags of bench and analyze: how often to time (``runs`` and ``warmup`` default to bench's), on how many
    threads, and where the results go."""
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.bench.defaults import RUNS, WARMUP

    engine_flags(p, both(G.model, C.model))
    p.add_argument("--runs", type=int, default=RUNS if runs is None else runs,
                   help="timed runs per measurement; the median is reported with its interquartile range "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=WARMUP if warmup is None else warmup,
                   help="untimed runs before timing (default: %(default)s)")
    p.add_argument("--out", type=out_dir, default=out, help="output folder for results.json and the PNGs, checked "
                   "for writing before anything runs (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own on CUDA, 1 on the CPU: one thread keeps CPU "
                   "timings repeatable on a busy machine)")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="skip the PNGs, and remove those of an earlier run in --out (default: draw them)")


def tc_compiler_flag(p: argparse.ArgumentParser) -> None:
    """``--tc-compiler``, the same for every command; ``None`` takes this machine's default in the config's
    ``resolved()`` (:func:`bcg.bench.config_base.tc_compiler_for`)."""
    from bcg.bench.defaults import CPU_DEFAULTS as C
    from bcg.bench.defaults import CUDA_DEFAULTS as G
    from bcg.bench.defaults import TC_COMPILERS

    p.add_argument("--tc-compiler", default=None, choices=TC_COMPILERS,
                   help="what compiles tc_piecewise's pieces: inductor (generated kernels), or traced (dynamo's "
                   "trace run as it is, no code generated: what the CPU emulation can run) (default: "
                   f"{both(G.tc_compiler, C.tc_compiler)})")


def out_dir(text: str) -> str:
    """An argparse type for ``--out``: a folder name, not an empty string (which would mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a folder for the results, e.g. out/run1 (or . for this one)")
    return text


def float_list(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers (e.g. 100,300,900)") from None
    if not values:
        raise argparse.ArgumentTypeError("empty; give e.g. 100,300,900")
    return values
