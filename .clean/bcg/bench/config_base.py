"""What the configuration of every command (``bench``, ``analyze``, ``verify``, ``load``) shares: the device
(:class:`Run`), this machine's defaults resolved and checked, ``--tc-compiler``, whether progress bars show, and the
:class:`~bcg.bench.engines.EngineSpec` a resolved config builds its engines from.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from bcg.bench import checks
from bcg.bench.defaults import CPU_DEFAULTS, CUDA_DEFAULTS, TC_COMPILERS, MachineDefaults

if TYPE_CHECKING:
    from bcg.bench.engines import EngineSpec

__all__ = ["Run", "default_device", "resolve_machine", "show_progress", "spec", "tc_compiler_for"]


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class Run:
    """What every command's config has: a device, and whether that means the CPU emulation."""

    device: str | None

    @property
    def emulated(self) -> bool:
        """True when running without CUDA (the graph backends run under the CPU emulation)."""
        return torch.device(self.device or default_device()).type != "cuda"


def tc_compiler_for(tc_compiler: str | None, d: MachineDefaults) -> str:
    """``--tc-compiler`` of every command: the value given, else this machine's (``inductor`` on CUDA, ``traced`` on
    the CPU); raises ValueError for anything else.

    Example:
        >>> tc_compiler_for(None, CPU_DEFAULTS), tc_compiler_for(None, CUDA_DEFAULTS)
        ('traced', 'inductor')
        >>> tc_compiler_for("traced", CUDA_DEFAULTS)
        'traced'
    """
    value = d.tc_compiler if tc_compiler is None else tc_compiler
    if value not in TC_COMPILERS:
        raise ValueError(f"--tc-compiler must be {' or '.join(TC_COMPILERS)}, got {value!r}")
    return value


def show_progress(progress: bool | None) -> bool:
    # Bars redraw with carriage returns and escape codes: in a log file or a pipe they are noise.
    return sys.stderr.isatty() if progress is None else progress


def resolve_machine(device: str | None, dtype: str | None, model: str | None,
                     model_impl: str = "auto") -> tuple[str, MachineDefaults, str, str]:
    """(device, this machine's defaults, model, the implementation that runs it) with the defaults filled in and each
    checked."""
    device = device or default_device()
    checks.check_device(device)
    checks.check_dtype(dtype)
    d = CUDA_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
    model = model or d.model
    return device, d, model, checks.check_model(model, model_impl)


def spec(model: str | None, **config: object) -> EngineSpec:
    from bcg.bench.engines import EngineSpec
    from bcg.runtime.config import EngineConfig

    assert model is not None, "engine_spec() needs a resolved config"
    return EngineSpec(model, EngineConfig(**config))
