"""Stand-ins for a model's islands in tests that must see a check catch a wrong island.

A stand-in takes whatever the real island takes (``*args, **kwargs``, bound to the real signature), so it keeps
working when the island gains arguments: the GPU tier once broke on a stand-in written for an older signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def wrong_output(real: Callable[..., Any], rows: int, factor: float) -> Callable[..., None]:
    """An island that runs ``real`` on the same arguments, then multiplies the first ``rows`` rows of its ``out``
    argument by ``factor``: a wrong output from the right inputs.

    Example::

        step.fn = wrong_output(step.fn, rows=2, factor=3.0)   # the segment check must blame this island
    """
    signature = inspect.signature(real)
    if "out" not in signature.parameters:
        raise TypeError(f"{real.__qualname__}{signature} has no 'out' argument to corrupt")

    def wrong(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        signature.bind(*args, **kwargs).arguments["out"][:rows].mul_(factor)

    return wrong
