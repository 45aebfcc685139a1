"""bcg: breakable CUDA graphs for LLM prefill."""

from bcg.emulation import UncapturableOpError
from bcg.graph import (
    BoundaryMismatchError,
    BreakableCUDAGraph,
    CaptureError,
    LeakError,
    LeakWarning,
    break_graph,
    breakable_graph,
    eager_on_graph,
    force_no_graph,
    is_capturing,
    is_in_breakable_graph,
    no_graph,
)

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
