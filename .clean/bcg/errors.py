"""How bcg quotes an exception in a log line, a telemetry record or another error: its type and the first line of
its message that says what happened."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(e: BaseException) -> str:
    """``"Type: first line of the message that says something"``, or just the type name when the message is empty.

    A line ending in ``:`` only announces the next one (dynamo's ``backend='<repr of the compiler>' raised:`` before
    the error the backend raised), so the first line that does not end in ``:`` is quoted; a message of nothing but
    such lines is quoted by its first.

    Example:
        >>> first_line(ValueError("bad value\\nmore detail"))
        'ValueError: bad value'
        >>> first_line(RuntimeError("backend='Compiler(<object at 0x7f>)' raised:\\nRuntimeError: guard failed"))
        'RuntimeError: RuntimeError: guard failed'
        >>> first_line(RuntimeError())
        'RuntimeError'
        >>> first_line(KeyError(""))
        "KeyError: ''"
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    telling = next((line for line in lines if not line.endswith(":")), lines[0])
    return f"{type(e).__name__}: {telling}"
