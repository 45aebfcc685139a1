"""bcg: breakable CUDA graphs for LLM prefill.

The public names are imported on first use (``bcg.breakable_graph`` imports torch then), so the ``bcg`` command can
print its help, its version or a usage error without the seconds ``import torch`` takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bcg.lazy import lazy_exports

if TYPE_CHECKING:
    from bcg.boundary import BoundaryMismatchError
    from bcg.capture import breakable_graph
    from bcg.capture_rules import UncapturableOpError
    from bcg.graph import BreakableCUDAGraph, CaptureError
    from bcg.islands import (
        break_graph,
        eager_on_graph,
        force_no_graph,
        is_capturing,
        is_in_breakable_graph,
        no_graph,
    )
    from bcg.leaks import LeakError, LeakWarning

# Each public name and the module that defines it.
_HOMES = {
    "BoundaryMismatchError": "bcg.boundary",
    "BreakableCUDAGraph": "bcg.graph",
    "CaptureError": "bcg.graph",
    "LeakError": "bcg.leaks",
    "LeakWarning": "bcg.leaks",
    "UncapturableOpError": "bcg.capture_rules",
    "break_graph": "bcg.islands",
    "breakable_graph": "bcg.capture",
    "eager_on_graph": "bcg.islands",
    "force_no_graph": "bcg.islands",
    "is_capturing": "bcg.islands",
    "is_in_breakable_graph": "bcg.islands",
    "no_graph": "bcg.islands",
}
__all__ = [
    "BoundaryMismatchError",
    "BreakableCUDAGraph",
    "CaptureError",
    "LeakError",
    "LeakWarning",
    "UncapturableOpError",
    "break_graph",
    "breakable_graph",
    "eager_on_graph",
    "force_no_graph",
    "is_capturing",
    "is_in_breakable_graph",
    "no_graph",
]
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
