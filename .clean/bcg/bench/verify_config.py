"""Configuration of ``bcg verify``: :class:`VerifyConfig`, its fields named like the CLI flags (the others are
:mod:`bcg.bench.config`'s and :mod:`bcg.bench.load_config`'s). A ``None`` field takes this machine's default in
``resolved()``, as every command's does (:mod:`bcg.bench.config_base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bcg.bench import checks
from bcg.bench.config_base import Run, resolve_machine, show_progress, tc_compiler_for
from bcg.bench.defaults import CPU_DEFAULTS

if TYPE_CHECKING:
    from bcg.runtime.config import EngineConfig

__all__ = ["FULL_TOKENS_PER_REQUEST", "VERIFY_REQUESTS", "VerifyConfig"]

# bcg verify checks each size with a batch of two requests (request boundaries matter: probe_batch); the full
# backend's graphs have one request slot per 512 tokens of the chunk (at least one), so a chunk under 1024 tokens
# (the CPU's 256) would skip every size.
VERIFY_REQUESTS, FULL_TOKENS_PER_REQUEST = 2, 512


@dataclass
class VerifyConfig(Run):
    """Options of ``bcg verify``; each field is the CLI flag of the same name. ``num_tokens`` and ``tolerance`` are
    the arguments of :func:`~bcg.runtime.runner.verify.verify_segments`, the others fields of the engine's
    :class:`~bcg.runtime.config.EngineConfig` (:meth:`engine_config`).

    Example::

        cfg = VerifyConfig(device="cpu", buckets=[8, 16]).resolved()
        Engine(cfg.model, cfg.engine_config())
    """

    model: str = "tiny-dense"
    model_impl: str = "auto"
    backend: str = "breakable"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    buckets: list[int] | None = None
    max_tokens: int | None = None
    chunked_prefill_size: int | None = None
    tc_compiler: str | None = None  # None: tc_compiler_for's default
    max_requests: int | None = None  # the full backend's request slots (None: the engine's, at least VERIFY_REQUESTS)
    num_tokens: list[int] | None = None
    tolerance: float | None = None
    leak_check: str = "warn"
    progress: bool | None = None

    def resolved(self) -> VerifyConfig:
        """A copy with every ``None`` default filled in for this machine, validated (the engine's fields too)."""
        device, d, model, impl = resolve_machine(self.device, self.dtype, self.model, self.model_impl)
        if self.tolerance is not None and not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"--tolerance must be a finite number >= 0 (a relative difference), got {self.tolerance}")
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else d.chunked_prefill_size
        checks.check_chunk(chunk)
        tc_compiler = tc_compiler_for(self.tc_compiler, d)
        if self.backend == "tc_piecewise" and tc_compiler == "inductor" and d is CPU_DEFAULTS:
            raise ValueError("--tc-compiler inductor cannot run under the CPU emulation (Inductor's CPU kernels are "
                             "C++ the emulation cannot record); leave it out (traced on the CPU) or verify on a GPU")
        if self.num_tokens is not None:
            checks.check_context("--num-tokens", self.num_tokens, model, impl)
            if max(self.num_tokens) > chunk:
                raise ValueError(f"--num-tokens: {max(self.num_tokens)} tokens is more than --chunked-prefill-size "
                                 f"{chunk} (a graph replays one forward, and a forward is at most a chunk); give "
                                 f"sizes up to {chunk} or a larger --chunked-prefill-size")
        max_requests = self.max_requests
        if max_requests is None and self.backend == "full" and chunk // FULL_TOKENS_PER_REQUEST < VERIFY_REQUESTS:
            max_requests = VERIFY_REQUESTS  # else the check batch never fits a graph of a small chunk
        cfg = replace(self, model=model, device=device, chunked_prefill_size=chunk, tc_compiler=tc_compiler,
                      max_requests=max_requests, progress=show_progress(self.progress))
        try:
            cfg.engine_config()
        except (TypeError, ValueError) as e:
            raise ValueError(f"{e} (the flag of the same name)") from None
        return cfg

    def engine_config(self) -> EngineConfig:
        """The EngineConfig of the engine to verify."""
        from bcg.runtime.config import EngineConfig

        return EngineConfig(backend=self.backend, device=self.device, dtype=self.dtype, seed=self.seed,
                            buckets=self.buckets, max_tokens=self.max_tokens,
                            chunked_prefill_size=self.chunked_prefill_size, tc_compiler=self.tc_compiler,
                            max_requests=self.max_requests, progress=self.progress, leak_check=self.leak_check,
                            model_impl=self.model_impl)
