"""The interface every prefill backend implements, and what the runner hands a backend to work with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bcg.ops.context import ForwardContext
from bcg.ops.kv_cache import KVPool
from bcg.runtime.backends.capture import GraphPool
from bcg.runtime.config import EngineConfig

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch

__all__ = ["BackendRefused", "GraphBackend", "GraphResources"]


class BackendRefused(RuntimeError):
    """The backend cannot serve this model at all (e.g. an uncapturable op); the engine then runs eagerly."""


@dataclass
class GraphResources:
    """What a graph backend captures and replays with; the runner owns every one of these.

    Attributes:
        model: the model whose layer stack is captured.
        layers: the layer stack to capture and run, ``layers(hidden, positions)``: ``model.forward_layers``, or
            its compiled form when the engine compiles (``config.compile``).
        config: the engine's options (backend name, debug, compiler, request slots, prefix capacity, warmup).
        kv_pool: the KV pool the islands (or a captured attention) write.
        bucket_sizes: the token buckets, ascending.
        static_hidden, static_positions: ``(max_bucket, hidden)`` / ``(max_bucket,)`` inputs of every graph.
        static_output: ``(max_bucket, hidden)``; every bucket writes its rows here.
        pool: the graph memory pool (its handle changes after a failed capture: read ``pool.handle`` each time).
        capture_stream: the stream captures run on (None when emulating).
        is_emulated: graphs are CPU emulations (no CUDA).
        dummy_context: ``dummy_context(n)`` is a context manager that installs a one-request batch of ``n`` tokens
            (with real KV slots) for warmup, capture and compilation.
        barrier_fn: under tensor parallel, called at capture before each island to align the ranks (breakable
            graphs); None on one rank.
    """

    model: torch.nn.Module
    layers: Callable[[Tensor, Tensor], Tensor]
    config: EngineConfig
    kv_pool: KVPool
    bucket_sizes: list[int]
    static_hidden: Tensor
    static_positions: Tensor
    static_output: Tensor
    pool: GraphPool
    capture_stream: torch.cuda.Stream | None
    is_emulated: bool
    dummy_context: Callable[[int], AbstractContextManager[Any]]
    barrier_fn: Callable[[], None] | None = None

    @property
    def max_bucket(self) -> int:
        return self.bucket_sizes[-1]

    def inputs(self, num_tokens: int) -> tuple[Tensor, Tensor]:
        """The static inputs of bucket ``num_tokens``: ``(static_hidden[:n], static_positions[:n])``."""
        return self.static_hidden[:num_tokens], self.static_positions[:num_tokens]


class GraphBackend(ABC):
    """Builds one replayable handle per token bucket and replays it against the runner's static buffers.

    The runner owns the static buffers, the pool, the bucket table, the forward context and all fallbacks, and
    hands the backend a :class:`GraphResources`; a backend only knows how to capture and replay a bucket.
    """

    name: str = "?"
    uses_graphs: bool = True

    def __init__(self, resources: GraphResources | None) -> None:
        self.resources = resources

    def prepare(self) -> None:  # noqa: B027 - optional hook, deliberately empty
        """One-time work before any capture (compilation); its time is reported as compile time."""

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        """Why ``batch`` cannot replay bucket ``bucket`` (a short reason recorded per batch), or None if it can.

        Part of :meth:`Runner.choose`; a backend whose graphs bake in more than the token count (request slots,
        key capacity) says here which batches do not fit.
        """
        return None

    def load_batch(self, batch: PrefillBatch, bucket: int) -> ForwardContext:
        """The forward context to install while bucket ``bucket`` runs ``batch`` (warmup, capture and replay).

        By default the live context, which the attention islands read eagerly; a backend that captures the
        attention too copies the batch into its static metadata here and returns a context over those buffers.
        """
        return batch.to_context(bucket)

    def warmup(self, num_tokens: int) -> None:
        """One uncaptured forward at bucket size (kernel selection, lazy init) before the capture."""
        self.resources.layers(*self.resources.inputs(num_tokens))

    @abstractmethod
    def capture(self, num_tokens: int) -> Any:
        """Captures bucket ``num_tokens``: afterwards replaying the handle writes ``static_output[:num_tokens]``."""

    @abstractmethod
    def replay(self, handle: Any, num_tokens: int) -> None:
        """Replays a handle; the live forward context is already set and static inputs are filled."""

    def describe(self, handle: Any) -> tuple[int, int]:
        """(segments, breaks) of a captured handle, for telemetry."""
        return (1, 0)
