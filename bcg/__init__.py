"""bcg: breakable CUDA graphs for LLM prefill."""

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
