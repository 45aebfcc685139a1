"""A ``torch.compile`` backend that does not keep its engine alive.

Dynamo keeps every backend it was given for the rest of the process (``torch._dynamo.eval_frame.cached_backends``,
cleared only by ``torch._dynamo.reset()``). A backend that is a bound method or a closure of what an engine built (the
piecewise compiler with its graphed pieces and their memory pool, the compiled layer stack with its model) would keep
the model's weights and the graphs' memory after the engine is gone: on the H200 one `bcg analyze --validate` of a 7 GB
model left no device memory for the engines after it. :class:`WeakBackend` is what dynamo keeps instead: it holds its
target weakly and forwards each compile to it.

The compiled code itself (a piecewise step's graphed pieces, with their graphs) hangs off the compiled function's code
object, where dynamo stores its cache entries out of the garbage collector's sight: :func:`compile_owned` compiles a
function whose code object is the engine's own and drops that code's entries when the object that owns it is
collected.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from inspect import ismethod
from typing import Any

import torch

__all__ = ["WeakBackend", "compile_owned"]


class WeakBackend:
    """``target`` (a compile backend: a bound method or a callable object) as a ``torch.compile`` backend that holds
    it weakly; compiling after the target is gone raises a RuntimeError that says so.

    Example::

        compiler = PiecewiseCompiler(runtime, "inductor")
        step = torch.compile(step, fullgraph=True, backend=WeakBackend(compiler))   # dynamo keeps only this
    """

    def __init__(self, target: Callable[..., Any]) -> None:
        self._ref: Callable[[], Any] = weakref.WeakMethod(target) if ismethod(target) else weakref.ref(target)
        self.__name__ = getattr(target, "__name__", type(target).__name__)  # what dynamo's logs name it by

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Any:
        target = self._ref()
        if target is None:
            raise RuntimeError("torch.compile called a backend whose engine is gone: the compiled function outlived "
                               "the engine that made it; build the engine again")
        return target(gm, example_inputs)


def compile_owned(fn: types.FunctionType, owner: object, backend: Callable[..., Any],
                  **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(fn, backend=WeakBackend(backend), **kwargs)``, whose compiled code dynamo forgets once ``owner``
    is collected. ``fn`` must have a code object of its own (one per engine: see
    :meth:`bcg.runtime.runner.step.ModelStep.function`), as forgetting drops every entry of that code.

    Example::

        self.compiled = compile_owned(step.function(), self, compiler, fullgraph=True)
    """
    compiled = torch.compile(fn, backend=WeakBackend(backend), **kwargs)
    forget = weakref.finalize(owner, _forget, fn.__code__)
    forget.atexit = False  # at the process's exit dynamo's caches go with it (and may be half torn down)
    return compiled


def _forget(code: types.CodeType) -> None:
    """Drops dynamo's cache entries of ``code`` (this torch's ``remove_from_cache``; nothing where it has none)."""
    forget = getattr(getattr(torch._dynamo, "eval_frame", None), "remove_from_cache", None)
    if forget is not None:
        forget(code)
