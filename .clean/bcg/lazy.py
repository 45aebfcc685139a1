"""Lazy re-exports for a package's ``__init__``: a public name's module is imported on first use, so importing the
package (``bcg``, ``bcg.models``, ``bcg.runtime``) costs nothing until a name is read; ``bcg --help`` then never
imports torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, homes: dict[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``, whose names live in the modules ``homes``
    maps them to; a name read once is kept in ``namespace`` (the package's globals), so later lookups skip this.

    Example::

        __getattr__, __dir__ = lazy_exports(__name__, {"Engine": "bcg.runtime.engine"}, globals())
    """

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
