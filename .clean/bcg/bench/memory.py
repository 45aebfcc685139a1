"""The peak-memory experiment of SGLang's breakable-graph blog post (the article bcg started from): memory above the
no-graph baseline after one chunk-sized prefill.

Configurations: no graphs (eager), then the breakable backend with capture ceilings of 1/4, 1/2 and 1x
``chunked_prefill_size``. Each engine is built alone, warmed with one prefill of exactly the chunk size, its cache
emptied, and then measured over a second prefill of the same size:

- ``resident``: what the engine holds between forwards (weights, KV pool, static buffers, graph pools);
- ``peak``: the most it held during the prefill (torch's ``max_memory_allocated``/``max_memory_reserved``), and the
  device-level used memory afterwards (``mem_get_info``), which also counts graph executables and pool segments
  that torch's counters do not;
- ``above_baseline``: peak minus the eager engine's resident memory, the article's headline number. Below the chunk
  size a ceiling adds resident graphs while the eager activation peak stays; at the chunk size the peak collapses.

Without CUDA there is no graph pool or device memory to read: every value is ``None`` and ``note`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from bcg.bench.engines import BuildRecord, EngineSpec, engine_for, make_prompts, release_memory

__all__ = ["MemoryResult", "MemoryRow", "ceilings_for", "run_memory"]


@dataclass
class MemoryRow:
    """One configuration; bytes, ``None`` where not measurable."""

    label: str
    backend: str
    ceiling: int | None
    available: bool = True
    error: str | None = None
    num_buckets: int = 0
    graph_used: bool | None = None
    graph_memory_bytes: int | None = None
    resident_allocated_bytes: int | None = None
    resident_device_bytes: int | None = None
    activation_peak_bytes: int | None = None
    peak_allocated_above_baseline_bytes: int | None = None
    peak_reserved_above_baseline_bytes: int | None = None
    device_used_above_baseline_bytes: int | None = None


@dataclass
class MemoryResult:
    available: bool
    chunked_prefill_size: int
    note: str | None = None
    rows: list[MemoryRow] = field(default_factory=list)


def ceilings_for(chunk: int) -> list[tuple[str, str, int | None]]:
    """(label, backend, ceiling) of the experiment: eager, then breakable at 1/4, 1/2 and 1x the chunk size.

    Example::

        >>> ceilings_for(2048)
        [('none', 'eager', None), ('1/4', 'breakable', 512), ('1/2', 'breakable', 1024), ('1x', 'breakable', 2048)]
    """
    configs: list[tuple[str, str, int | None]] = [("none", "eager", None)]
    for label, ceiling in (("1/4", chunk // 4), ("1/2", chunk // 2), ("1x", chunk)):
        if ceiling >= 1 and all(c != ceiling for _, _, c in configs):
            configs.append((label, "breakable", ceiling))
    return configs


@dataclass
class _Sample:
    resident_alloc: int
    resident_reserved: int
    resident_device: int
    peak_alloc: int
    peak_reserved: int
    device_after: int
    activation: int
    graph_used: bool


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _sample(eng: Any, prompt: torch.Tensor, start: tuple[int, int, int]) -> _Sample:
    """Resident and peak memory of one engine, relative to ``start`` (allocated, reserved, device used)."""
    dev = eng.device
    eng.prefill([prompt])  # warm-up: lazy workspaces (cuBLAS, ...) become resident, as in serving
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # what stays now is what the engine must hold between forwards
    alloc_b, reserved_b, used_b = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), _used(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    res = eng.prefill([prompt])
    torch.cuda.synchronize(dev)
    a0, r0, u0 = start
    return _Sample(
        resident_alloc=alloc_b - a0, resident_reserved=reserved_b - r0, resident_device=used_b - u0,
        peak_alloc=torch.cuda.max_memory_allocated(dev) - a0, peak_reserved=torch.cuda.max_memory_reserved(dev) - r0,
        # The caching allocator keeps the peak's segments until empty_cache, so used memory now is the peak.
        device_after=_used(dev) - u0, activation=torch.cuda.max_memory_allocated(dev) - alloc_b,
        graph_used=all(b.graph_used for b in res.batches),
    )


def _measure_config(label: str, backend: str, ceiling: int | None,
                    spec: EngineSpec) -> tuple[MemoryRow, _Sample | None]:
    row = MemoryRow(label=label, backend=backend, ceiling=ceiling)
    release_memory()
    dev = spec.config.torch_device
    start = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), _used(dev))
    record = BuildRecord(backend)
    chunk = spec.config.chunked_prefill_size
    with engine_for(spec.replace(max_tokens=ceiling or chunk), backend, record) as eng:
        if eng is None:
            row.available, row.error = False, record.error
            return row, None
        prompt = make_prompts([chunk], eng.model.config.vocab_size, spec.config.seed)[0]
        sample = _sample(eng, prompt, start)
    row.num_buckets, row.graph_memory_bytes = record.num_captured, record.graph_memory_bytes
    row.graph_used = sample.graph_used
    row.resident_allocated_bytes, row.resident_device_bytes = sample.resident_alloc, sample.resident_device
    row.activation_peak_bytes = sample.activation
    return row, sample


def run_memory(spec: EngineSpec) -> MemoryResult:
    """Runs the peak-memory experiment with the engines of ``spec`` (its chunk, its ``progress``; the ceiling and an
    automatically sized KV pool per configuration), per rank under tensor parallel; on a CPU returns rows of ``None``
    with a note.

    Example::

        res = run_memory(BenchConfig(model="llama-dense").resolved().engine_spec())
        [(r.label, r.device_used_above_baseline_bytes) for r in res.rows]
    """
    chunk = spec.config.chunked_prefill_size
    configs = ceilings_for(chunk)
    if spec.config.torch_device.type != "cuda":
        note = ("memory accounting needs CUDA: the CPU emulation has no graph memory pool and no device memory, "
                "so no memory was measured")
        return MemoryResult(False, chunk, note, [MemoryRow(lb, be, c, available=False) for lb, be, c in configs])
    spec = spec.replace(kv_tokens=None)
    result = MemoryResult(True, chunk)
    baseline: _Sample | None = None
    for label, backend, ceiling in tqdm(configs, desc="bcg memory", unit="config", disable=not spec.config.progress):
        row, sample = _measure_config(label, backend, ceiling, spec)
        result.rows.append(row)
        if sample is None:
            continue
        if backend == "eager" and baseline is None:
            baseline = sample
        if baseline is not None:
            row.peak_allocated_above_baseline_bytes = sample.peak_alloc - baseline.resident_alloc
            row.peak_reserved_above_baseline_bytes = sample.peak_reserved - baseline.resident_reserved
            row.device_used_above_baseline_bytes = sample.device_after - baseline.resident_device
    if baseline is None:
        result.note = "the eager baseline could not be built, so nothing is relative to it"
    return result
