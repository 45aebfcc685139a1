"""Boundary buffers: what eager functions return, refreshed in place at replay, the zero-copy style, and Boundary on
its own.

The mismatch errors of a replay have their own file (test_boundary_mismatch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_helpers import Pair, boundary_of, capture_emulated
from torch.utils._python_dispatch import TorchDispatchMode

import bcg
from bcg.boundary import Boundary, describe, flatten, same_spec


class _CountCopies(TorchDispatchMode):
    """Counts aten.copy_ calls (the boundary refresh path) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.copy_:
            self.copies += 1
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------------------------
# returned tensors and structures


@bcg.eager_on_graph
def fresh(x):
    return x * 10


def test_returned_tensor_is_a_persistent_buffer_refreshed_in_place():
    x = torch.zeros(4)
    holder = {}

    def step(x):
        r = fresh(x + 1)
        holder["r"] = r
        return r * 2

    g, out = capture_emulated(step, x)
    buf = holder["r"]
    assert boundary_of(g).buffers[0] is buf
    ptr = buf.data_ptr()
    for v in (1.0, 2.0, -3.0):
        x.fill_(v)
        g.replay()
        assert buf.data_ptr() == ptr
        torch.testing.assert_close(buf, torch.full((4,), (v + 1) * 10))
        torch.testing.assert_close(out, torch.full((4,), (v + 1) * 20))


def _structures(x):
    return {
        "tuple": (x + 1, x * 2),
        "list": [x + 1, x * 2],
        "dict": {"a": x + 1, "b": x * 2},
        "dataclass": Pair(x + 1, x * 2),
        "nested": {"a": (x + 1, [x * 0 + 7, {"k": x * 2}]), "b": Pair(x, x)},
    }


def _sum_leaves(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return sum(_sum_leaves(v) for v in value)
    if isinstance(value, dict):
        return sum(_sum_leaves(v) for v in value.values())
    if dataclasses.is_dataclass(value):
        return _sum_leaves(value.a) + _sum_leaves(value.b)
    return 0


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass", "nested"])
def test_structured_results_are_refreshed(kind):
    @bcg.eager_on_graph
    def produce(x):
        return _structures(x)[kind]

    def step(x):
        return _sum_leaves(produce(x * 1)) * 3

    x = torch.zeros(3)
    g, out = capture_emulated(step, x)
    assert type(boundary_of(g).value) is type(_structures(x)[kind])
    for v in (1.0, 5.0):
        x.fill_(v)
        g.replay()
        torch.testing.assert_close(out, _sum_leaves(_structures(x)[kind]) * 3)


def test_non_tensor_leaves_are_baked_and_may_repeat():
    @bcg.eager_on_graph
    def produce(x):
        return x + 1, 3, "mode", None, torch.float32

    x = torch.zeros(2)
    g, out = capture_emulated(lambda x: produce(x * 1)[0] * 2, x)
    assert len(boundary_of(g).buffers) == 1
    x.fill_(4.0)
    g.replay()
    torch.testing.assert_close(out, torch.full((2,), 10.0))


# ----------------------------------------------------------------------------------------------------------------
# zero-copy style


def test_writing_into_arguments_and_returning_none_costs_no_copy():
    @bcg.eager_on_graph
    def into(x, out):
        torch.add(x, 1, out=out)

    x, out = torch.zeros(4), torch.zeros(4)

    def step(x):
        x.mul_(2)
        into(x, out)
        out.mul_(3)

    g, _ = capture_emulated(step, x)
    assert boundary_of(g).buffers == [] and boundary_of(g).value is None
    ptr = out.data_ptr()
    x.fill_(1.0)
    with _CountCopies() as spy:
        g.replay()
    assert spy.copies == 0
    assert out.data_ptr() == ptr
    torch.testing.assert_close(out, torch.full((4,), 9.0))


def test_returning_an_argument_costs_no_copy():
    @bcg.eager_on_graph
    def bump(x):
        return x.add_(1)

    x = torch.zeros(4)

    def step(x):
        x.mul_(2)
        return bump(x)

    g, out = capture_emulated(step, x)
    assert out is x
    x.fill_(1.0)
    with _CountCopies() as spy:
        g.replay()
    assert spy.copies == 0
    torch.testing.assert_close(x, torch.full((4,), 3.0))


def test_returning_a_fresh_tensor_is_one_copy():
    # The contrast to the zero-copy tests: shows the spy does see the boundary refresh.
    x = torch.zeros(4)

    def step(x):
        x.mul_(2)
        fresh(x)

    g, _ = capture_emulated(step, x)
    with _CountCopies() as spy:
        g.replay()
    assert spy.copies == 1


# ----------------------------------------------------------------------------------------------------------------
# Boundary on its own


def test_flatten_collects_device_leaves_and_bakes_the_rest():
    t, u = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    leaves: list[torch.Tensor] = []
    spec = flatten({"a": (t, 1), "b": [u, "s"]}, "cpu", leaves)
    assert len(leaves) == 2 and leaves[0] is t and leaves[1] is u
    assert describe(spec) == (
        "dict(a=tuple(Tensor(shape=[2], dtype=torch.float32, device=cpu), int(1)), "
        "b=list(Tensor(shape=[3], dtype=torch.int64, device=cpu), str('s')))"
    )
    # on a "cuda" graph, CPU tensors are baked by value, not kept as buffers
    leaves = []
    spec = flatten((t, u), "cuda", leaves)
    assert leaves == []
    assert same_spec(spec, flatten((t.clone(), u.clone()), "cuda", []))
    assert not same_spec(spec, flatten((t + 1, u), "cuda", []))


def test_baked_host_tensor_mismatch_names_its_signature_not_all_its_data():
    host = torch.zeros(100_000)
    b = Boundary("seq_lens", host, device_type="cuda")  # a host tensor next to a CUDA graph is baked
    assert b.buffers == []
    b.refresh(host.clone())  # same value: fine
    with pytest.raises(bcg.BoundaryMismatchError) as info:
        b.refresh(host + 1)
    msg = str(info.value)
    assert "seq_lens" in msg and "baked Tensor(shape=[100000]" in msg
    assert len(msg) < 2000
    small = Boundary("lens", torch.tensor([1, 2]), device_type="cuda")
    with pytest.raises(bcg.BoundaryMismatchError, match=r"= \[1, 2\](.|\n)*= \[1, 3\]"):
        small.refresh(torch.tensor([1, 3]))


@bcg.eager_on_graph
def with_nan_stat(x):
    return x * 2, float("nan"), torch.tensor([float("nan"), 1.0])  # e.g. an unused statistic


def test_a_nan_leaf_matches_itself_at_replay():
    x = torch.ones(4)
    g, (out, stat, host) = capture_emulated(with_nan_stat, x)
    for v in (3.0, -1.0):
        x.fill_(v)
        g.replay()  # NaN != NaN in Python; the baked NaN must still match the replay's NaN
        assert torch.equal(out, torch.full((4,), 2 * v))
    assert same_spec(flatten(float("nan"), "cpu", []), flatten(float("nan"), "cpu", []))
    assert not same_spec(flatten(float("nan"), "cpu", []), flatten(1.0, "cpu", []))
