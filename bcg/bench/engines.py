"""Building, describing and freeing engines for the benchmarks, and the prompts they run.

Kept apart from the experiments so every experiment builds engines the same way: one engine per backend and
model, freed (del + gc + ``empty_cache``) before the next is built so their memory never overlaps.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bcg.errors import first_line

__all__ = ["BuildRecord", "describe_build", "engine_for", "free_memory", "make_prompts", "one_batch",
           "split_tokens"]


@dataclass
class BuildRecord:
    """How one backend's engine was built, or why it could not be.

    Attributes:
        backend: backend name.
        available: False when the engine could not be constructed or its backend refused the model (``error``
            says why); an unavailable backend is measured nowhere, so its eager fallback never counts as its speed.
        refused_reason: set when the backend refused to capture this model (the engine would serve eagerly).
        build_ms: runner build (compile + capture); load_ms: model load.
        compile_ms / capture_ms: the two parts of the build (``telemetry``).
        num_buckets / num_captured: ladder size and buckets that captured.
        graph_memory_bytes: resident graph memory (device free memory before minus after capture; 0 on CPU).
        num_segments / num_breaks: of the largest captured bucket.
    """

    backend: str
    available: bool = True
    error: str | None = None
    refused_reason: str | None = None
    ceiling: int | None = None
    load_ms: float | None = None
    build_ms: float | None = None
    compile_ms: float | None = None
    capture_ms: float | None = None
    num_buckets: int = 0
    num_captured: int = 0
    graph_memory_bytes: int | None = None
    num_segments: int | None = None
    num_breaks: int | None = None


def free_memory() -> None:
    """Drops unreachable objects and returns cached device memory, so the next engine starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def engine_for(model: str, backend: str, *, device: str, dtype: str | None, seed: int, chunked_prefill_size: int,
               max_tokens: int | None, progress: bool, record: BuildRecord | None = None,
               kv_tokens: int | None = None, tp_size: int = 1, model_impl: str = "auto") -> Iterator[Any]:
    """Builds an Engine for ``backend`` (a variant name, :mod:`bcg.bench.variants`); yields it, or ``None`` when it
    cannot be built, its backend refuses the model or its compile fails (``record`` says why: ``error``, and
    ``refused_reason`` for a refusal).

    The engine is freed on exit, so callers must not keep references to it past the ``with`` block.

    Example::

        rec = BuildRecord("full")
        with engine_for("llama-dense", "full", device="cuda", dtype=None, seed=0, chunked_prefill_size=2048,
                        max_tokens=2048, progress=True, record=rec) as eng:
            if eng is not None:
                eng.prefill([[1, 2, 3]])
        rec.available, rec.error
    """
    from bcg.bench.variants import parse_variant
    from bcg.runtime import Engine

    record = record if record is not None else BuildRecord(backend)
    record.ceiling = max_tokens
    variant = parse_variant(backend)
    free_memory()
    try:
        eng = Engine(model, backend=variant.backend, kernels=variant.kernels, compile=variant.compile, device=device,
                     dtype=dtype, seed=seed, kv_tokens=kv_tokens, chunked_prefill_size=chunked_prefill_size,
                     max_tokens=max_tokens, progress=progress, tp_size=tp_size, model_impl=model_impl)
    except Exception as e:  # an unavailable backend is a result to report, not a crash
        record.available, record.error = False, first_line(e)
        free_memory()
        yield None
        return
    describe_build(eng, record)
    # A refused backend serves every batch eagerly, and a variant whose compile failed runs uncompiled: timing
    # either would report something else under its name.
    failure = record.refused_reason or eng.telemetry.compile_error
    if failure is not None:
        record.available, record.error = False, failure
        del eng
        free_memory()
        yield None
        return
    try:
        yield eng
    finally:
        del eng
        free_memory()


def describe_build(eng: Any, record: BuildRecord) -> BuildRecord:
    """Fills ``record`` from an engine's telemetry (build split into compile and capture, buckets, memory)."""
    tel = eng.telemetry
    record.load_ms, record.build_ms = eng.load_ms, eng.build_ms
    record.compile_ms, record.capture_ms = tel.compile_ms, tel.capture_ms
    record.refused_reason = tel.refused_reason
    record.num_buckets, record.num_captured = len(tel.buckets), tel.num_captured
    record.graph_memory_bytes = tel.graph_memory_bytes if eng.device.type == "cuda" else None
    captured = [r for r in tel.buckets.values() if r.disabled_reason is None]
    if captured:
        largest = max(captured, key=lambda r: r.bucket)
        record.num_segments, record.num_breaks = largest.num_segments, largest.num_breaks
    return record


def split_tokens(total: int, parts: int) -> list[int]:
    """Splits ``total`` tokens over at most ``parts`` requests as evenly as possible (none empty).

    Example::

        >>> split_tokens(70, 16)[:3], sum(split_tokens(70, 16)), split_tokens(5, 16)
        ([5, 5, 5], 70, [1, 1, 1, 1, 1])
    """
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def make_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Seeded random prompts (CPU int64 tensors) of the given lengths; same seed, same tokens, any backend.

    Example::

        >>> [p.shape[0] for p in make_prompts([3, 5], vocab_size=256, seed=0)]
        [3, 5]
    """
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen, dtype=torch.long) for n in lengths]


def one_batch(eng: Any, prompt: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A one-request :class:`PrefillBatch` for ``prompt`` with freshly allocated KV slots.

    Returns ``(batch, slots)``; the caller frees the slots with ``eng.kv_pool.free(slots)``.
    """
    from bcg.runtime.batch import PrefillBatch, PrefillItem

    slots = eng.kv_pool.alloc(prompt.numel())
    try:
        b = PrefillBatch([PrefillItem(prompt, slots)], eng.kv_pool)
    except BaseException:
        eng.kv_pool.free(slots)
        raise
    return b, slots
