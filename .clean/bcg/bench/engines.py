"""Building, describing and freeing engines for the benchmarks, and the prompts they run.

Kept apart from the experiments so every experiment builds engines the same way: from one :class:`EngineSpec` per
run and a variant name, each freed (del + gc + ``empty_cache``) on leaving its ``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from bcg.errors import first_line
from bcg.runtime.backend_registry import DEFAULT_FULL_GRAPH_TOKENS

if TYPE_CHECKING:
    from bcg.runtime.config import EngineConfig

__all__ = ["BuildRecord", "EngineSpec", "describe_build", "engine_for", "make_prompts", "memory_note", "one_batch",
           "release_memory", "split_tokens"]


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


def release_memory() -> None:
    """Drops unreachable objects and returns cached device memory, so the next engine starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def memory_note(device: torch.device) -> str:
    """What this process holds of ``device``'s memory, for an engine that could not be built ("" off CUDA): another
    process's use and an earlier engine's look the same from the error alone.

    Example::

        memory_note(torch.device("cuda"))   # '; of the device's 139.8 GiB, 0.0 GiB are free and this process ...'
    """
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return (f"; of the device's {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB are free and this process has "
            f"{allocated / 2**30:.1f} GiB allocated and {reserved / 2**30:.1f} GiB reserved")


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of one run shares: the model and an :class:`~bcg.runtime.config.EngineConfig` whose
    ``backend``, ``kernels`` and ``compile`` each variant sets (:mod:`bcg.bench.variants`). Built once from the run's
    config (``BenchConfig.engine_spec()``, ``AnalyzeConfig.engine_spec()``).

    Example::

        spec = EngineSpec("tiny-dense", EngineConfig(device="cpu", chunked_prefill_size=64))
        spec.config_for("breakable+fused").kernels          # 'fused'
        spec.replace(max_tokens=16).config.max_tokens       # 16
    """

    model: str
    config: EngineConfig

    def replace(self, **changes: Any) -> EngineSpec:
        """The same spec with some EngineConfig fields changed (validated again)."""
        return EngineSpec(self.model, dataclasses.replace(self.config, **changes))

    def config_for(self, variant: str) -> EngineConfig:
        """The EngineConfig of one variant (a name such as ``breakable+fused``)."""
        from bcg.bench.variants import parse_variant

        v = parse_variant(variant)
        full = v.full_graph_tokens
        if full is None and self.config.torch_device.type != "cuda":  # "+full" where the engine makes none itself
            full = DEFAULT_FULL_GRAPH_TOKENS
        return dataclasses.replace(self.config, backend=v.backend, kernels=v.kernels, compile=v.compile,
                                   full_graph_tokens=full)

    def describe(self, variants: list[str]) -> str:
        """What each variant's engine will run, resolved for this machine as the engine resolves it (kernels,
        attention backend, compiler, buckets, device and dtype): one clause per variant, for a run's first line.

        Example::

            spec = EngineSpec("tiny-dense", EngineConfig(device="cpu", chunked_prefill_size=64))
            spec.describe(["eager", "breakable+fused"])
            # 'eager: backend eager, kernels torch, ...; breakable+fused: backend breakable, kernels fused, ...'
        """
        clauses = []
        for variant in variants:
            try:
                clauses.append(f"{variant}: {self.config_for(variant).describe()}")
            except ValueError as e:  # the engine's build will record the same refusal
                clauses.append(f"{variant}: cannot run here ({first_line(e)})")
        return "; ".join(clauses)


@contextlib.contextmanager
def engine_for(spec: EngineSpec, variant: str, record: BuildRecord | None = None) -> Iterator[Any]:
    """Builds the Engine of ``variant`` (:mod:`bcg.bench.variants`) from ``spec``; yields it, or ``None`` when it
    cannot be built, its backend refuses the model or its compile fails (``record`` says why: ``error``, and
    ``refused_reason`` for a refusal).

    The engine is freed on exit, so callers must not keep references to it past the ``with`` block.

    Example::

        rec = BuildRecord("full")
        with engine_for(BenchConfig().resolved().engine_spec(), "full", rec) as eng:
            if eng is not None:
                eng.prefill([[1, 2, 3]])
        rec.available, rec.error
    """
    from bcg.runtime import Engine

    record = record if record is not None else BuildRecord(variant)
    record.ceiling = spec.config.max_tokens
    release_memory()
    try:
        with _fallback_lines_held():
            eng = Engine(spec.model, spec.config_for(variant))
    except Exception as e:  # an unavailable backend is a result to report, not a crash
        record.available, record.error = False, first_line(e)
        release_memory()
        yield None
        return
    describe_build(eng, record)
    # A refused backend serves every batch eagerly, and a variant whose compile failed runs uncompiled: timing
    # either would report something else under its name.
    failure = record.refused_reason or eng.telemetry.compile_error
    if failure is not None:
        record.available, record.error = False, failure
        logging.getLogger("bcg").warning("bcg: %s is not measured: %s", variant, failure)
        del eng
        release_memory()
        yield None
        return
    try:
        yield eng
    finally:
        del eng
        release_memory()


# The engine's own log lines for a fallback (a refused backend serves eagerly, a failed compile runs uncompiled) say
# what a server would do next; a measurement does not time that fallback, and says so itself.
_FALLBACK_ENDINGS = ("; serving every batch eagerly", "; running the uncompiled layer stack")


@contextlib.contextmanager
def _fallback_lines_held() -> Iterator[None]:
    """While an engine is built for measuring, the engine's fallback log lines are held back (engine_for logs what
    happens to the variant instead)."""
    def keep(rec: logging.LogRecord) -> bool:
        return not rec.getMessage().endswith(_FALLBACK_ENDINGS)

    logger = logging.getLogger("bcg")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


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
