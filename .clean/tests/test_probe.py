"""bcg.probe: what a capture would refuse, charged to the innermost module that ran it, without capturing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bcg
from bcg.probe import find_uncapturable


class Router(nn.Module):
    def forward(self, x):
        hit = (x.sum(-1) > 0).nonzero()  # data-dependent shape
        if x.sum() > 0:  # a host read
            x = x + 1
        return x, hit


class Host(nn.Module):
    def forward(self, x):
        x.tolist()  # never reaches the dispatcher on a CPU
        return x


@bcg.eager_on_graph
def island(x):
    return x[x > 0].sum() + x  # uncapturable, but an island runs at replay, never in a segment


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Router(), Router()])
        self.host = Host()

    def forward(self, x):
        x = self.proj(x)
        for b in self.blocks:
            x, _ = b(x)
        x = island(self.host(x))
        return x.repeat_interleave(2, dim=0)  # int repeats: capturable (expand + copy), also in inference mode


@pytest.mark.parametrize("inference", [False, True])
def test_findings_name_module_op_and_line(inference):
    net = Net()
    with torch.inference_mode(inference), find_uncapturable(net) as report:
        net(torch.ones(3, 4))
    got = [(f.module_path, f.module_class, f.op) for f in report.findings]
    read = "aten.is_nonzero.default" if inference else "aten._local_scalar_dense.default"  # bool(t)
    assert got == [("blocks.0", "Router", "aten.nonzero.default"), ("blocks.0", "Router", read),
                   ("blocks.1", "Router", "aten.nonzero.default"), ("blocks.1", "Router", read),
                   ("host", "Host", "Tensor.tolist")]
    assert report.findings[0].source.endswith("tests/test_probe.py:" + str(Router.forward.__code__.co_firstlineno + 1))
    assert "output shape depends on the data" in report.findings[0].reason
    assert report.findings[0].describe().startswith("Router (blocks.0) runs aten.nonzero.default at tests/test_probe")
    assert list(report.by_class()) == ["Router", "Host"]


def test_a_clean_forward_finds_nothing_and_leaves_nothing_behind():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with find_uncapturable(net) as report:
        net(torch.randn(2, 4))
    assert not report
    torch.ones(2).tolist()  # guards removed
    assert not bcg.is_capturing()


def test_the_probe_agrees_with_an_emulated_capture():
    """What the probe finds is what a capture refuses."""
    router = Router()
    x = torch.ones(2, 4)
    with find_uncapturable(router) as report:
        router(x)
    assert report
    g = bcg.BreakableCUDAGraph(emulate=True)
    with pytest.raises(bcg.UncapturableOpError, match="nonzero"), bcg.breakable_graph(g):
        router(x)
