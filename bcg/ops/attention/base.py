"""What every attention backend implements, the live batch it reads, and the registry of backends by name.

An attention backend is one way to compute causal attention over a packed batch, and the owner of the metadata it
reads. The runner calls only its hooks: :meth:`~AttentionBackend.fields` (what it needs staged for a forward of a
given shape: its capture metadata for a bucket, allocated with the runner's :class:`~bcg.ops.staging.MetadataArena`),
:meth:`~AttentionBackend.stage` (a batch's values written into those fields on the host, for capture and for every
replay) and :meth:`~AttentionBackend.context` (the forward context over the uploaded fields). Models never ask which
backend runs: they call :func:`bcg.ops.attention.attention`, which asks the context.

A backend whose ``attend`` reads host values of the live batch (``is_island``) attends inside an
``@eager_on_graph`` island; one whose ``attend`` reads only fixed-size device fields attends inside the graph.
Either way the K/V write (:meth:`BatchContext.store_kv`) is a fixed-shape op in the graph segment: padded rows write
the pool's scratch slot.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
from torch import Tensor

from bcg.leaks import mark_private
from bcg.ops.context import AttentionFeatures, ForwardContext
from bcg.ops.kv_cache import KVPool
from bcg.ops.staging import Field, Staged

if TYPE_CHECKING:
    import torch

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "BatchContext", "HostBatch", "attention_backend",
           "register_attention_backend"]


_MISSING = object()


class HostBatch(Protocol):
    """A packed batch's metadata on the host (:class:`bcg.runtime.batch.PrefillBatch` has it).

    ``seq_lens_q``/``prefix_lens`` are per request; ``cu_seqlens_q``/``cu_seqlens_k`` their prefix sums (R + 1);
    ``write_slots`` the pool slot of each new token; ``read_slots`` each request's prefix slots then its new slots;
    ``run_starts`` per request its first read slot where its read slots run up by one, else -1.
    """

    num_tokens: int
    num_requests: int
    seq_lens_q: list[int]
    prefix_lens: list[int]
    has_prefix: bool
    max_seqlen_q: int
    max_seqlen_k: int
    host_cu_seqlens_q: np.ndarray
    host_cu_seqlens_k: np.ndarray
    host_write_slots: np.ndarray
    host_read_slots: np.ndarray
    host_run_starts: np.ndarray


class BatchContext(ForwardContext):
    """The live batch as the islands read it: host ints of this forward plus device views of its fields.

    Request ``r`` has ``seq_lens_q[r]`` new tokens after ``prefix_lens[r]`` cached ones; its rows are
    ``cu_seqlens_q[r]:cu_seqlens_q[r + 1]`` and its keys (prefix then new) ``read_slots[cu_seqlens_k[r]:
    cu_seqlens_k[r + 1]]``. Rows ``[num_tokens:num_padded_tokens]`` are padding.

    Attributes:
        num_tokens, num_padded_tokens: real rows and rows the layer stack runs on (the bucket).
        seq_lens_q, prefix_lens: per request, host ints.
        cu_seqlens_q, cu_seqlens_k: int32 ``(R + 1,)`` on the device.
        padded_cu_seqlens: int32 ``(R + 2,)``: ``cu_seqlens_q`` with the padded rows as one more sequence (keys = its
            own rows), so a kernel over every row writes finite values into the padded ones.
        max_seqlen_q, max_seqlen_k: longest new run and key range (host ints).
        padded_max_seqlen: longest run of ``padded_cu_seqlens`` (the padded rows' one included).
        write_slots: int64 ``(num_padded_tokens,)``: each row's pool slot, the scratch slot for padded rows.
        read_slots: int64 ``(sum of key ranges,)``; ``write_slots[:num_tokens]`` when no request has a prefix.
        has_prefix: whether any request continues from cached tokens.
        kv_pool: the pool.
        backend: the attention backend that attends.
    """

    def __init__(self, num_tokens: int, num_padded_tokens: int, seq_lens_q: list[int], prefix_lens: list[int],
                 cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, padded_cu_seqlens: Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, write_slots: Tensor, read_slots: Tensor, has_prefix: bool, kv_pool: KVPool,
                 backend: AttentionBackend) -> None:
        if not 0 < num_tokens <= num_padded_tokens:
            raise ValueError(f"need 0 < num_tokens <= num_padded_tokens, got num_tokens={num_tokens}, "
                             f"num_padded_tokens={num_padded_tokens}")
        self.num_tokens, self.num_padded_tokens = num_tokens, num_padded_tokens
        self.seq_lens_q, self.prefix_lens = seq_lens_q, prefix_lens
        self.cu_seqlens_q, self.cu_seqlens_k, self.padded_cu_seqlens = cu_seqlens_q, cu_seqlens_k, padded_cu_seqlens
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.padded_max_seqlen = max(max_seqlen_q, num_padded_tokens - num_tokens)
        self.write_slots, self.read_slots = write_slots, read_slots
        self.has_prefix, self.kv_pool, self.backend = has_prefix, kv_pool, backend
        self._memo: dict = {}

    def __repr__(self) -> str:
        return (f"BatchContext(num_tokens={self.num_tokens}, num_padded_tokens={self.num_padded_tokens}, "
                f"num_requests={self.num_requests}, has_prefix={self.has_prefix}, backend={self.backend.name!r})")

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_q)

    @functools.cached_property
    def seq_lens_k(self) -> list[int]:
        """Key range length (prefix + new) per request."""
        return [p + q for p, q in zip(self.prefix_lens, self.seq_lens_q)]

    @property
    def attends_in_graph(self) -> bool:
        return not self.backend.is_island

    def live(self, island: str, why: str) -> BatchContext:
        """This context: it is the live batch."""
        return self

    def memo(self, key: object, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per forward (a context lives for one forward): what several islands of the
        forward need alike (the DSA indexers' key ranges) is launched once, not once per layer. Only islands read
        it, never a graph segment (so the leak check is told it is private)."""
        value = self._memo.get(key, _MISSING)
        if value is _MISSING:
            value = self._memo[key] = mark_private(make())
        return value

    def store_kv(self, layer_id: int, k: Tensor, v: Tensor) -> None:
        """Writes every row's K/V at its slot (padded rows: the scratch slot); fixed shapes, captured in the segment."""
        pool = self.kv_pool
        pool.k[layer_id].index_copy_(0, self.write_slots, k)
        pool.v[layer_id].index_copy_(0, self.write_slots, v)

    def keys_values(self, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Every request's keys/values packed like ``read_slots`` (the new rows' own when nothing is cached)."""
        if not self.has_prefix:
            n = self.num_tokens
            return (k, v) if n == k.shape[0] else (k[:n], v[:n])
        pool = self.kv_pool
        return pool.k[layer_id][self.read_slots], pool.v[layer_id][self.read_slots]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        self.backend.attend(self, q, k, v, out, layer_id)

    def attend_with(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        self.backend.attend_with(self, q, k, v, out, layer_id, features)


class AttentionBackend(ABC):
    """One attention implementation and the metadata it reads (see the module docstring).

    Args:
        kv_pool: the pool its contexts write and read.

    Attributes:
        notes: what a user should know about how it runs on this device and torch build (the engine's telemetry
            shows them); empty when nothing is out of the ordinary.
    """

    name: ClassVar[str] = "?"
    is_island: ClassVar[bool] = True
    # Whether layers with features (windows, sinks, scales) may take FlashAttention (else the exact reference).
    features_flash: ClassVar[bool] = False

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self.notes: list[str] = []

    @property
    def max_batch_requests(self) -> int | None:
        """The most requests one forward it attends may pack (its request slots), or None for no bound."""
        return None

    @classmethod
    def is_usable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on ``device``/``dtype`` (None if it can)."""
        return None

    def fields(self, num_rows: int) -> tuple[list[Field], tuple[Field, ...]]:
        """The fixed fields of a forward of ``num_rows`` rows and its variable-size tail fields (the live default:
        the write slots fixed; cumulative lengths and read slots in the tail)."""
        return [Field("write_slots", num_rows)], (Field("cu_seqlens", 0, "int32"), Field("read_slots", 0))

    def tail_lengths(self, batch: HostBatch) -> dict[str, int]:
        """The sizes of ``batch``'s tail fields."""
        keys = batch.num_tokens + sum(batch.prefix_lens) if batch.has_prefix else 0
        return {"cu_seqlens": 3 * batch.num_requests + 4, "read_slots": keys}

    def stage(self, batch: HostBatch, num_rows: int, staged: Staged) -> None:
        """Writes ``batch``'s values into its fields of ``staged`` (padded to ``num_rows``)."""
        host, n, r = staged.host, batch.num_tokens, batch.num_requests
        write = host["write_slots"]
        write[:n] = batch.host_write_slots
        write[n:] = self.kv_pool.scratch_slot
        cu = host["cu_seqlens"]  # [cu_q (R+1) | cu_k (R+1) | cu_q with the padded rows as one more sequence (R+2)]
        cu[: r + 1] = batch.host_cu_seqlens_q
        cu[r + 1 : 2 * r + 2] = batch.host_cu_seqlens_k
        cu[2 * r + 2 : 3 * r + 3] = batch.host_cu_seqlens_q
        cu[3 * r + 3] = num_rows
        if batch.has_prefix:
            host["read_slots"][:] = batch.host_read_slots

    def context(self, batch: HostBatch, num_rows: int, views: dict[str, Tensor]) -> ForwardContext:
        """The forward context over ``batch``'s uploaded fields (``views``, by name)."""
        r = batch.num_requests
        cu = views["cu_seqlens"]
        write = views["write_slots"]
        read = views["read_slots"] if batch.has_prefix else write[: batch.num_tokens]
        return BatchContext(batch.num_tokens, num_rows, batch.seq_lens_q, batch.prefix_lens, cu[: r + 1],
                            cu[r + 1 : 2 * r + 2], cu[2 * r + 2 :], batch.max_seqlen_q, batch.max_seqlen_k, write,
                            read, batch.has_prefix, self.kv_pool, self)

    @abstractmethod
    def attend(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int) -> None:
        """Causal attention of ``ctx``'s rows into ``out`` (every row finite; padded rows need not be zero); the
        K/V are already in the pool (:meth:`BatchContext.store_kv`)."""

    def attend_with(self, ctx: BatchContext, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int,
                    features: AttentionFeatures) -> None:
        """:meth:`attend` with a sliding window, sinks, a soft-cap or a scale (:mod:`bcg.ops.attention.features`)."""
        from bcg.ops.attention.features import feature_attention

        n = ctx.num_tokens
        keys, values = ctx.keys_values(layer_id, k, v)
        feature_attention(q[:n], keys, values, ctx, features, out[:n], flash=self.features_flash)
        if n < ctx.num_padded_tokens:
            out[n:].zero_()


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: makes ``cls`` selectable by its ``name`` (``Engine(attention_backend=name)``)."""
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class called ``name``; a ValueError naming the registered ones otherwise."""
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(sorted(ATTENTION_BACKENDS))}")
    return cls
