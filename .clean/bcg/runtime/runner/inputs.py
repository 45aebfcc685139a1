"""The runner's static inputs and outputs: what every bucket's graph reads and writes, and how a batch gets there.

Each bucket has one :class:`~bcg.ops.staging.Layout` in the runner's :class:`~bcg.ops.staging.MetadataArena`: the
runner's own fields (token ids, positions, the rows whose logits are wanted) followed by the attention backend's
(KV slots, cumulative lengths: its capture metadata). Loading a batch writes every field on the host, padded to the
bucket (ids and positions 0, KV writes to the scratch slot, surplus logit rows repeating the first), and moves them
in one pinned, non-blocking copy; the graphs captured against the layout's views then read the batch. Eager batches
get a layout of their own size, in fresh device memory.

The LM head runs inside the graph on ``min(bucket, max_logit_rows)`` rows (no more than the request slots of a
whole-step graph's attention); a batch that ends more requests than that gets the other rows' logits from an eager
head after the replay (their row indices ride in the same copy).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from bcg.ops.attention import AttentionBackend
from bcg.ops.context import ForwardContext, forward_context
from bcg.ops.kernels.dispatch import pdl_for
from bcg.ops.kv_cache import KVPool
from bcg.ops.staging import Field, Layout, MetadataArena, Staged
from bcg.runtime.batch import PrefillBatch, PrefillItem

__all__ = ["Loaded", "StaticBytes", "StaticInputs", "available_bytes", "check_static_bytes"]

# The runner's variable-size field: logit rows beyond what a graph's head computes.
_EXTRA_ROWS = Field("extra_logit_rows", 0)


@dataclass(frozen=True)
class StaticBytes:
    """What a runner's static buffers take, before any is allocated: one set per engine, shared by every bucket and
    sized for the largest (``static_logits``: the head's rows by the vocabulary in fp32; ``static_output``: the
    largest bucket's hidden rows; the metadata arena).

    Example:
        >>> need = StaticBytes(head_rows=64, vocab_size=2**17, max_bucket=2048, hidden_size=4096, itemsize=2, words=9)
        >>> need.logits, need.output
        (33554432, 16777216)
    """

    head_rows: int
    vocab_size: int
    max_bucket: int
    hidden_size: int
    itemsize: int
    words: int

    @property
    def logits(self) -> int:
        return self.head_rows * self.vocab_size * 4

    @property
    def output(self) -> int:
        return self.max_bucket * self.hidden_size * self.itemsize

    @property
    def total(self) -> int:
        return self.logits + self.output + self.words * 8


def available_bytes(device: torch.device) -> int | None:
    """Free memory where the static buffers go: the CUDA device's, or the host's available RAM (None where the OS
    does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_static_bytes(need: StaticBytes, device: torch.device, max_logit_rows: int) -> None:
    """Raises a one-line ValueError, before anything is allocated, when the static buffers do not fit the free memory
    (an allocation that large would fail deep inside torch on CUDA, or swap the host to a halt)."""
    free = available_bytes(device)
    if free is None or need.total <= free:
        return
    gib = 2**30
    raise ValueError(
        f"the static buffers need {need.total / gib:.1f} GiB and the {device.type} has {free / gib:.1f} GiB free: "
        f"logits {need.head_rows} rows x {need.vocab_size} vocab in fp32 = {need.logits / gib:.1f} GiB, hidden "
        f"{need.max_bucket} tokens x {need.hidden_size} = {need.output / gib:.1f} GiB; lower max_logit_rows (now "
        f"{max_logit_rows}) or the largest bucket (max_tokens or buckets, now {need.max_bucket})")


@dataclass
class Loaded:
    """One batch on the device: its forward context and its fields (device views, by name)."""

    context: ForwardContext
    views: dict[str, Tensor]
    num_rows: int  # rows the step runs on (the bucket, or the batch's own size)
    num_head_rows: int  # rows whose logits the step computes (the rest: ``views["extra_logit_rows"]``)


class StaticInputs:
    """The static buffers of a runner and the loading of batches into them.

    Args:
        attention: the attention backend of the graphs (whose fields join every bucket's layout).
        live_attention: the attention backend of eager batches (an island backend: the same one, except for a
            backend whose graphs attend inside, "full").
        kv_pool: the KV pool.
        buckets: the captured token buckets (empty for a runner without graphs).
        hidden_size, vocab_size: the model's.
        max_logit_rows: rows of the LM head inside a graph.
        device, dtype: where the buffers live and the hidden states' dtype.
    """

    def __init__(self, attention: AttentionBackend, live_attention: AttentionBackend, kv_pool: KVPool,
                 buckets: list[int], hidden_size: int, vocab_size: int, max_logit_rows: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.attention, self.live_attention = attention, live_attention
        self.kv_pool, self.device = kv_pool, device
        self.max_logit_rows = max_logit_rows
        self.layouts: dict[int, Layout] = {}
        self.static_output: Tensor | None = None
        self.static_logits: Tensor | None = None
        if not buckets:
            return
        fixed = {b: self._fields(b) for b in buckets}
        max_bucket = max(buckets)
        # The largest fixed part plus the largest tail: cumulative lengths of up to max_bucket requests, read slots
        # (the keys of one batch are distinct pool slots), extra logit rows.
        words = max(sum(f.words for f in fields) for fields, _ in fixed.values())
        words += (3 * max_bucket + 5) // 2 + 1 + kv_pool.num_slots + max_bucket + max_bucket
        check_static_bytes(StaticBytes(self.head_rows(max_bucket), vocab_size, max_bucket, hidden_size,
                                       dtype.itemsize, words), device, max_logit_rows)
        self.arena = MetadataArena(device, words)
        self.layouts = {b: self.arena.layout(*fixed[b]) for b in buckets}
        self.static_output = torch.zeros(max_bucket, hidden_size, device=device, dtype=dtype)
        self.static_logits = torch.zeros(self.head_rows(max_bucket), vocab_size, device=device, dtype=torch.float32)

    def head_rows(self, bucket: int) -> int:
        """Rows of the LM head inside bucket ``bucket``'s graph: a batch ends at most one request a row, and at most
        as many as the attention's request slots (a whole-step graph's: its head then reads and casts a few rows, not
        ``max_logit_rows`` of the vocabulary)."""
        slots = self.attention.max_batch_requests
        return min(bucket, self.max_logit_rows, slots if slots is not None else bucket)

    def _fields(self, num_rows: int, num_head_rows: int | None = None,
                attention: AttentionBackend | None = None) -> tuple[list[Field], tuple[Field, ...]]:
        head = self.head_rows(num_rows) if num_head_rows is None else num_head_rows
        attn_fixed, attn_tail = (attention or self.attention).fields(num_rows)
        own = [Field("input_ids", num_rows), Field("positions", num_rows), Field("logit_rows", head)]
        return own + attn_fixed, (*attn_tail, _EXTRA_ROWS)

    def step_args(self, bucket: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """What bucket ``bucket``'s step reads and writes: ``(input_ids, positions, logit_rows, out, logits)``."""
        views = self.layouts[bucket].views
        return (views["input_ids"], views["positions"], views["logit_rows"], self.static_output[:bucket],
                self.static_logits[: self.head_rows(bucket)])

    def load(self, batch: PrefillBatch, bucket: int) -> Loaded:
        """Stages ``batch`` into bucket ``bucket``'s fields and copies them to the device (one copy)."""
        return self._load(batch, self.layouts[bucket], bucket, self.head_rows(bucket), self.attention)

    def load_live(self, batch: PrefillBatch) -> Loaded:
        """Stages ``batch`` at its own size (an eager run: every logit row in the head) into fresh device memory."""
        n, k, attn = batch.num_tokens, batch.num_logit_rows, self.live_attention
        return self._load(batch, Layout(*self._fields(n, k, attn)), n, k, attn)

    def _load(self, batch: PrefillBatch, layout: Layout, num_rows: int, num_head_rows: int,
              attn: AttentionBackend) -> Loaded:
        extra = max(batch.num_logit_rows - num_head_rows, 0)
        tails = {**attn.tail_lengths(batch), _EXTRA_ROWS.name: extra}
        # A bucket's layout stages in the arena's reused host buffers; an eager batch's in a fresh one.
        staged = self.arena.stage(layout, **tails) if layout.buffer is not None else Staged(layout, tails, self.device)
        self._stage(batch, staged, num_rows, num_head_rows)
        attn.stage(batch, num_rows, staged)
        views = staged.upload()
        return Loaded(attn.context(batch, num_rows, views), views, num_rows, num_head_rows)

    @staticmethod
    def _stage(batch: PrefillBatch, staged: Staged, num_rows: int, num_head_rows: int) -> None:
        host, n = staged.host, batch.num_tokens
        host["input_ids"][:n] = batch.host_input_ids
        host["input_ids"][n:] = 0
        host["positions"][:n] = batch.host_positions
        host["positions"][n:] = 0
        rows, wanted = host["logit_rows"], batch.host_logit_rows
        k = min(len(wanted), num_head_rows)
        rows[:k] = wanted[:k]
        rows[k:] = wanted[0] if k else 0  # surplus head rows repeat a real one; their logits are never read
        if len(wanted) > num_head_rows:
            host[_EXTRA_ROWS.name][:] = wanted[num_head_rows:]

    @contextmanager
    def dummy(self, bucket: int) -> Iterator[Loaded]:
        """A one-request batch of ``bucket`` tokens with real KV slots, loaded into the bucket's fields (or fields of
        its own when no graph has that size) and its forward context installed: what warmup, capture and compilation
        run on; bcg's kernels launch with programmatic dependent launch as a forward of ``bucket`` tokens does
        (:func:`~bcg.ops.kernels.dispatch.pdl_for`), so a graph captured here keeps the bucket's choice."""
        slots = self.kv_pool.alloc(bucket)
        try:
            batch = PrefillBatch([PrefillItem(torch.zeros(bucket, dtype=torch.long), slots)], self.kv_pool)
            loaded = self.load(batch, bucket) if bucket in self.layouts else self.load_live(batch)
            with forward_context(loaded.context), pdl_for(bucket):
                yield loaded
        finally:
            self.kv_pool.free(slots)
