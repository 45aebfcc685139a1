"""The token-bucket runner: static buffers, capture of every bucket, and the replay-or-eager decision.

Captured, per bucket: the whole step from token ids to logits (:mod:`.step`): embedding, layer stack, and the LM head
on the last row of each request that ends in the batch. One capture per token bucket serves any mix of requests: a
live batch of ``num_tokens`` is padded to the smallest bucket, its metadata staged into the bucket's fields in one
copy (:mod:`.inputs`), the graph replayed under the forward context its attention backend makes, and its logits read
from ``static_logits``. A batch no graph can take runs the same step eagerly at its own size.

A runner serialises its forwards with :attr:`Runner.lock`: the static buffers and the telemetry are shared by every
caller, so a forward holds the lock from loading its batch until its logits (a view of ``static_logits``) have been
consumed; the engine holds it across that.

Under tensor parallel (``tp.size > 1``) a :class:`~bcg.runtime.runner.agreement.RankAgreement` makes every rank take
the same decision: each hook below is one call into it, and none runs at ``tp.size == 1``. Building (the backend's
preparation, compiling, capturing every bucket) is the :class:`~bcg.runtime.runner.build.GraphBuilder`'s, which
writes into the same bucket table and telemetry.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bcg.errors import first_line
from bcg.ops.context import forward_context
from bcg.ops.kernels.dispatch import pdl_for
from bcg.ops.kv_cache import KVPool
from bcg.ops.parallel import SINGLE, TensorParallel
from bcg.runtime.backends import GraphResources, backend_class
from bcg.runtime.backends.capture import GraphPool
from bcg.runtime.batch import PrefillBatch
from bcg.runtime.compile import compile_layers
from bcg.runtime.config import EngineConfig
from bcg.runtime.runner.agreement import RankAgreement
from bcg.runtime.runner.buckets import EAGER_FALLBACK, BucketTable
from bcg.runtime.runner.build import GraphBuilder, frozen_gc
from bcg.runtime.runner.full_graphs import FULL_FALLBACK, adopt_full_graphs, full_graph_config
from bcg.runtime.runner.inputs import Loaded, StaticInputs
from bcg.runtime.runner.replay_tools import ReplayTools
from bcg.runtime.runner.step import ModelStep
from bcg.runtime.runner.telemetry import BatchRecord, BucketRecord, Telemetry

__all__ = ["ForwardOutput", "Runner"]

logger = logging.getLogger("bcg")


@dataclass
class ForwardOutput:
    """One forward's result: fp32 logits ``(num_logit_rows, vocab)`` of the batch's wanted requests, in order (a view
    of ``static_logits`` after a replay: consume it under :attr:`Runner.lock`), and its :class:`BatchRecord`."""

    logits: Tensor
    record: BatchRecord


class Runner(ReplayTools):
    """Runs prefill batches of ``model`` through one backend, bucket by bucket (tools look inside a replay through
    :class:`~bcg.runtime.runner.replay_tools.ReplayTools`'s methods).

    Args:
        model: the model (``embed``, ``forward_layers``, ``compute_logits``).
        config: the engine's options.
        kv_pool: the KV pool batches are allocated in.
        bucket_sizes: the token buckets to capture.
        tp: this process's tensor parallel rank; with more than one rank every decision is agreed across ranks.
        pool: another runner's graph pool to capture into (its stream too); None makes one.
        fallback: what serves the batches if this backend is refused, for the log line (the whole-step graphs of a
            breakable runner name the breakable graphs).

    Example::

        runner = Runner(model, EngineConfig(backend="breakable"), kv_pool, bucket_sizes=[16, 32])
        runner.build()                           # captures every bucket, largest first
        out = runner.forward(batch)              # out.logits: (batch.num_logit_rows, vocab); out.record
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, kv_pool: KVPool, bucket_sizes: list[int],
                 tp: TensorParallel = SINGLE, pool: GraphPool | None = None,
                 fallback: str = EAGER_FALLBACK) -> None:
        self.model, self.config, self.kv_pool = model, config, kv_pool
        self.agreement = RankAgreement(tp) if tp.is_parallel else None  # tensor parallel only
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.table = BucketTable(list(bucket_sizes), config.max_padding_factor, config.max_padding_tokens,
                                 config.max_replay_failures, fallback=fallback)
        # Held by one forward at a time (reentrant: the engine holds it around forward and reading its logits).
        self.lock = threading.RLock()
        cls = backend_class(config.backend)
        self.telemetry = Telemetry(backend=config.backend, table=self.table if cls.uses_graphs else None)
        attention = cls.make_attention(kv_pool, config, self.device, self.dtype)
        live = attention if attention.is_island else cls.live_attention(kv_pool, config, self.device, self.dtype)
        self.telemetry.attention_backend = attention.name
        self.telemetry.notes.extend(dict.fromkeys(attention.notes + live.notes))  # each once
        self.inputs = StaticInputs(attention, live, kv_pool, self.table.sizes if cls.uses_graphs else [],
                                   model.config.hidden_size, model.config.vocab_size, config.max_logit_rows,
                                   self.device, self.dtype)
        # The step every path runs (graphs, eager batches, verification): its layer stack compiled once when asked.
        self.step = ModelStep(model, compile_layers(model, config.compile) if config.compile else model.forward_layers)
        self.resources: GraphResources | None = None
        if cls.uses_graphs:
            is_emulated = self.device.type != "cuda"
            # A runner holding another's graphs (the whole-step ones) captures into that one's pool and stream.
            stream = None if is_emulated else pool.stream if pool is not None else torch.cuda.Stream(self.device)
            self.resources = GraphResources(
                step=self.step, inputs=self.inputs, config=config, pool=pool or GraphPool(stream),
                capture_stream=stream, is_emulated=is_emulated,
                barrier_fn=self.agreement.capture_barrier if self.agreement is not None else None)
        self.backend = cls(self.resources)
        self.builder = GraphBuilder(self.step, self.inputs, self.backend, self.resources, self.table, self.telemetry,
                                    config, self.agreement)
        # The small buckets' whole-step graphs (config.full_graph_tokens), tried before the breakable ones: a batch
        # that fits their request slots and key capacity replays one graph and launches no island.
        small = [b for b in self.table.sizes if b <= (config.full_graph_tokens or 0)] if cls.uses_graphs else []
        # They share this runner's graph pool: one forward runs at a time, so their temporaries can share memory.
        self.full = (Runner(model, full_graph_config(config, small), kv_pool, small, tp,
                            self.resources.pool if self.resources is not None else None, FULL_FALLBACK)
                     if small else None)

    @property
    def static_output(self) -> Tensor | None:
        """``(max_bucket, hidden)``: every bucket's step writes its hidden rows here (what verification compares)."""
        return self.inputs.static_output

    @property
    def handles(self) -> dict[int, Any]:
        """Captured handles of the buckets that replay, by bucket."""
        return self.table.handles

    # ---------------------------------------------------------------- build
    def build(self) -> None:
        """Compiles (the layer stack, if asked, and whatever the backend compiles) and captures every bucket,
        largest first, into one shared pool."""
        with self.lock:
            self.builder.prepare()
            self.builder.capture_all()
            if self.full is not None and self.table.refused_reason is None:
                self.full.build()
                adopt_full_graphs(self.telemetry, self.full.telemetry, self.full.table.sizes)

    def agree_buckets(self, what: str) -> None:
        """Tensor parallel: disables on this rank every bucket disabled on another (after ``what``, e.g. verify)."""
        if self.agreement is None or not self.backend.uses_graphs:
            return
        disabled = [self.table.record(b).disabled_reason is not None for b in self.table.sizes]
        for bucket, here, anywhere in zip(self.table.sizes, disabled, self.agreement.agree_buckets(disabled, what)):
            if anywhere and not here:
                self.table.disable(bucket, f"disabled on another tensor parallel rank after {what} (see its log)")

    def enable_bucket(self, bucket: int) -> None:
        """Replays bucket ``bucket``'s captured graph again after it was disabled (a transient fault), and its
        whole-step graph where it has one.

        Raises:
            ValueError: no such bucket, or it has no graph (its capture failed): :meth:`recapture` it instead.
        """
        with self.lock:
            self.table.enable(bucket)
            full = self._full_table(bucket)
            if full is not None and full.entry(bucket).handle is not None:  # its whole-step graph too
                full.enable(bucket)
        logger.info("bcg: bucket %d enabled again", bucket)

    def _full_table(self, bucket: int) -> BucketTable | None:
        """The bucket table of ``bucket``'s whole-step graph, if this runner holds one that was not refused."""
        full = self.full
        if full is None or bucket not in full.table.buckets or full.table.refused_reason is not None:
            return None
        return full.table

    def recapture(self, bucket: int) -> BucketRecord:
        """Drops bucket ``bucket``'s graph, captures it anew and enables it (its whole-step graph as well, where
        ``full_graph_tokens`` gave it one); returns its record, whose ``disabled_reason`` says why if the new capture
        failed too. All or nothing: a capture interrupted by any exception (KeyboardInterrupt included) leaves the
        bucket disabled, with that reason, and re-raises.

        Example::

            record = engine.runner.recapture(16)
            record.disabled_reason is None        # bucket 16 replays again
        """
        entry = self.table.entry(bucket)
        if not self.backend.uses_graphs:
            raise ValueError(f"the {self.config.backend} backend captures nothing")
        if self.table.refused_reason is not None:
            raise ValueError(f"bucket {bucket} cannot be recaptured: {self.table.refused_reason}")
        with self.lock, frozen_gc(), torch.inference_mode():
            entry.handle = None  # the old graph goes first, so the new capture can reuse its memory
            try:
                record = self.builder.capture(bucket)
            except BaseException as e:
                self.table.disable(bucket, f"recapture interrupted: {first_line(e)}; call Engine.recapture again")
                raise
        if record.disabled_reason is None:
            logger.info("bcg: bucket %d recaptured in %.0f ms", bucket, record.capture_ms)
        if self._full_table(bucket) is not None:  # its whole-step graph is captured anew as well
            self.full.recapture(bucket)
        return record

    # ---------------------------------------------------------------- forward
    def choose(self, num_tokens: int, batch: PrefillBatch | None = None) -> tuple[int | None, str]:
        """The single replay-or-eager predicate: (bucket, "graph" or "graph_small_padding") or (None, reason).

        The bucket table judges the token count and every bucket's state; with ``batch`` the backend also checks
        what its graphs bake in besides the token count (``can_run``: request slots and key capacity of "full").
        """
        if not self.backend.uses_graphs:
            return None, "backend_eager"
        choice = self.table.choose(num_tokens)
        if choice.bucket is not None and batch is not None:
            reason = self.backend.can_run(batch, choice.bucket)
            if reason is not None:
                return None, reason
        return choice.bucket, choice.reason

    def forward(self, batch: PrefillBatch) -> ForwardOutput:
        """Runs ``batch``: its wanted requests' logits and the record of how it ran.

        After a replay the logits are a view of ``static_logits``: consume them before the next forward, and from
        several threads inside ``with runner.lock:`` (the engine does). A replay that raises runs the batch eagerly
        and counts against its bucket, which is disabled after ``max_replay_failures`` failures in a row.
        """
        with self.lock:
            if self.full is not None:
                replayed = self.full.replay_if_fits(batch)
                if replayed is not None:
                    return ForwardOutput(replayed[1], self._record(batch, replayed[0], True, "graph_full"))
            bucket, reason = self.choose(batch.num_tokens, batch)
            if self.agreement is not None:  # tensor parallel: the same bucket (or eager) on every rank
                bucket, reason = self.agreement.agree_choice(bucket, reason)
            if bucket is not None:
                logits = self._replay(batch, bucket)
                if logits is not None:
                    return ForwardOutput(logits, self._record(batch, bucket, True, reason))
                reason = "replay_failed"
            if reason != "backend_eager":
                self.telemetry.log_once(reason, f"bcg: running a batch eagerly ({reason}); logged once per reason")
            return ForwardOutput(self._run_eagerly(batch), self._record(batch, None, False, reason))

    def replay_if_fits(self, batch: PrefillBatch) -> tuple[int, Tensor] | None:
        """``(bucket, logits)`` when a graph of this runner takes ``batch`` and replays it; None (nothing run, no
        eager fallback) when none fits or the replay failed, so the caller runs the batch another way."""
        with self.lock:
            bucket, _ = self.choose(batch.num_tokens, batch)
            logits = self._replay(batch, bucket) if bucket is not None else None
            return None if logits is None else (bucket, logits)

    def _replay(self, batch: PrefillBatch, bucket: int) -> Tensor | None:
        """Replays ``bucket`` for ``batch``; its logits, or None when the replay failed (counted against it)."""
        error: BaseException | None = None
        try:
            loaded = self.inputs.load(batch, bucket)
            with forward_context(loaded.context), pdl_for(bucket):  # an island's kernels launch as the graph's did
                self.backend.replay(self.table.buckets[bucket].handle, bucket)
            logits = self._graph_logits(batch, loaded)
        except Exception as e:  # a failed replay falls back to eager for this batch
            error = e
        if self.agreement is not None:  # tensor parallel: a replay failed anywhere is rerun everywhere
            error = self.agreement.agree_replay(bucket, error)
        if error is None:
            self.table.count_success(bucket)
            return logits
        message = first_line(error)
        if not self.table.count_failure(bucket, message):
            logger.info("bcg: replay of bucket %d failed (%s); this batch runs eagerly", bucket, message)
        return None

    def _graph_logits(self, batch: PrefillBatch, loaded: Loaded) -> Tensor:
        head = self.inputs.static_logits[: min(batch.num_logit_rows, loaded.num_head_rows)]
        if batch.num_logit_rows <= loaded.num_head_rows:
            return head
        # More requests end here than the graph's head has rows: the rest through the head eagerly.
        extra = self.model.compute_logits(self.inputs.static_output[loaded.views["extra_logit_rows"]])
        return torch.cat([head, extra.float()])

    def _run_eagerly(self, batch: PrefillBatch) -> Tensor:
        loaded = self.inputs.load_live(batch)
        views = loaded.views
        out = torch.empty(batch.num_tokens, self.model.config.hidden_size, device=self.device, dtype=self.dtype)
        logits = torch.empty(batch.num_logit_rows, self.model.config.vocab_size, device=self.device,
                             dtype=torch.float32)
        with forward_context(loaded.context), pdl_for(batch.num_tokens):
            self.step(views["input_ids"], views["positions"], views["logit_rows"], out, logits)
        return logits

    def _record(self, batch: PrefillBatch, bucket: int | None, used: bool, reason: str) -> BatchRecord:
        return self.telemetry.add_batch(BatchRecord(batch.num_tokens, batch.num_requests, bucket, used, reason))

