"""What torch.compile costs on this machine, beside the launches of :mod:`bcg.bench.machine`: dynamo's guards per
call (by parameter count) and a compile per layer-like block, per compiler.

Each probe is a function of its own code object, so dynamo traces and guards every copy apart from the others; the
``traced`` compiler runs dynamo's trace as it is (:func:`no_codegen`), ``inductor`` generates kernels.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch

from bcg.bench.machine_probes import host_us
from bcg.bench.timing import sync

__all__ = ["COMPILE_BLOCK_KERNELS", "compile_block", "compile_costs", "guard_costs", "no_codegen"]

# The kernels one eager call of compile_block launches (an RMSNorm, two matmuls, SiLU-and-multiply, a residual add).
COMPILE_BLOCK_KERNELS = 11


def guard_costs(device: torch.device) -> tuple[float, float]:
    """(fixed µs, µs per parameter) dynamo adds to a call: a function reading 4 and 64 parameter tensors, traced
    without generating code, against the same function uncompiled."""
    costs = []
    for num in (4, 64):
        params = [torch.zeros(1, device=device) for _ in range(num)]

        def body(x: torch.Tensor, params: list[torch.Tensor] = params) -> torch.Tensor:
            for p in params:
                x = x + p
            return x

        # A code object of its own, so each traced copy keeps its guards apart from the others.
        fn = types.FunctionType(body.__code__.replace(), body.__globals__, "guard_probe", body.__defaults__)
        compiled = torch.compile(fn, fullgraph=True, backend=no_codegen)
        x = torch.zeros(1, device=device)
        with torch.inference_mode():
            compiled(x)
            plain = host_us(lambda f=fn, x=x: f(x), device)
            costs.append(max(host_us(lambda f=compiled, x=x: f(x), device) - plain, 0.0))
    per_param = max((costs[1] - costs[0]) / 60, 0.0)
    return max(costs[0] - 4 * per_param, 0.0), per_param


def compile_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """A layer-like block for the compile benchmark: RMSNorm, matmul, SiLU-and-multiply, matmul, residual add
    (:data:`COMPILE_BLOCK_KERNELS` kernels run eagerly)."""
    h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm
    h = h @ w1
    h = torch.nn.functional.silu(h) * h
    return x + h @ w2


def no_codegen(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """A compile backend that runs dynamo's trace as it is ("traced")."""
    return gm.forward


def compile_costs(compiler: str, device: torch.device) -> tuple[float, float]:
    """(fixed ms of a compile, ms per kernel) of ``compiler`` on a stack of 1 and of 4 blocks (after one
    untimed compile of another size: the compiler's first use in a process imports and warms it)."""
    def stack(blocks: int, hidden: int) -> float:
        ws = [(torch.randn(hidden, hidden, device=device) * 0.01, torch.randn(hidden, hidden, device=device) * 0.01,
               torch.ones(hidden, device=device)) for _ in range(blocks)]

        def body(x: torch.Tensor, ws: list = ws) -> torch.Tensor:
            for w1, w2, norm in ws:
                x = compile_block(x, w1, w2, norm)
            return x

        fn = types.FunctionType(body.__code__.replace(), body.__globals__, f"compile_probe_{blocks}", body.__defaults__)
        backend = "inductor" if compiler == "inductor" else no_codegen
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        x = torch.randn(8, hidden, device=device)
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(x)
        sync(device)
        return (time.perf_counter() - t0) * 1e3

    stack(1, 32)
    one, four = stack(1, 64), stack(4, 64)
    per_block = max((four - one) / 3, 0.0)
    return max(one - per_block, 0.0), per_block / COMPILE_BLOCK_KERNELS
