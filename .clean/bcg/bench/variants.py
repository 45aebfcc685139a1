"""What ``bcg bench`` compares: a backend with its kernels and its compiler, named like ``breakable+fused``.

A variant name is a backend followed by ``+`` options: ``fused`` (the fused kernels; without it, plain torch ops),
``inductor`` (the layer stack compiled by Inductor: ``compile="inductor"``) or ``traced`` (traced by dynamo alone, no
code generated: ``compile="traced"``); ``breakable`` also takes ``full`` (its small buckets also hold a whole-step
graph with the attention inside, up to the engine's own ``full_graph_tokens`` for the model; on a CPU, which makes
none by default, up to 512 tokens). A name says everything its engine runs, whatever the machine: ``breakable``
attends in islands at every bucket, although ``Engine(backend="breakable")`` on one GPU adds the whole-step graphs by
default (``breakable+full``). ``tc_piecewise`` compiles its pieces itself and takes no compile option; its compiler
is the run's ``tc_compiler`` (``bcg bench --tc-compiler``). The plain ``eager`` variant is the baseline of
every speedup: the model as a user runs it without bcg.
"""

from __future__ import annotations

from dataclasses import dataclass

from bcg.runtime.backend_registry import resolve_backend

__all__ = ["Variant", "parse_variant"]

_KERNELS = {"fused": "fused", "torch": "torch"}
_COMPILERS = {"inductor": "inductor", "traced": "traced"}


@dataclass(frozen=True)
class Variant:
    """One engine configuration to measure.

    Example::

        >>> v = parse_variant("breakable+fused")
        >>> (v.backend, v.kernels, v.compile, v.name)
        ('breakable', 'fused', None, 'breakable+fused')
    """

    backend: str
    kernels: str = "torch"
    compile: str | None = None
    tc_compiler: str = "inductor"  # what compiles tc_piecewise's pieces (no other backend reads it)
    full_graph_tokens: int | None = 0  # 0: no whole-step graphs; None ("+full"): the engine's own default

    @property
    def name(self) -> str:
        parts = [self.backend] + (["fused"] if self.kernels == "fused" else [])
        parts += [self._compile_token] if self.compile else []
        return "+".join(parts + (["full"] if self.full_graph_tokens != 0 else []))

    @property
    def backend_label(self) -> str:
        """The backend column of tables: the backend, with ``+full`` where its small buckets hold two graphs."""
        return self.backend + ("+full" if self.full_graph_tokens != 0 else "")

    @property
    def _compile_token(self) -> str:
        return next(k for k, v in _COMPILERS.items() if v == self.compile)

    @property
    def compile_label(self) -> str:
        """What compiles it, for tables: tc_piecewise's Inductor, the compile option, or nothing."""
        if self.backend == "tc_piecewise":
            return f"{self.tc_compiler} (pieces)"
        return self._compile_token if self.compile else "-"


def parse_variant(text: str, tc_compiler: str = "inductor") -> Variant:
    """A :class:`Variant` from ``backend[+fused][+inductor|+traced][+full]``; raises ValueError naming what is wrong.

    Example::

        >>> parse_variant("breakable+inductor").compile
        'inductor'
    """
    backend, *options = [t.strip() for t in text.split("+")]
    backend = resolve_backend(backend)
    kernels, compile_ = "torch", None
    full: int | None = 0
    for option in options:
        if option == "full":
            if backend != "breakable":
                raise ValueError(f"{text!r}: +full adds whole-step graphs to breakable's small buckets; "
                                 f"{backend} takes no +full")
            full = None
        elif option in _KERNELS:
            kernels = _KERNELS[option]
        elif option in _COMPILERS:
            if backend == "tc_piecewise":
                raise ValueError(f"{text!r}: tc_piecewise compiles its pieces itself and takes no +{option}")
            compile_ = _COMPILERS[option]
        else:
            raise ValueError(f"{text!r}: unknown option +{option}; use +fused, +inductor, +traced or +full")
    return Variant(backend, kernels, compile_, tc_compiler, full)
