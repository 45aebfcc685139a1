"""The tc_piecewise backend: torch.compile traces the layer stack once; the pieces between islands get graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bcg.errors import first_line
from bcg.runtime.backends.base import BackendRefused, GraphBackend
from bcg.runtime.backends.piecewise import PieceRuntime, PiecewiseCompiler
from bcg.runtime.compile import quiet_compile
from bcg.runtime.weak_backend import compile_owned

__all__ = ["PiecewiseHandle", "TcPiecewiseBackend"]


@dataclass(frozen=True)
class PiecewiseHandle:
    """What one bucket's capture produced: ``num_graphs`` piece graphs around ``num_islands`` eager islands."""

    bucket: int
    num_graphs: int
    num_islands: int


class TcPiecewiseBackend(GraphBackend):
    """The torch.compile route (SGLang's piecewise CUDA graphs, built from public torch APIs).

    ``prepare`` traces the step (embedding, layer stack, LM head) once with ``torch.compile(fullgraph=True)``, token
    dimension dynamic, through :class:`~bcg.runtime.backends.piecewise.PiecewiseCompiler`, which splits the graph at
    the attention op and compiles each piece (its time is the reported compile time). ``capture(bucket)`` then calls
    the compiled function in capture mode: each piece captures its own graph for the bucket in the shared pool while the
    islands run eagerly between them. ``replay`` calls the compiled function again, guards included, and the
    pieces replay their graphs. Models that torch.compile cannot take (DSA) are refused with the reason.

    Example::

        eng = Engine("tiny-dense", backend="tc_piecewise", tc_compiler="traced", device="cpu", buckets=[8, 16])
        eng.telemetry.compile_ms, eng.telemetry.buckets[16].num_breaks     # trace time, 2 islands
    """

    name = "tc_piecewise"

    def prepare(self) -> None:
        r = self.resources
        if r.is_emulated and r.config.tc_compiler == "inductor":
            raise BackendRefused(
                "tc_compiler='inductor' cannot run under the CPU graph emulation: Inductor's CPU kernels are C++ "
                "called directly, not aten ops the emulation records. Use tc_compiler='traced' on a CPU, or a GPU")
        import bcg.ops.custom_ops  # noqa: F401 - registers the islands' ops and tracing stand-ins

        self.runtime = PieceRuntime(pool=r.pool, is_emulated=r.is_emulated)
        self.compiler = PiecewiseCompiler(self.runtime, r.config.tc_compiler)
        self.compiled = compile_owned(r.step.function(), self, self.compiler, fullgraph=True)
        n = r.max_bucket
        # Trace and compile now, under the grad mode of capture and replay, so the guards match them.
        with torch.inference_mode(), r.inputs.dummy(n), quiet_compile():  # a refusal is one line, not dynamo's log
            try:
                self._run(n, mark_dynamic=True)
            except BackendRefused:
                raise
            except Exception as e:  # a trace failure means: serve eagerly, with dynamo's reason
                raise BackendRefused(f"torch.compile could not trace {type(r.step.model).__name__}'s step as one "
                                     f"graph: {first_line(e)}") from e
        if self.compiler.num_compiles == 0:
            raise BackendRefused("torch.compile ran the layer stack without calling the bcg compile backend "
                                 "(recompile limit reached?)")

    def _run(self, bucket: int, mark_dynamic: bool = False) -> None:
        args = self.resources.inputs.step_args(bucket)
        if mark_dynamic:
            for t in args:
                if t.shape[0] > 1:  # the head's rows may be a single one, which dynamo specialises
                    torch._dynamo.mark_dynamic(t, 0)
        self.compiled(*args)

    def warmup(self, bucket: int) -> None:
        self._run(bucket)

    def capture(self, bucket: int) -> PiecewiseHandle:
        rt = self.runtime
        rt.mode, rt.bucket, rt.captured = "capture", bucket, 0
        stream = self.resources.capture_stream
        try:
            if stream is None:
                self._run(bucket)
            else:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._run(bucket)
                torch.cuda.current_stream().wait_stream(stream)
        finally:
            rt.mode = "eager"
        if rt.captured == 0:
            raise RuntimeError(f"bucket {bucket}: the compiled layer stack ran no piece in capture mode")
        return PiecewiseHandle(bucket, rt.captured, self.compiler.num_islands)

    def replay(self, handle: Any, bucket: int) -> None:
        rt = self.runtime
        rt.mode, rt.bucket = "replay", bucket
        try:
            if torch.is_inference_mode_enabled():
                self._run(bucket)
            else:  # the guards were made under inference mode; anything else would recompile
                with torch.inference_mode():
                    self._run(bucket)
        finally:
            rt.mode = "eager"

    def describe(self, handle: Any) -> tuple[int, int]:
        return (handle.num_graphs, handle.num_islands)

