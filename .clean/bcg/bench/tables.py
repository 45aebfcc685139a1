"""Plain-text tables and the cell formats of every report (:mod:`bcg.bench.text`, and the benchmark scripts).

Tables have aligned columns so they read the same in a terminal, a CI log or a pasted issue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["describe_reason", "fmt", "fmt_bytes", "table"]

# The runner's per-batch reason codes, as a reader of the table would say them.
_REASONS = {
    "backend_eager": "eager backend",
    "backend_refused": "backend refused the model",
    "bucket_disabled": "its bucket is disabled",
    "exceeds_max_bucket": "more tokens than the largest bucket",
    "padding_over_limit": "padding over max_padding_factor",
    "too_many_requests": "more requests than the graph's request slots",
    "too_many_keys": "more cached keys than prefix_capacity",
    "replay_failed": "replay failed",
}


def describe_reason(graph_used: bool, reason: str, bucket: int | None = None) -> str:
    """The graph column of a latency row: which bucket replayed, or in words why the batch ran eagerly.

    Example::

        >>> describe_reason(True, "graph", 16), describe_reason(False, "too_many_requests")
        ('yes (bucket 16)', "no: more requests than the graph's request slots")
        >>> describe_reason(False, "backend_eager")
        '- (eager backend)'
    """
    if graph_used:
        return f"yes (bucket {bucket})" if bucket is not None else "yes"
    if reason == "backend_eager":
        return "- (eager backend)"
    return f"no: {_REASONS.get(reason, reason.replace('_', ' '))}"


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    """Formats one cell: ``-`` for missing values, fixed decimals for floats.

    Example::

        >>> fmt(1.2345), fmt(None), fmt(0.5, 1, "x"), fmt(True)
        ('1.23', '-', '0.5x', 'yes')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def fmt_bytes(n: int | float | None) -> str:
    """Human-readable bytes in binary units.

    Example::

        >>> fmt_bytes(3 * 2**20), fmt_bytes(None), fmt_bytes(-2**30)
        ('3.0 MiB', '-', '-1.00 GiB')
    """
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    if n >= 2**30:
        return f"{sign}{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{sign}{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{sign}{n / 2**10:.1f} KiB"
    return f"{sign}{int(n)} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """An aligned plain-text table; numbers are right-aligned, text left-aligned.

    Example::

        >>> print(table(["backend", "ms"], [["eager", "1.50"], ["breakable", "0.75"]]))
        backend      ms
        ---------  ----
        eager      1.50
        breakable  0.75
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def numeric(col: int) -> bool:
        vals = [r[col] for r in cells if r[col] != "-"]
        return bool(vals) and all(_looks_numeric(v) for v in vals)

    right = [numeric(i) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out += [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    stripped = text.rstrip("x%").replace(" MiB", "").replace(" GiB", "").replace(" KiB", "").replace(" B", "")
    try:
        float(stripped)
    except ValueError:
        return stripped == "inf"
    return True
