"""Host times measured at a few sizes and interpolated between them.

An eager forward's host work is its launches and Python, which do not grow with the batch: on the H200 llama-dense's
plain-torch forward took 9.5-12.5 ms of host time at every size from 64 to 2048 tokens, the attention island 24-27 µs
a call, the batch's load 52-82 µs, with as much spread between two runs of one size as between sizes. Timing every
size is most of what `bcg analyze` spends before it profiles, so :func:`timed_sizes` picks the smallest, the largest
and, where they are more than :data:`SPAN` apart, the one nearest their geometric mean; :func:`interpolate` gives the
others their neighbours' times, linear in log2 of the token count (the bytes an island's arguments hold, which do
grow with the batch, linear in tokens). Device time is never interpolated: every size is still profiled.
"""

from __future__ import annotations

import math
from dataclasses import replace

from bcg.bench.predict import HostTimes

__all__ = ["SPAN", "interpolate", "timed_sizes"]

SPAN = 4  # sizes further apart than this get a timed size between them
# The times interpolated between neighbours (island times per island, argument bytes by tokens)
_SCALARS = ("forward_ms", "host_ms", "prefill_ms", "load_us", "full_load_us", "prefill_pre_us", "prefill_post_us")


def timed_sizes(sizes: list[int]) -> list[int]:
    """The sizes whose host times are measured (see the module doc).

    Example::

        >>> timed_sizes([64, 128, 256, 512, 1024, 2048])
        [64, 512, 2048]
        >>> timed_sizes([16, 32, 64])
        [16, 64]
    """
    xs = sorted(set(sizes))
    if len(xs) <= 2:
        return xs
    if xs[-1] <= SPAN * xs[0]:
        return [xs[0], xs[-1]]
    mid = math.sqrt(xs[0] * xs[-1])
    inner = min(xs[1:-1], key=lambda n: (abs(math.log2(n / mid)), -n))
    return [xs[0], inner, xs[-1]]


def _mix(a: float | None, b: float | None, t: float) -> float | None:
    return None if a is None or b is None else a + (b - a) * t


def _between(lo: HostTimes, hi: HostTimes, n: int) -> HostTimes:
    """``n``'s host times from its measured neighbours ``lo`` and ``hi`` (``runs`` 0: none of its own)."""
    t = math.log2(n / lo.num_tokens) / math.log2(hi.num_tokens / lo.num_tokens)
    scalars = {name: _mix(getattr(lo, name), getattr(hi, name), t) for name in _SCALARS}
    islands = {name: lo.island_us[name] + (hi.island_us.get(name, lo.island_us[name]) - lo.island_us[name]) * t
               for name in lo.island_us}
    return replace(lo, num_tokens=n, **scalars, island_us=islands,
                   island_bytes={name: b * n / lo.num_tokens for name, b in lo.island_bytes.items()},
                   runs=0, warmups=0, low=None, high=None)


def _at(measured: dict[int, HostTimes], n: int) -> HostTimes:
    if n in measured:
        return measured[n]
    below = [m for m in measured if m < n]
    above = [m for m in measured if m > n]
    if not below or not above:  # outside the timed range: the nearest size's times
        return replace(measured[min(measured, key=lambda m: abs(math.log2(m / n)))], num_tokens=n, runs=0,
                       warmups=0)
    lo, hi = measured[max(below)], measured[min(above)]
    out = _between(lo, hi, n)
    if lo.low is not None and hi.low is not None:
        out.low = _between(lo.low, hi.low, n)
    if lo.high is not None and hi.high is not None:
        out.high = _between(lo.high, hi.high, n)
    return out


def interpolate(measured: dict[int, HostTimes], sizes: list[int]) -> dict[int, HostTimes]:
    """Every size of ``sizes`` with host times: the measured ones as they are, the others from their neighbours.

    Example::

        hosts = interpolate({64: h64, 2048: h2048}, [64, 256, 2048])
        hosts[256].runs == 0      # interpolated, not timed
    """
    return {n: _at(measured, n) for n in sorted(sizes)}
