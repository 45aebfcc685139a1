"""The interface every prefill backend implements behind the runner."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bcg.runtime.batch import PrefillBatch
    from bcg.runtime.context import ForwardContext
    from bcg.runtime.runner import Runner

__all__ = ["GraphBackend", "BackendRefused"]


class BackendRefused(RuntimeError):
    """The backend cannot serve this model at all (e.g. an uncapturable op); the engine then runs eagerly."""


class GraphBackend(ABC):
    """Builds one replayable handle per token bucket and replays it against the runner's static buffers.

    The runner owns the static buffers (``static_hidden``, ``static_positions``, ``static_output``), the bucket
    table, the forward context and all fallbacks; a backend only knows how to capture and replay a bucket.
    """

    name: str = "?"
    uses_graphs: bool = True

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def prepare(self) -> None:  # noqa: B027 - optional hook, deliberately empty
        """One-time work before any capture (compilation); its time is reported as compile time."""

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        """Why ``batch`` cannot replay bucket ``bucket`` (a short reason recorded per batch), or None if it can.

        Part of :meth:`Runner.choose`; a backend whose graphs bake in more than the token count (request slots,
        key capacity) says here which batches do not fit.
        """
        return None

    def load_batch(self, batch: PrefillBatch, bucket: int) -> ForwardContext | Any:
        """The forward context to install while bucket ``bucket`` runs ``batch`` (warmup, capture and replay).

        By default the live context, which the attention islands read eagerly; a backend that captures the
        attention too copies the batch into its static metadata here and returns a context over those buffers.
        """
        return batch.to_context(bucket)

    def warmup(self, num_tokens: int) -> None:
        """One uncaptured forward at bucket size (kernel selection, lazy init) before the capture."""
        r = self.runner
        r.model.forward_layers(r.static_hidden[:num_tokens], r.static_positions[:num_tokens])

    @abstractmethod
    def capture(self, num_tokens: int) -> Any:
        """Captures bucket ``num_tokens``: afterwards replaying the handle writes ``static_output[:num_tokens]``."""

    @abstractmethod
    def replay(self, handle: Any, num_tokens: int) -> None:
        """Replays a handle; the live forward context is already set and static inputs are filled."""

    def describe(self, handle: Any) -> tuple[int, int]:
        """(segments, breaks) of a captured handle, for telemetry."""
        return (1, 0)
