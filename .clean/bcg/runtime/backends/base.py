"""The interface every prefill backend implements, and what the runner hands a backend to work with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

from bcg.ops.attention import AttentionBackend, attention_backend
from bcg.ops.kv_cache import KVPool
from bcg.runtime.backends.capture import GraphPool

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from bcg.ops.staging import Layout
    from bcg.runtime.batch import PrefillBatch
    from bcg.runtime.config import EngineConfig

__all__ = ["BackendRefused", "GraphBackend", "GraphResources", "Step", "StepInputs"]


class Step(Protocol):
    """The step a bucket captures (the runner's :class:`~bcg.runtime.runner.step.ModelStep` is one)."""

    model: torch.nn.Module

    def __call__(self, input_ids: Tensor, positions: Tensor, logit_rows: Tensor, out: Tensor, logits: Tensor
                 ) -> None: ...

    def function(self) -> Callable[..., None]: ...


class StepInputs(Protocol):
    """The static inputs a backend captures against (the runner's :class:`~bcg.runtime.runner.inputs.StaticInputs`
    is one): each bucket's fields, the step's arguments per bucket, a dummy batch, the graphs' attention backend."""

    layouts: dict[int, Layout]
    attention: AttentionBackend

    def step_args(self, bucket: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...

    def dummy(self, bucket: int) -> AbstractContextManager[Any]: ...


class BackendRefused(RuntimeError):
    """The backend cannot serve this model at all (e.g. an uncapturable op); the engine then runs eagerly."""


@dataclass
class GraphResources:
    """What a graph backend captures and replays with; the runner owns every one of these.

    Attributes:
        step: the step every bucket captures (embedding, layer stack, LM head: :class:`~bcg.runtime.runner.step.
            ModelStep`); its ``layers`` are the compiled stack when the engine compiles (``config.compile``).
        inputs: the static inputs and outputs (:class:`~bcg.runtime.runner.inputs.StaticInputs`): ``step_args(n)``
            are what bucket ``n``'s step reads and writes, ``dummy(n)`` installs a one-request batch of ``n`` tokens
            for warmup, capture and compilation.
        config: the engine's options.
        pool: the graph memory pool (its handle changes after a failed capture: read ``pool.handle`` each time).
        capture_stream: the stream captures run on (None when emulating).
        is_emulated: graphs are CPU emulations (no CUDA).
        barrier_fn: under tensor parallel, called at capture before each island to align the ranks (breakable
            graphs); None on one rank.
    """

    step: Step
    inputs: StepInputs
    config: EngineConfig
    pool: GraphPool
    capture_stream: torch.cuda.Stream | None
    is_emulated: bool
    barrier_fn: Callable[[], None] | None = None

    @property
    def bucket_sizes(self) -> list[int]:
        return sorted(self.inputs.layouts)

    @property
    def max_bucket(self) -> int:
        return self.bucket_sizes[-1]

    def run(self, num_tokens: int) -> None:
        """Runs bucket ``num_tokens``'s step on the static buffers (what warmup runs and capture records)."""
        self.step(*self.inputs.step_args(num_tokens))


class GraphBackend(ABC):
    """Builds one replayable handle per token bucket and replays it against the runner's static buffers.

    The runner owns the static buffers, the pool, the bucket table, the forward context and all fallbacks, and
    hands the backend a :class:`GraphResources`; a backend only knows how to capture and replay a bucket, and
    which attention backend its graphs need (:meth:`make_attention`).
    """

    name: ClassVar[str] = "?"
    uses_graphs: ClassVar[bool] = True

    def __init__(self, resources: GraphResources | None) -> None:
        self.resources = resources

    @classmethod
    def default_attention(cls, device: torch.device, dtype: torch.dtype) -> str:
        """The attention backend this backend runs when ``attention_backend`` is None (what
        :meth:`EngineConfig.resolved` writes there): the live default for the device and dtype."""
        from bcg.ops.attention import default_attention_backend

        return default_attention_backend(device, dtype)

    @classmethod
    def make_attention(cls, kv_pool: KVPool, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype) -> AttentionBackend:
        """The attention backend this backend's graphs run (by default the live one, :meth:`live_attention`); an
        attention that only a whole-layer-stack graph holds ("static", "static_triton") is refused here rather than
        swapped for the live default, so the resolved config never names an attention the engine does not run."""
        asked = config.attention_backend
        if asked is not None and not attention_backend(asked).is_island:
            raise ValueError(f"attention_backend={asked!r} attends inside a whole-layer-stack graph, which only "
                             f"backend='full' captures; with backend={cls.name!r} leave attention_backend unset or "
                             "name an island attention (varlen, triton, sdpa)")
        return cls.live_attention(kv_pool, config, device, dtype)

    @staticmethod
    def live_attention(kv_pool: KVPool, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype) -> AttentionBackend:
        """The island attention every eager batch runs: ``config.attention_backend`` when it is an island backend,
        else the default for the device and dtype ("varlen" on CUDA in half precision, else "sdpa")."""
        from bcg.ops.attention import default_attention_backend

        asked = config.attention_backend
        if asked is not None and not attention_backend(asked).is_island:
            asked = None  # "static": the graphs' attention; eager batches run the live default
        name = asked or default_attention_backend(device, dtype)
        cls_ = attention_backend(name)
        if not cls_.is_island:
            raise ValueError(f"attention_backend={name!r} attends inside a whole-layer-stack graph, which only "
                             "backend='full' captures; leave attention_backend unset for this backend")
        reason = cls_.is_usable(device, dtype)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
        return cls_(kv_pool)

    def prepare(self) -> None:  # noqa: B027 - an optional hook, deliberately empty
        """One-time work before any capture (compilation); its time is reported as compile time."""

    def can_run(self, batch: PrefillBatch, bucket: int) -> str | None:
        """Why ``batch`` cannot replay bucket ``bucket`` (a short reason recorded per batch), or None if it can.

        Part of :meth:`Runner.choose`; a backend whose graphs bake in more than the token count (request slots,
        key capacity) says here which batches do not fit.
        """
        return None

    def warmup(self, num_tokens: int) -> None:
        """One uncaptured forward at bucket size (kernel selection, lazy init) before the capture."""
        self.resources.run(num_tokens)

    @abstractmethod
    def capture(self, num_tokens: int) -> Any:
        """Captures bucket ``num_tokens``: afterwards replaying the handle runs the bucket's step on its fields."""

    @abstractmethod
    def replay(self, handle: Any, num_tokens: int) -> None:
        """Replays a handle; the batch is loaded into the bucket's fields and its forward context is installed."""

    def describe(self, handle: Any) -> tuple[int, int]:
        """(segments, breaks) of a captured handle, for telemetry."""
        return (1, 0)
