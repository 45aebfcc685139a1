"""How bcg quotes an exception in a log line, a telemetry record or another error: its type and first line."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(e: BaseException) -> str:
    """``"Type: first non-empty line of the message"``, or just the type name when the message is empty.

    Example:
        >>> first_line(ValueError("bad value\\nmore detail"))
        'ValueError: bad value'
        >>> first_line(RuntimeError())
        'RuntimeError'
        >>> first_line(KeyError(""))
        "KeyError: ''"
    """
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__
