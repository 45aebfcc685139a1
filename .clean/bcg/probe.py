"""Finding what a CUDA graph could not capture in a module's forward, and where, without capturing it.

:func:`find_uncapturable` runs a forward eagerly under a dispatch mode that applies the emulation's capture rules
(:func:`bcg.capture_rules.uncapturable_reason`) to every aten op, and reports the host reads that never reach the
dispatcher on a CPU (``tolist``, ``cpu``, printing). Global module hooks keep the stack of modules running, so
each violation is charged to the innermost module of the probed tree, with the op, the reason and the line of
model code that called it; the forward then carries on, so one pass finds every offender. ``@eager_on_graph``
functions run with the probe paused: an island runs at replay, never inside a segment.

The probe applies exactly the rules of the CPU emulation, so what it finds is what an emulated capture would
refuse, and on a GPU what a CUDA capture would fail on.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.capture_rules import reporting_host_reads, uncapturable_reason
from bcg.islands import observing_islands

__all__ = ["Finding", "ProbeReport", "find_uncapturable"]

# Frames of the probe's own machinery, skipped when naming the model code that ran an op.
_OWN_FILES = tuple(str(Path(__file__).resolve().parent / f)
                   for f in ("probe.py", "capture_rules.py", "emulation.py", "graph.py", "islands.py", "capture.py"))
_lock = threading.Lock()  # the module hooks are process-wide: one probe at a time


@dataclass
class Finding:
    """One uncapturable op and where it ran.

    Attributes:
        module_path: dotted path of the innermost module of the probed tree that ran it ("" for the root).
        module_class: that module's class name.
        op: the aten op (``aten.nonzero.default``) or host-read method (``Tensor.tolist``).
        reason: why a CUDA graph cannot capture it.
        source: ``folder/file.py:line`` of the model code that called it.
        count: how many times it ran in that module during the probe.
    """

    module_path: str
    module_class: str
    op: str
    reason: str
    source: str
    count: int = 1

    def describe(self) -> str:
        """``Class (path) runs op at source: reason``."""
        where = f" ({self.module_path})" if self.module_path else ""
        return f"{self.module_class}{where} runs {self.op} at {self.source}: {self.reason}"


@dataclass
class ProbeReport:
    """What :func:`find_uncapturable` found, in the order first seen."""

    findings: list[Finding] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.findings)

    def by_class(self) -> dict[str, list[Finding]]:
        """Findings grouped by module class, in the order first seen."""
        out: dict[str, list[Finding]] = {}
        for f in self.findings:
            out.setdefault(f.module_class, []).append(f)
        return out


def _caller() -> str:
    """``folder/file.py:line`` of the innermost frame outside torch, the probe and the standard library's contextlib."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename
        if "/torch/" in name or name in _OWN_FILES or name.endswith("contextlib.py"):
            continue
        parts = Path(name).parts
        return f"{'/'.join(parts[-2:])}:{frame.lineno}"
    return "?"


class _ProbeMode(TorchDispatchMode):
    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.probe.paused:
            reason = uncapturable_reason(func, args, kwargs)
            if reason is not None:
                self.probe.record(str(func), reason)
        return func(*args, **kwargs)


class _Probe:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.names = {id(m): name for name, m in root.named_modules()}
        self.stack: list[nn.Module] = []
        self.report = ProbeReport()
        self.seen: dict[tuple[str, str], Finding] = {}
        self.paused = False

    def record(self, op: str, reason: str) -> None:
        inner = next((m for m in reversed(self.stack) if id(m) in self.names), self.root)
        key = (self.names[id(inner)], op)
        if key in self.seen:
            self.seen[key].count += 1
            return
        finding = Finding(self.names[id(inner)], type(inner).__name__, op, reason, _caller())
        self.seen[key] = finding
        self.report.findings.append(finding)

    def host_read(self, method: str) -> None:
        if not self.paused:
            self.record(f"Tensor.{method}", "a copy of device memory to the host (a sync)")

    def pre(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)

    def post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def island(self, fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        """Runs an island unwatched: its ops run eagerly at replay, never inside a segment."""
        was, self.paused = self.paused, True
        try:
            return fn(*args, **kwargs)
        finally:
            self.paused = was


@contextmanager
def find_uncapturable(root: nn.Module) -> Iterator[ProbeReport]:
    """Yields a :class:`ProbeReport` that the block fills: run a forward of ``root`` inside it.

    The forward runs eagerly and completely (violations are recorded, not raised). Run it as it will be captured:
    same device, under ``torch.inference_mode()`` and with the forward context installed. Data-dependent paths
    the probe's input does not take are not seen.

    Example:
        >>> import torch
        >>> class Picky(nn.Module):
        ...     def forward(self, x):
        ...         return x[x > 0].sum()
        >>> net = nn.Sequential(nn.Linear(4, 4), Picky())
        >>> with find_uncapturable(net) as report:
        ...     _ = net(torch.randn(2, 4))
        >>> [(f.module_path, f.module_class, f.op) for f in report.findings]
        [('1', 'Picky', 'aten.index.Tensor')]
    """
    probe = _Probe(root)
    with contextlib.ExitStack() as stack:
        if not _lock.acquire(blocking=False):
            raise RuntimeError("find_uncapturable() is already running in another thread; probe one at a time")
        stack.callback(_lock.release)
        for handle in (register_module_forward_pre_hook(probe.pre), register_module_forward_hook(probe.post)):
            stack.callback(handle.remove)
        stack.enter_context(observing_islands(probe.island))
        stack.enter_context(reporting_host_reads(probe.host_read))
        stack.enter_context(_ProbeMode(probe))
        yield probe.report
