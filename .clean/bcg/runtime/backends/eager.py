"""The eager backend ("disabled"): no graphs; every batch runs the layer stack op by op."""

from __future__ import annotations

from typing import Any

from bcg.runtime.backends.base import GraphBackend

__all__ = ["EagerBackend"]


class EagerBackend(GraphBackend):
    """The baseline every speedup is measured against (built with no resources: it captures nothing)."""

    name = "eager"
    uses_graphs = False

    def capture(self, num_tokens: int) -> Any:
        raise RuntimeError("the eager backend captures nothing")

    def replay(self, handle: Any, num_tokens: int) -> None:
        raise RuntimeError("the eager backend replays nothing")
