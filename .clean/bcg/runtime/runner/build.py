"""Building a runner's graphs: the backend's preparation, compiling the layer stack, and capturing every bucket,
largest first, with what each capture cost.

Apart from the runner, which serves batches from what the build left: the builder writes each bucket's handle,
record or disabled reason (and a refusal of the backend) into the bucket table and the build times into the
telemetry, and serving only reads them back. It is given the runner's collaborators, never the runner.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from tqdm.auto import tqdm

from bcg import env
from bcg.capture_rules import UncapturableOpError
from bcg.emulation import RECORDS_COMPILED_CODE
from bcg.errors import first_line
from bcg.runtime.backends import BackendRefused, GraphBackend, GraphResources
from bcg.runtime.config import EngineConfig
from bcg.runtime.runner.agreement import RankAgreement
from bcg.runtime.runner.buckets import BucketTable
from bcg.runtime.runner.inputs import StaticInputs
from bcg.runtime.runner.step import ModelStep
from bcg.runtime.runner.telemetry import BucketRecord, Telemetry

__all__ = ["GraphBuilder", "frozen_gc"]

logger = logging.getLogger("bcg")


def is_uncapturable(e: BaseException) -> bool:
    """Errors that say the *model* cannot be captured, as opposed to one bucket failing (e.g. out of memory)."""
    if isinstance(e, (UncapturableOpError, BackendRefused)):
        return True
    text = str(e)
    return "operation not permitted when stream is capturing" in text or "cudaErrorStreamCapture" in text


@contextmanager
def frozen_gc() -> Iterator[None]:
    # A collection during capture could free tensors mid-segment; freezing also keeps capture fast. A heap an earlier
    # build froze (freeze_heap) stays frozen: unfreezing would hand it back to every collection.
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if not was_frozen:
            gc.unfreeze()


def freeze_heap() -> int:
    """Collects, then moves every object alive out of the garbage collector's sight (``gc.freeze()``); returns how
    many (0 when ``BCG_GC_FREEZE=0``). A full collection walks every tracked object: ~310k after torch, transformers
    and an engine, 110-120 ms here with the interpreter lock held, which a serving thread meets as a stall (the size
    of the ~180 ms ``submit()`` maximum seen on the H200). Frozen, the model, the engine and the imports are not
    walked again; what serving allocates still is. Process-wide, as the collector is: the engine that froze thaws
    (``gc.unfreeze()``) when it closes, so what it leaves behind can be collected."""
    if not env.gc_freeze():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def free_device_bytes(device: torch.device, release: bool = False) -> int:
    """Free bytes of a CUDA device (0 elsewhere): what a capture's memory is measured by. ``release`` first hands the
    caching allocator's unused blocks back, as the ladder's totals do: otherwise the warm-up forwards' activations,
    cached for reuse and held by no graph, count as graph memory (the H200 measured a breakable ladder 25% above
    what its nodes and pool predict)."""
    if device.type != "cuda":
        return 0
    if release:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class GraphBuilder:
    """Prepares the backend, compiles the layer stack and captures the buckets of one runner.

    Args:
        step: the step every path runs; compiling replaces its ``layers`` (and failing to compile puts the
            uncompiled stack back).
        inputs: the static inputs (``dummy(n)`` installs a one-request batch of ``n`` tokens for warmup, capture and
            compilation).
        backend: the runner's backend.
        resources: what the backend captures with (None for a backend without graphs).
        table: the bucket table, which receives each capture's handle, record or disabled reason, and a refusal.
        telemetry: receives the compile and capture times, the graph memory and why compiling failed.
        config: the engine's options.
        agreement: under tensor parallel, makes every outcome the same on every rank; None on one rank.
    """

    def __init__(self, step: ModelStep, inputs: StaticInputs, backend: GraphBackend, resources: GraphResources | None,
                 table: BucketTable, telemetry: Telemetry, config: EngineConfig, agreement: RankAgreement | None
                 ) -> None:
        self.step, self.inputs, self.backend, self.resources = step, inputs, backend, resources
        self.table, self.telemetry, self.config = table, telemetry, config
        self.agreement = agreement
        self.device, self.dtype = config.torch_device, config.torch_dtype

    def prepare(self) -> None:
        """Runs the backend's preparation, then compiles the step's layer stack when asked (the uncompiled stack
        stays if compiling fails, and telemetry says why)."""
        t0 = time.perf_counter()
        try:
            if self.backend.uses_graphs:
                error: BaseException | None = None
                try:
                    self.backend.prepare()
                except Exception as e:  # any failure here means: serve eagerly, loudly
                    error = e
                if self.agreement is not None:  # tensor parallel: refused on one rank, refused on all
                    error = self.agreement.agree_outcome(error, "the backend's preparation")
                if error is not None:
                    self.refuse(error)
            if self.config.compile:  # after prepare: the first compiled call runs under the backend's context
                compile_error: BaseException | None = None
                try:
                    self._compile()
                except Exception as e:  # run and capture the uncompiled stack instead, loudly
                    compile_error = e
                if self.agreement is not None:  # tensor parallel: compiled on every rank or on none
                    compile_error = self.agreement.agree_outcome(compile_error, "compiling the layer stack")
                if compile_error is not None:
                    self._uncompile(compile_error)
        finally:
            self.telemetry.compile_ms = (time.perf_counter() - t0) * 1e3

    def capture_all(self) -> None:
        """Captures every bucket, largest first, into one shared pool (nothing for a backend without graphs or a
        refused one)."""
        if not self.backend.uses_graphs or self.table.refused_reason is not None:
            return
        sizes = sorted(self.table.sizes, reverse=True)
        bar = tqdm(sizes, desc=f"Capturing {self.config.backend}", disable=not self.config.progress,
                   unit="bucket", leave=False)
        start_free = free_device_bytes(self.device, release=True)
        t_all = time.perf_counter()
        with frozen_gc(), torch.inference_mode():
            for bucket in bar:
                record = self.capture(bucket)
                free = f"{free_device_bytes(self.device) / 2**30:.1f}" if self.device.type == "cuda" else "-"
                bar.set_postfix(bucket=bucket, capture_ms=f"{record.capture_ms:.1f}", free_gib=free)
                if self.table.refused_reason is not None:
                    break
        bar.close()
        self.telemetry.capture_ms = (time.perf_counter() - t_all) * 1e3
        self.telemetry.graph_memory_bytes = max(start_free - free_device_bytes(self.device, release=True), 0)
        logger.info("bcg: %s captured %d/%d buckets in %.0f ms (compile %.0f ms), graph memory %.1f MiB",
                    self.config.backend, self.telemetry.num_captured, len(sizes), self.telemetry.capture_ms,
                    self.telemetry.compile_ms, self.telemetry.graph_memory_bytes / 2**20)

    def capture(self, bucket: int) -> BucketRecord:
        """Warms up and captures ``bucket``; its record says what it cost, or why it is disabled."""
        res, record = self.resources, self.table.record(bucket)
        free0 = free_device_bytes(self.device)
        t0 = time.perf_counter()
        handle, error = None, None
        if self.agreement is not None:
            self.agreement.begin_capture(bucket)
        try:
            with self.inputs.dummy(bucket):
                stream = res.capture_stream
                if stream is not None:  # the static buffers were just filled on the current stream
                    stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    for _ in range(self.config.warmup):
                        self.backend.warmup(bucket)
                if stream is not None:
                    torch.cuda.current_stream().wait_stream(stream)
                handle = self.backend.capture(bucket)
        except Exception as e:  # one bucket failing must not take the others down
            error = e
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                # A capture that failed inside CUDA can leave its pool unusable ("already recording"): every
                # backend captures later buckets into a fresh pool, giving up sharing with the earlier ones.
                res.pool.renew()
        if self.agreement is not None:  # tensor parallel: kept only if every rank captured the same graph
            shape = self.backend.describe(handle) if handle is not None else None
            error = self.agreement.agree_capture(bucket, error, error is not None and is_uncapturable(error), shape)
        if error is not None:
            if is_uncapturable(error):
                self.refuse(error)
            else:
                self.table.disable(bucket, f"capture failed: {first_line(error)}")
            return record
        if res is not None:
            # A CUDA graph's first launch uploads it to the device (about 4-5 ms a bucket of a 28-layer model on an
            # H200: 265 ms over 58 buckets): pay that here, once every rank kept the graph, not in the first request
            # a bucket serves (it was a ~190 ms TTFT tail under load). On the dummy batch, as warmup and capture ran;
            # under the emulation too, so the CPU tier runs the same path.
            try:
                with self.inputs.dummy(bucket):
                    self.backend.replay(handle, bucket)
            except Exception as e:
                self.table.disable(bucket, f"first replay failed: {first_line(e)}")
                return record
        record.capture_ms = (time.perf_counter() - t0) * 1e3
        record.memory_bytes = max(free0 - free_device_bytes(self.device), 0)
        record.num_segments, record.num_breaks = self.backend.describe(handle)
        self.table.set_handle(bucket, handle)
        return record

    def _compile(self) -> None:
        """Traces and compiles the layer stack now, at the largest bucket, so build time says what compiling costs
        and no batch pays for it; under inference mode, as every later call runs."""
        if self.resources is not None and self.resources.is_emulated:
            if self.config.compile == "inductor":
                raise RuntimeError(
                    "compile='inductor' cannot run under the CPU graph emulation: Inductor's CPU kernels are C++ "
                    "called directly, not aten ops the emulation records. Use compile='traced' on a CPU, or a GPU")
            if not RECORDS_COMPILED_CODE:
                raise RuntimeError(f"this torch ({torch.__version__}) cannot record compiled code under the CPU graph "
                                   "emulation (no TorchDispatchMode.ignore_compile_internals); use a newer torch")
        n = self.table.max_bucket
        with torch.inference_mode(), self.inputs.dummy(n) as loaded:
            views = loaded.views
            self.step.layers(self.step.model.embed(views["input_ids"]), views["positions"])

    def _uncompile(self, e: BaseException) -> None:
        """The layer stack did not compile: every path runs (and captures) the uncompiled one, and says why."""
        self.step.layers = self.step.model.forward_layers
        self.telemetry.compile_error = f"compile={self.config.compile!r} failed: {first_line(e)}"
        logger.warning("bcg: %s; running the uncompiled layer stack", self.telemetry.compile_error)

    def refuse(self, e: BaseException) -> None:
        """The backend cannot capture this model: every batch runs eagerly from now on, and the log says why."""
        msg = f"backend {self.config.backend!r} cannot capture this model: {first_line(e).rstrip('. ')}."
        if self.config.backend != "breakable":
            msg += " Use backend='breakable', which runs such ops in eager islands."
        self.table.refuse(msg)
