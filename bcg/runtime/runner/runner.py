"""The token-bucket runner: static buffers, capture of every bucket, and the replay-or-eager decision.

Captured: the layer stack (``model.forward_layers``). Eager: the embedding lookup before it and the final norm,
LM head and sampling on each request's last token after it, so one capture per token bucket serves any mix of
requests. A live batch of ``num_tokens`` is padded to the smallest bucket, copied into static buffers (padded rows
zeroed), replayed under the forward context its backend gives (``load_batch``: the live batch for island backends,
static metadata buffers for a whole-graph backend), and its rows are read back from one max-size output buffer
sliced per bucket.

A runner serialises its forwards with :attr:`Runner.lock`: the static buffers, the backend's metadata and the
telemetry are shared by every caller, so a forward holds the lock from loading its batch until its output (a view of
``static_output``) has been consumed; the engine holds it across the LM head too.

Under tensor parallel (``tp.size > 1``) a :class:`~bcg.runtime.runner.agreement.RankAgreement` makes every rank take
the same decision: each hook below is one call into it, and none runs at ``tp.size == 1``. Building (the backend's
preparation, compiling, capturing every bucket) is the :class:`~bcg.runtime.runner.build.GraphBuilder`'s, which
writes into the same bucket table and telemetry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bcg.errors import first_line
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.ops.parallel import SINGLE, TensorParallel
from bcg.runtime.backends import GraphResources, backend_class
from bcg.runtime.backends.capture import GraphPool
from bcg.runtime.batch import PrefillBatch, PrefillItem
from bcg.runtime.compile import compile_layers
from bcg.runtime.config import EngineConfig
from bcg.runtime.runner.agreement import RankAgreement
from bcg.runtime.runner.buckets import BucketTable
from bcg.runtime.runner.build import GraphBuilder, frozen_gc
from bcg.runtime.runner.telemetry import BatchRecord, BucketRecord, Telemetry

__all__ = ["Runner"]

logger = logging.getLogger("bcg")


class Runner:
    """Runs the layer stack of ``model`` for packed prefill batches through one backend.

    Args:
        model: the model (``embed``, ``forward_layers``).
        config: the engine's options.
        kv_pool: the KV pool batches are allocated in.
        bucket_sizes: the token buckets to capture.
        tp: this process's tensor parallel rank; with more than one rank every decision is agreed across ranks.

    Example::

        runner = Runner(model, EngineConfig(backend="breakable"), kv_pool, bucket_sizes=[16, 32])
        runner.build()                       # captures every bucket, largest first
        hidden = runner.forward(batch)       # (batch.num_tokens, hidden_size)
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, kv_pool: KVPool, bucket_sizes: list[int],
                 tp: TensorParallel = SINGLE) -> None:
        self.model, self.config, self.kv_pool = model, config, kv_pool
        self.agreement = RankAgreement(tp) if tp.is_parallel else None  # tensor parallel only
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.table = BucketTable(list(bucket_sizes), config.max_padding_factor, config.max_padding_tokens,
                                 config.max_replay_failures)
        # Held by one forward at a time (reentrant: the engine holds it around forward and the LM head).
        self.lock = threading.RLock()
        cls = backend_class(config.backend)
        self.telemetry = Telemetry(backend=config.backend, table=self.table if cls.uses_graphs else None)
        self.last_record: BatchRecord | None = None
        # The layer stack every path runs (graphs, eager fallbacks, verification): compiled once when asked.
        self.layers = compile_layers(model, config.compile) if config.compile else model.forward_layers
        self.resources: GraphResources | None = None
        if cls.uses_graphs:
            is_emulated = self.device.type != "cuda"
            stream = None if is_emulated else torch.cuda.Stream(self.device)
            max_tokens, hidden = self.table.max_bucket, model.config.hidden_size
            kw = {"device": self.device, "dtype": self.dtype}
            self.resources = GraphResources(
                model=model, layers=self.layers, config=config, kv_pool=kv_pool, bucket_sizes=self.table.sizes,
                static_hidden=torch.zeros(max_tokens, hidden, **kw),
                static_positions=torch.zeros(max_tokens, dtype=torch.long, device=self.device),
                static_output=torch.zeros(max_tokens, hidden, **kw),
                pool=GraphPool(stream), capture_stream=stream, is_emulated=is_emulated,
                dummy_context=self.dummy_context,
                barrier_fn=self.agreement.capture_barrier if self.agreement is not None else None)
        self.backend = cls(self.resources)
        self.builder = GraphBuilder(model, self.backend, self.resources, self.table, self.telemetry, config,
                                    self.dummy_context, self.agreement)

    # The static buffers belong to the resources; these read them (tools and tests address them directly).
    @property
    def static_hidden(self) -> torch.Tensor:
        return self.resources.static_hidden

    @property
    def static_positions(self) -> torch.Tensor:
        return self.resources.static_positions

    @property
    def static_output(self) -> torch.Tensor:
        return self.resources.static_output

    @property
    def handles(self) -> dict[int, Any]:
        """Captured handles of the buckets that replay, by size."""
        return self.table.handles

    # ---------------------------------------------------------------- build
    def build(self) -> None:
        """Compiles (the layer stack, if asked, and whatever the backend compiles) and captures every bucket,
        largest first, into one shared pool."""
        with self.lock:
            self.layers = self.builder.prepare(self.layers)
            self.builder.capture_all()

    @contextmanager
    def dummy_context(self, n: int) -> Iterator[None]:
        """A one-request batch of ``n`` tokens with real KV slots, live during warmup and capture (and while a
        backend compiles in ``prepare``); its context comes from the backend's ``load_batch``."""
        slots = self.kv_pool.alloc(n)
        try:
            batch = PrefillBatch([PrefillItem(torch.zeros(n, dtype=torch.long), slots)], self.kv_pool)
            if self.resources is not None:
                self.static_positions[:n].copy_(batch.positions)
            with forward_context(self.backend.load_batch(batch, n)):
                yield
        finally:
            self.kv_pool.free(slots)
            if self.resources is not None:
                self.static_positions.zero_()

    def agree_buckets(self, what: str) -> None:
        """Tensor parallel: disables on this rank every bucket disabled on another (after ``what``, e.g. verify)."""
        if self.agreement is None or not self.backend.uses_graphs:
            return
        disabled = [self.table.buckets[n].record.disabled_reason is not None for n in self.table.sizes]
        for n, here, anywhere in zip(self.table.sizes, disabled, self.agreement.agree_buckets(disabled, what)):
            if anywhere and not here:
                self.disable(n, f"disabled on another tensor parallel rank after {what} (see its log)")

    def disable(self, n: int, reason: str) -> None:
        """Stops replaying bucket ``n`` (its batches move up the ladder or run eagerly) and records why."""
        self.builder.disable(n, reason)

    def enable_bucket(self, n: int) -> None:
        """Replays bucket ``n``'s captured graph again after it was disabled (a transient fault).

        Raises:
            ValueError: no such bucket, or it has no graph (its capture failed): :meth:`recapture` it instead.
        """
        with self.lock:
            self.table.enable(n)
        logger.info("bcg: bucket %d enabled again", n)

    def recapture(self, n: int) -> BucketRecord:
        """Drops bucket ``n``'s graph, captures it anew and enables it; returns its record, whose
        ``disabled_reason`` says why if the new capture failed too.

        Example::

            record = engine.runner.recapture(16)
            record.disabled_reason is None        # bucket 16 replays again
        """
        entry = self.table.entry(n)
        if not self.backend.uses_graphs:
            raise ValueError(f"the {self.config.backend} backend captures nothing")
        if self.table.refused_reason is not None:
            raise ValueError(f"bucket {n} cannot be recaptured: {self.table.refused_reason}")
        with self.lock, frozen_gc(), torch.inference_mode():
            entry.handle = None  # the old graph goes first, so the new capture can reuse its memory
            record = self.builder.capture(n)
        if record.disabled_reason is None:
            logger.info("bcg: bucket %d recaptured in %.0f ms", n, record.capture_ms)
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

    def forward(self, batch: PrefillBatch) -> torch.Tensor:
        """Hidden states of the real tokens of ``batch``: (num_tokens, hidden_size).

        On the graph path this is a view of ``static_output``: consume it before the next forward, and from
        several threads, inside ``with runner.lock:`` (the engine does). The batch's :class:`BatchRecord` is
        ``self.last_record``. A replay that raises runs the batch eagerly and counts against its bucket, which is
        disabled after ``max_replay_failures`` failures in a row.
        """
        with self.lock:
            return self._forward(batch)

    def _forward(self, batch: PrefillBatch) -> torch.Tensor:
        n_real = batch.num_tokens
        hidden = self.model.embed(batch.input_ids)
        bucket, reason = self.choose(n_real, batch)
        if self.agreement is not None:  # tensor parallel: the same bucket (or eager) on every rank
            bucket, reason = self.agreement.agree_choice(bucket, reason)
        if bucket is not None:
            error: BaseException | None = None
            try:
                self._load(hidden, batch.positions, bucket)
                with forward_context(self.backend.load_batch(batch, bucket)):
                    self.backend.replay(self.table.buckets[bucket].handle, bucket)
            except Exception as e:  # a failed replay falls back to eager for this batch
                error = e
            if self.agreement is not None:  # tensor parallel: a replay failed anywhere is rerun everywhere
                error = self.agreement.agree_replay(bucket, error)
            if error is None:
                self.table.record_success(bucket)
                self._record(batch, bucket, True, reason)
                return self.static_output[:n_real]
            message = first_line(error)
            if self.table.record_failure(bucket, message):
                logger.warning("bcg: bucket %d disabled: %s", bucket, self.table.record(bucket).disabled_reason)
            else:
                logger.info("bcg: replay of bucket %d failed (%s); this batch runs eagerly", bucket, message)
            reason = "replay_failed"
        if reason != "backend_eager":
            self.telemetry.log_once(reason, f"bcg: running a batch eagerly ({reason}); logged once per reason")
        self._record(batch, None, False, reason)
        with forward_context(batch.to_context(n_real)):
            return self.layers(hidden, batch.positions)

    @contextmanager
    def replay_context(self, batch: PrefillBatch) -> Iterator[tuple[int, Any]]:
        """Loads ``batch`` into the static buffers of its bucket and sets its forward context; yields
        ``(bucket, handle)``. For tools that replay or time the steps of a handle themselves (``bcg analyze``).
        Raises ValueError when the batch would not replay a graph."""
        with self.lock:
            bucket, reason = self.choose(batch.num_tokens, batch)
            if bucket is None:
                raise ValueError(f"a batch of {batch.num_tokens} tokens does not replay a graph ({reason})")
            self._load(self.model.embed(batch.input_ids), batch.positions, bucket)
            with forward_context(self.backend.load_batch(batch, bucket)):
                yield bucket, self.table.buckets[bucket].handle

    def replay_and_eager(self, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch``'s bucket replayed, and the same padded inputs run eagerly under the same forward context:
        ``(graph_rows, eager_rows)`` for the real tokens (the differential check of :mod:`.verify`)."""
        n = batch.num_tokens
        with self.replay_context(batch) as (bucket, handle):
            self.backend.replay(handle, bucket)
            graph_out = self.static_output[:n].clone()
            eager_out = self.layers(self.static_hidden[:bucket], self.static_positions[:bucket])[:n]
        return graph_out, eager_out

    def _load(self, hidden: torch.Tensor, positions: torch.Tensor, bucket: int) -> None:
        n = hidden.shape[0]
        self.static_hidden[:n].copy_(hidden)
        self.static_positions[:n].copy_(positions)
        if n < bucket:  # two launches saved when the batch fills its bucket
            self.static_hidden[n:bucket].zero_()
            self.static_positions[n:bucket].zero_()

    def _record(self, batch: PrefillBatch, bucket: int | None, used: bool, reason: str) -> None:
        self.last_record = self.telemetry.add_batch(
            BatchRecord(batch.num_tokens, batch.num_requests, bucket, used, reason))
