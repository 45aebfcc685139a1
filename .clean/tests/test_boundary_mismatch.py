"""Boundary mismatch errors: an eager function whose result at replay differs from its capture's raises naming both
signatures, touches no buffer, and a good replay recovers; a matching non-contiguous result is copied by value."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import Pair, boundary_of, capture_emulated

import bcg


def _mismatch_case(captured, replayed):
    """A graph whose eager function returns ``captured`` at capture and ``replayed(x)`` at replay."""
    state = {"replay": False}

    @bcg.eager_on_graph
    def shifty(x):
        return replayed(x) if state["replay"] else captured(x)

    x = torch.zeros(4)
    g, _ = capture_emulated(lambda x: shifty(x * 1), x)
    state["replay"] = True
    return g, state


@pytest.mark.parametrize(
    "captured, replayed, captured_sig, replay_sig",
    [
        pytest.param(lambda x: x + 1, lambda x: torch.zeros(5), "Tensor(shape=[4]", "Tensor(shape=[5]", id="shape"),
        pytest.param(lambda x: x + 1, lambda x: torch.zeros(1), "Tensor(shape=[4]", "Tensor(shape=[1]",
                     id="broadcastable-shape"),
        pytest.param(lambda x: x + 1, lambda x: torch.zeros(4, dtype=torch.float64), "dtype=torch.float32",
                     "dtype=torch.float64", id="dtype"),
        pytest.param(lambda x: x + 1, lambda x: torch.zeros(4, device="meta"), "device=cpu", "device=meta",
                     id="device"),
        pytest.param(lambda x: x + 1, lambda x: None, "Tensor(shape=[4]", "NoneType(None)", id="tensor-to-none"),
        pytest.param(lambda x: None, lambda x: x + 1, "NoneType(None)", "Tensor(shape=[4]", id="none-to-tensor"),
        pytest.param(lambda x: (x, x), lambda x: (x, x, x), "tuple(Tensor", "tuple(Tensor", id="tuple-length"),
        pytest.param(lambda x: (x, x), lambda x: [x, x], "tuple(", "list(", id="tuple-to-list"),
        pytest.param(lambda x: {"a": x}, lambda x: {"b": x}, "dict(a=", "dict(b=", id="dict-keys"),
        pytest.param(lambda x: (x, 3), lambda x: (x, 4), "int(3)", "int(4)", id="int-value"),
        pytest.param(lambda x: (x, "a"), lambda x: (x, "b"), "str('a')", "str('b')", id="str-value"),
        pytest.param(lambda x: (x, 1), lambda x: (x, True), "int(1)", "bool(True)", id="value-type"),
        pytest.param(lambda x: (x, None), lambda x: (x, x), "NoneType(None)", "Tensor(shape=[4]",
                     id="nested-none-to-tensor"),
        pytest.param(lambda x: Pair(x, x), lambda x: Pair(x, x, tag="other"), "tag=str('pair')",
                     "tag=str('other')", id="dataclass-field"),
        pytest.param(lambda x: {"a": (x, x)}, lambda x: {"a": (x, x[:2])}, "Tensor(shape=[4]", "Tensor(shape=[2]",
                     id="nested-shape"),
    ],
)
def test_replay_mismatch_raises_with_both_signatures(captured, replayed, captured_sig, replay_sig):
    g, _ = _mismatch_case(captured, replayed)
    with pytest.raises(bcg.BoundaryMismatchError) as info:
        g.replay()
    msg = str(info.value)
    assert "shifty" in msg
    captured_line = next(line for line in msg.splitlines() if line.strip().startswith("captured:"))
    replay_line = next(line for line in msg.splitlines() if line.strip().startswith("replay:"))
    assert captured_sig in captured_line
    assert replay_sig in replay_line


def test_mismatch_does_not_touch_the_buffers_and_a_good_replay_recovers():
    state = {"bad": False}

    @bcg.eager_on_graph
    def pair(x):
        return (x + 1, x.double()) if state["bad"] else (x + 1, x + 2)

    x = torch.zeros(3)
    g, out = capture_emulated(lambda x: sum(pair(x * 1)) * 1, x)
    a, b = boundary_of(g).buffers
    before = (a.clone(), b.clone())
    x.fill_(9.0)
    state["bad"] = True
    with pytest.raises(bcg.BoundaryMismatchError):
        g.replay()
    torch.testing.assert_close((a, b), before, equal_nan=True)  # checked before any copy (capture-time garbage)
    state["bad"] = False
    g.replay()
    torch.testing.assert_close(out, torch.full((3,), 21.0))


def test_matching_non_contiguous_result_is_copied_by_value():
    state = {"replay": False}

    @bcg.eager_on_graph
    def mat(x):
        m = x.view(2, 2) * 1
        return m.t() if state["replay"] else m  # same shape, other strides

    x = torch.arange(4.0)
    g, out = capture_emulated(lambda x: mat(x * 1) + 0, x)
    state["replay"] = True
    g.replay()
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0], [1.0, 3.0]]))
