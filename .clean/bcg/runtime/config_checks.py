"""The checks behind :class:`~bcg.runtime.config.EngineConfig`'s fields: ints, bools and numbers within bounds (a
bool is never taken for an int), device and dtype names, bucket lists.

Each raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of range, naming the field and
the value; the ones that parse return the value as the config stores it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["bucket_list", "check_bool", "check_int", "check_number", "device_name", "dtype_name"]


def check_int(name: str, value: Any, minimum: int | None, optional: bool = False) -> None:
    """``value`` is an int (not a bool) at least ``minimum`` (None: any), or None when ``optional``."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: Any) -> None:
    """``value`` is True or False."""
    # Not truthiness: debug="no" or verify="false" would switch the option on.
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """``value`` is an int or float (not a bool, not NaN) in ``[low, high]``, or ``(low, high]`` when ``low_open``."""
    bounds = f"in ({low}, {high}]" if low_open else f">= {low}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number {bounds}, got {value!r} ({type(value).__name__})")
    if math.isnan(value) or value > high or value < low or (low_open and value == low):
        raise ValueError(f"{name} must be a number {bounds}, got {value!r}")


def device_name(device: Any) -> str | None:
    """``device`` (a name or a torch.device, CPU or CUDA) as the config stores it (``str(torch.device(device))``);
    None stays None."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(parsed)!r} is not supported: bcg runs on 'cpu' or 'cuda' (graphs and the KV "
                         "pool need real memory; graphs are emulated on the CPU)")
    return str(parsed)


def dtype_name(dtype: Any) -> str | None:
    """A floating ``dtype`` (a name, with or without ``torch.``, or a torch.dtype) as its name; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        raise TypeError(f"dtype must be a name such as 'bfloat16' or a torch.dtype, got {dtype!r}")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype such as 'bfloat16' (or torch.bfloat16), "
                         f"got {dtype!r}")
    return name


def bucket_list(buckets: Any) -> list[int] | None:
    """``buckets`` (a non-empty list or tuple of positive ints) as a list; None stays None."""
    if buckets is None:
        return None
    message = f"buckets must be a list of positive ints (token counts), got {buckets!r}"
    if not isinstance(buckets, (list, tuple)) or any(not isinstance(b, int) or isinstance(b, bool) for b in buckets):
        raise TypeError(message)
    if not buckets or min(buckets) < 1:
        raise ValueError(message + (" (empty; leave buckets=None for the default ladder)" if not buckets else ""))
    return list(buckets)
