"""Recording the eager functions an uncaptured run calls, to compare that run with a graph's eager steps.

Inside :func:`record_eager_calls` every call of an ``@eager_on_graph`` function (outside a capture) is recorded in
order with copies of its tensor arguments before and after the call and of what it returned, so a differential
check can line the calls up with a :class:`~bcg.graph.BreakableCUDAGraph`'s :class:`~bcg.graph.EagerStep`\\ s. It
observes the islands through :func:`bcg.islands.observing_islands`, so runs outside it pay nothing; an eager function
called inside another one is not recorded (it is part of the outer call), as at capture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bcg.islands import observing_islands
from bcg.tensors import tensor_leaves

__all__ = ["EagerCall", "record_eager_calls", "snapshot"]


def snapshot(value: Any) -> list[torch.Tensor]:
    """Copies of the tensors in ``value`` (see :func:`tensor_leaves`)."""
    return [t.detach().clone() for t in tensor_leaves(value)]


@dataclasses.dataclass
class EagerCall:
    """One recorded call: the function's name, its tensor arguments before and after it ran, and its results."""

    name: str
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    results: list[torch.Tensor]


def _recorder(calls: list[EagerCall]) -> Callable[[Callable, str, tuple, dict], Any]:
    def record(fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        before = snapshot((args, kwargs))
        out = fn(*args, **kwargs)
        calls.append(EagerCall(name, before, snapshot((args, kwargs)), snapshot(out)))
        return out

    return record


@contextmanager
def record_eager_calls() -> Iterator[list[EagerCall]]:
    """Records every eager-function call of the block; yields the list the calls are appended to.

    Example::

        with record_eager_calls() as calls:
            model.forward_layers(hidden, positions)
        [c.name for c in calls]             # ['attention', 'attention', ...]
    """
    calls: list[EagerCall] = []
    with observing_islands(_recorder(calls)):
        yield calls
