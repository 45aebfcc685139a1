"""What a CUDA graph cannot capture (host reads, data-dependent shapes) raises UncapturableOpError during an emulated
capture, and is fine inside an eager function or outside a capture; the capturable cousins of those ops capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_helpers import no_debris  # noqa: F401 - an autouse fixture: imported, it runs for every test here

import bcg
from bcg.capture_rules import UncapturableOpError
from bcg.emulation import EmulatedGraph


def _uncapturable_ops():
    """(id, op) pairs; each op is illegal in a CUDA graph capture and fine anywhere else."""
    return [
        ("item", lambda t: t.sum().item()),
        ("int", lambda t: int(t.sum())),
        ("float", lambda t: float(t.sum())),
        ("bool", lambda t: bool(t.sum())),
        ("if", lambda t: 1 if t.sum() else 0),
        ("tolist", lambda t: t.tolist()),
        ("cpu", lambda t: t.cpu()),
        ("numpy", lambda t: t.numpy()),
        ("np.asarray", lambda t: np.asarray(t)),
        ("print", lambda t: print(t)),
        ("repr", lambda t: repr(t)),
        ("str", lambda t: str(t)),
        ("format", lambda t: f"{t}"),
        ("nonzero", lambda t: t.nonzero()),
        ("where-1-arg", lambda t: torch.where(t > 0)),
        ("bool-mask-index", lambda t: t[t > 0]),
        ("bool-mask-index-put", lambda t: t.__setitem__(t > 0, 0.0)),
        ("masked_select", lambda t: torch.masked_select(t, t > 0)),
        ("unique", lambda t: torch.unique(t)),
        ("unique-dim", lambda t: torch.unique(t.view(2, 2), dim=0)),
        ("unique_consecutive", lambda t: torch.unique_consecutive(t)),
        ("bincount", lambda t: torch.bincount(t.long())),
        ("equal", lambda t: torch.equal(t, t)),
        ("allclose", lambda t: torch.allclose(t, t)),
        ("torch.tensor", lambda t: torch.tensor([1.0, 2.0])),
        ("one_hot-no-classes", lambda t: torch.nn.functional.one_hot(t.long())),
        ("repeat_interleave", lambda t: torch.repeat_interleave(t, t.long())),
    ]


UNCAPTURABLE = [pytest.param(op, id=name) for name, op in _uncapturable_ops()]


def _input():
    return torch.tensor([1.0, 0.0, 2.0, 1.0])


# ----------------------------------------------------------------------------------------------------------------
# uncapturable operations


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_uncapturable_op_raises_in_an_emulated_capture(op, inference):
    # Inference mode (how the runner captures) routes some host reads to other ops: bool(t) -> is_nonzero,
    # torch.where(cond) -> where.default, int(t) -> item.
    x = _input()
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        try:
            with pytest.raises(bcg.UncapturableOpError, match="cannot be captured in a CUDA graph"):
                op(x)
        finally:
            with pytest.raises(bcg.UncapturableOpError, match="invalidated"):
                g.capture_end()


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_uncapturable_op_fails_a_breakable_capture_cleanly(op):
    x = _input()
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(bcg.UncapturableOpError):
        with bcg.breakable_graph(g):
            bcg.break_graph()
            op(x * 1)
    assert not g.is_captured


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_the_same_op_is_fine_inside_an_eager_function(op):
    @bcg.eager_on_graph
    def host_side(x, out):
        op(x.clone())
        out.fill_(int(x.sum()))  # a host read, legal here

    x, out = _input(), torch.zeros(2)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        host_side(x, out)  # a graph input: its values at capture are real (a segment's output would be garbage)
        y = out * 2
    x.fill_(3.0)
    g.replay()
    torch.testing.assert_close(y, torch.full((2,), 24.0))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("op", UNCAPTURABLE)
def test_the_same_op_is_fine_outside_a_capture(op):
    expected, x = op(_input()), _input()  # before any capture
    g = EmulatedGraph()
    g.capture_begin()
    with pytest.raises(UncapturableOpError):
        op(x)  # refused while capturing
    with pytest.raises(UncapturableOpError, match="invalidated"):
        g.capture_end()  # as on CUDA, the capture it broke cannot be ended as if nothing happened
    assert _same(op(_input()), expected)  # guards are gone once the capture ended: the same result as before


def test_eager_functions_may_return_data_dependent_shapes_padded():
    @bcg.eager_on_graph
    def positive_positions(x, out):
        idx = x.nonzero().flatten()  # data-dependent: fine eagerly
        out.fill_(-1)
        out[: idx.numel()] = idx

    x, out = _input(), torch.empty(4, dtype=torch.int64)
    g = bcg.BreakableCUDAGraph(emulate=True)
    with bcg.breakable_graph(g):
        positive_positions(x * 1, out)
        y = out + 0
    x.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([2, -1, -1, -1]))


def test_capturable_cousins_are_allowed():
    # fixed-shape versions of the ops above capture fine
    x = torch.tensor([1.0, -2.0, 3.0, 0.0])
    g = EmulatedGraph()
    g.capture_begin()
    a = torch.where(x > 0, x, torch.zeros_like(x))
    b = x.masked_fill(x < 0, 0.0)
    c = torch.zeros(4, 2, dtype=torch.int64).scatter_(1, (x > 0).long().unsqueeze(1), 1)  # one-hot, fixed shape
    vals, ids = x.topk(2)
    d = x[torch.arange(2)]  # integer indexing has a fixed shape
    e = torch.repeat_interleave(x, torch.full((4,), 2), output_size=8)
    g.capture_end()
    x.copy_(torch.tensor([-1.0, 2.0, 0.0, 4.0]))
    g.replay()
    torch.testing.assert_close(a, torch.tensor([0.0, 2.0, 0.0, 4.0]))
    torch.testing.assert_close(b, torch.tensor([0.0, 2.0, 0.0, 4.0]))
    assert torch.equal(c, torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]]))
    torch.testing.assert_close(d, torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(vals, torch.tensor([4.0, 2.0]))
    assert torch.equal(ids, torch.tensor([3, 1]))
    torch.testing.assert_close(e, x.repeat_interleave(2))


# ----------------------------------------------------------------------------------------------------------------
# repeat_interleave: int repeats capture, tensor repeats do not


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
def test_repeat_interleave_with_int_repeats_captures(inference):
    # Regression: under inference mode the int-repeats overload reaches the dispatcher undecomposed
    # (aten.repeat_interleave.self_int); it is an expand and a copy, so a CUDA graph captures it.
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        y = x.repeat_interleave(3, dim=0)
        g.capture_end()
        x.copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
        g.replay()
    torch.testing.assert_close(y, torch.tensor([[5.0, 6.0]] * 3 + [[7.0, 8.0]] * 3))


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("call", [lambda x, r: torch.repeat_interleave(r), lambda x, r: x.repeat_interleave(r, dim=0)],
                         ids=["repeats-only", "self-and-repeats"])
def test_repeat_interleave_with_tensor_repeats_is_still_refused(inference, call):
    x, repeats = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 2])
    g = EmulatedGraph()
    with torch.inference_mode(inference):
        g.capture_begin()
        with pytest.raises(bcg.UncapturableOpError, match="repeat_interleave with tensor repeats"):
            call(x, repeats)
        with pytest.raises(bcg.UncapturableOpError, match="invalidated"):
            g.capture_end()
