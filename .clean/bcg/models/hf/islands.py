"""Automatic islands: the modules of a transformers model that a CUDA graph cannot capture, run eagerly at replay.

:func:`bcg.probe.find_uncapturable` names, per module class, the ops a capture would fail on (an MoE loop over
experts that calls ``nonzero`` and ``.item()``, say). :func:`install_auto_islands` then wraps ``forward`` of every
instance of each offending class with ``bcg.eager_on_graph``: at capture a call ends the segment and runs eagerly,
and what it returns becomes a boundary buffer that each replay refreshes. Wrapping the class, not only the
instances the probe saw offend, covers data-dependent paths a probe on one input may not take in every layer. The
decoder body itself is never wrapped (that would be no graph at all); an offence there refuses graph capture with
its location. Each message names the module, the op, the line and the fix. At capture an island runs on zeros
(:func:`_on_zeros`), never on the garbage a recorded segment leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bcg import eager_on_graph
from bcg.probe import Finding, ProbeReport

__all__ = ["body_refusal", "explain", "fix_hint", "install_auto_islands", "restore_islands"]


def fix_hint(finding: Finding, model: nn.Module) -> str:
    """How to make the offending module capturable, or what else to do."""
    if finding.module_class.endswith("Experts") and hasattr(model, "set_experts_implementation"):
        return ("switch the experts to a fixed-shape implementation, model.set_experts_implementation('grouped_mm') "
                "(capturable), or let bcg run the module as an island (auto_islands=True), or use "
                "model_impl='native' if bcg knows the architecture")
    return ("mark the module's forward @bcg.eager_on_graph, or let bcg run it as an island (auto_islands=True), or "
            "use model_impl='native' if bcg knows the architecture")


def explain(report: ProbeReport, model: nn.Module) -> str:
    """One line per offending class: where it runs, the first op and line, why, and the fix."""
    lines = []
    for cls, found in report.by_class().items():
        paths = sorted({f.module_path or "<body>" for f in found})
        first = found[0]
        ops = ", ".join(dict.fromkeys(f.op for f in found))
        shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} modules)" if len(paths) > 3 else "")
        lines.append(f"{cls} ({shown}) runs {ops}; first {first.op} at {first.source}: {first.reason}. "
                     f"Fix: {fix_hint(first, model)}")
    return "\n".join(lines)


def body_refusal(body: nn.Module, report: ProbeReport) -> str | None:
    """Why the body cannot be captured even with islands (an offence in the body's own code), or None."""
    own = [f for f in report.findings if f.module_path == ""]
    if not own:
        return None
    f = own[0]
    return (f"{f.module_class} (the decoder body itself) runs {f.op} at {f.source}: {f.reason}; bcg cannot make the "
            "whole body an island. Use backend='eager', or model_impl='native' if bcg knows the architecture")


def install_auto_islands(body: nn.Module, report: ProbeReport) -> list[str]:
    """Wraps ``forward`` of every instance of each offending class under ``body`` as an island (except the body
    itself); returns ``"path (Class): op at source"`` per wrapped module."""
    first = {cls: found[0] for cls, found in report.by_class().items()}
    first.pop(type(body).__name__, None)
    wrapped = []
    for path, module in body.named_modules():
        f = first.get(type(module).__name__)
        if f is None or module is body or getattr(module.forward, "__bcg_eager__", False):
            continue
        fn = module.forward

        def island(*args: object, __fn=fn, **kwargs: object) -> object:
            return __fn(*args, **kwargs)

        island.__qualname__ = f"auto_island[{path}]"
        module.forward = eager_on_graph(island, capture_stub=functools.partial(_on_zeros, fn))
        wrapped.append(f"{path} ({f.module_class}): {f.op} at {f.source}")
    return wrapped


def _on_zeros(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` on zero-filled copies of its tensor arguments: what an automatic island runs at capture. On CUDA the
    tensors a segment computes are only recorded then, so they hold whatever memory held; a module that indexes with
    them (an expert loop's ``one_hot`` over garbage expert ids) would trip a device-side assert, which ends the
    process's CUDA context. Only the result's shape matters at capture; zeros are in range for every index."""
    def zeros(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, (tuple, list)):
            return type(value)(zeros(v) for v in value)
        if isinstance(value, dict):
            return {k: zeros(v) for k, v in value.items()}
        return value
    return fn(*zeros(args), **zeros(kwargs))


def restore_islands(body: nn.Module) -> None:
    """Removes every island installed on ``body``'s modules (their class's forward runs again)."""
    for module in body.modules():
        if "forward" in vars(module) and getattr(module.forward, "__bcg_eager__", False):
            del module.forward
