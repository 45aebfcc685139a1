"""The fixture and checks shared by the primitive's tests on real CUDA graphs (test_graph_cuda,
test_capture_cuda, test_graph_pools_cuda).

The eager functions and the simple capture are the emulation tests' (:mod:`graph_helpers`), re-exported.
``no_stream_left_capturing`` is an autouse fixture: a module that imports it gets it for every test, so no test can
leave a stream capturing. On a GPU, capture does not execute kernels, so these eager functions see garbage at capture
time; the tests only check values after replay.
"""

from __future__ import annotations

import pytest
import torch
from graph_helpers import (  # noqa: F401 - the emulation tests' own
    add_one,
    broken,
    capture_simple,
    check_simple,
    churn_eager,
    churn_inplace,
    double_into,
    flaky_island,
)

import bcg
from bcg import capture as bcg_capture

DEV = "cuda"


@pytest.fixture(autouse=True)
def no_stream_left_capturing():
    yield
    assert not bcg.is_capturing()
    assert not torch.cuda.is_current_stream_capturing()
    for s in bcg_capture._default_streams.values():
        with torch.cuda.stream(s):
            assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()


def cuda_graph() -> bcg.BreakableCUDAGraph:
    """A graph on real CUDA graphs, checked to be one (no silent fallback to the emulation)."""
    g = bcg.BreakableCUDAGraph(emulate=False)
    assert not g.is_emulated and g.device_type == "cuda"
    return g


def assert_nothing_capturing(*extra_streams):
    """No stream is left capturing: the current one, bcg's default capture streams and ``extra_streams``."""
    assert not torch.cuda.is_current_stream_capturing()
    for s in (*bcg_capture._default_streams.values(), *extra_streams):
        with torch.cuda.stream(s):
            assert not torch.cuda.is_current_stream_capturing()
