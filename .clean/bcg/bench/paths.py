"""The host cost of each backend's real replay path on this machine, measured on toy engines rather than assumed.

:mod:`bcg.bench.machine` times the primitives (an add in a graph, a break between adds, a piece around an add); a
real replay also runs the runner's own steps around them: the batch staged into the static fields, each island as an
``EagerStep`` reading the batch's metadata from the forward context, each tc_piecewise piece called from dynamo's
split graph and each island through its custom op. :func:`measure_paths` builds the tiny-dense preset with
:data:`LAYERS` layer counts as an eager engine and one of each backend asked (breakable, full, tc_piecewise), times
``runner.forward`` of one bucket on each from an idle device (a backend's two toys alive together and timed in turn,
so that a drift of a shared host's speed does not land in the slope between them), and reads off per backend:

* ``per_layer_us``: what one more layer adds to the replay's host time beyond the island's own host time measured
  on the eager engine (a segment launch or piece call, the break or the island's custom-op call, the step wrapper),
  the island measured as the model's islands are (back to back where it can be called again);
* ``fixed_us``: what one replay forward costs beyond its layers and its batch's load into the static fields (timed
  apart on the same engine): the launch of the segment, piece or graph that no layer owns, the bucket's choice, the
  logits, the record; tc_piecewise's guards of the parameters outside the layers and its split graph's entry. The
  programs subtract from it what they count themselves (that launch, those guards).

These depend on the machine and on bcg, not on the model: a process measures them once
(:func:`measure_paths` caches), and :mod:`bcg.bench.machine_cache` keeps them on disk for the next run. The
programs of :mod:`bcg.bench.predict` use them in place of the primitives' costs where they exist. Under the CPU
emulation they run the same code and mean nothing for a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg.bench.timing import sync

__all__ = ["LAYERS", "PathCosts", "measure_paths"]

LAYERS = (1, 5)  # tiny-dense layer counts: the slope between them is one layer's cost
BUCKET = 16
REPS = 15
_CACHE: dict[tuple, PathCosts] = {}


@dataclass
class PathCosts:
    """Per backend ("breakable", "tc_piecewise"): host µs one layer of its replay adds beyond its island's own host
    time (``per_layer_us``), and µs its replay adds per forward beyond the eager path (``fixed_us``); the eager
    engine's island host µs per layer it was measured against, and how long the measuring took."""

    per_layer_us: dict[str, float] = field(default_factory=dict)
    # one layer's whole host µs on the replay path, island included: per_layer_us is this less the island's time on
    # the eager engine, clamped at 0 where timing the island there (its observer included) costs more than the rest
    layer_total_us: dict[str, float] = field(default_factory=dict)
    fixed_us: dict[str, float] = field(default_factory=dict)
    island_us: float = 0.0
    params_per_layer: float = 0.0  # parameter tensors a toy layer adds (dynamo guards each one)
    params_fixed: float = 0.0  # the toy's parameter tensors outside its layers (embedding, final norm, head)
    seconds: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)


def _paired_host_us(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[float, float]:
    """Median host µs of ``runner.forward`` of each (engine, batch) pair from an idle device, not waiting for its
    work, the two timed in turn: a drift of the host's speed while timing (a shared machine's) moves both alike
    rather than the slope between them (timed one after the other, the slope of two H200 runs came out negative)."""
    samples: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        for i in range(REPS + 3):
            for (eng, batch), out in zip((a, b), samples):
                sync(eng.device)
                t0 = time.perf_counter()
                eng.runner.forward(batch)
                if i >= 3:
                    out.append((time.perf_counter() - t0) * 1e6)
        sync(a[0].device)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _host_samples(fn: Any, device: Any) -> list[float]:
    """Host µs of ``REPS`` calls of ``fn``, each from an idle device, after three untimed ones."""
    samples = []
    for i in range(REPS + 3):
        sync(device)
        t0 = time.perf_counter()
        fn()
        if i >= 3:
            samples.append((time.perf_counter() - t0) * 1e6)
    sync(device)
    return samples


def _island_us(eng: Any, batch: Any) -> float:
    """Median host µs of all island calls of one eager forward, each island as analyze measures it for a replay: a
    repeatable island at its back-to-back cost (:data:`bcg.bench.profile.REPEATABLE`), another as its call took.
    The same measure as the model's islands, so what is subtracted here is what the prediction adds back."""
    from bcg.bench.profile import STEADY_REPEATS, IslandTimer
    from bcg.islands import observing_islands

    totals = []
    with torch.inference_mode():
        for i in range(REPS + 3):
            timer = IslandTimer(repeats=STEADY_REPEATS)
            with observing_islands(timer):
                eng.runner.forward(batch)
            if i >= 3:
                totals.append(sum(timer.steady_us[n][0] * timer.calls[n] if n in timer.steady_us else us
                                  for n, us in timer.us.items()))
        sync(eng.device)
    return statistics.median(totals)


def _load_us(eng: Any, batch: Any) -> float:
    """Median host µs of loading ``batch`` into the replay's static fields (what the programs count as the load)."""
    with torch.inference_mode():
        return statistics.median(_host_samples(lambda: eng.runner.inputs.load(batch, BUCKET), eng.device))


@contextmanager
def _toy(device: str, backend: str, layers: int) -> Iterator[tuple[Any, Any, int]]:
    """(engine, a batch of one bucket, parameter tensors) of tiny-dense with ``layers`` layers on ``backend``, freed
    on exit."""
    from bcg.bench.engines import make_prompts, one_batch, release_memory
    from bcg.models.config import PRESETS
    from bcg.runtime import Engine

    model = dataclasses.replace(PRESETS["tiny-dense"], num_layers=layers)
    eng = Engine(model, backend=backend, device=device, tc_compiler="traced", buckets=[BUCKET],
                 chunked_prefill_size=BUCKET, kv_tokens=4 * BUCKET, progress=False)  # a toy's pool: no GPU share
    try:
        if eng.telemetry.refused_reason or eng.telemetry.compile_error:
            raise RuntimeError(eng.telemetry.refused_reason or eng.telemetry.compile_error)
        batch, slots = one_batch(eng, make_prompts([BUCKET], model.vocab_size, 0)[0])
        try:
            yield eng, batch, len(list(eng.model.parameters()))
        finally:
            eng.kv_pool.free(slots)
    finally:
        del eng
        release_memory()


def _eager(device: str) -> tuple[list[float], list[int]]:
    """(island host µs of one forward, parameter tensors) of the eager tiny-dense toy at each of :data:`LAYERS`."""
    islands, params = [], []
    for n in LAYERS:
        with _toy(device, "eager", n) as (eng, batch, num_params):
            islands.append(_island_us(eng, batch))
            params.append(num_params)
    return islands, params


def _timed(device: str, backend: str) -> tuple[tuple[float, float], float]:
    """((host µs of one forward at each of :data:`LAYERS`), host µs of the batch's load into the static fields of the
    smaller) of the tiny-dense toys on ``backend``."""
    low, high = LAYERS
    with _toy(device, backend, low) as (eng, batch, _), _toy(device, backend, high) as (eng_high, batch_high, _):
        hosts = _paired_host_us((eng, batch), (eng_high, batch_high))
        load = _load_us(eng, batch)
    return hosts, load


def measure_paths(device: torch.device | str, backends: tuple[str, ...] = ("breakable", "full", "tc_piecewise"),
                  cache: bool = True) -> PathCosts:
    """Measures :class:`PathCosts` for ``backends`` on ``device`` (see the module doc); a backend whose toy engine
    cannot be built is left out with the reason in ``errors``. Example::

        paths = measure_paths("cuda")
        paths.per_layer_us["tc_piecewise"], paths.fixed_us["breakable"]
    """
    device = str(torch.device(device))
    key = (device, tuple(sorted(backends)), torch.get_num_threads())
    if cache and key in _CACHE:
        return dataclasses.replace(_CACHE[key], seconds=0.0)
    t0 = time.perf_counter()
    low, high = LAYERS
    (i_low, i_high), (p_low, p_high) = _eager(device)
    island_per_layer = max((i_high - i_low) / (high - low), 0.0)
    params_per_layer = (p_high - p_low) / (high - low)
    out = PathCosts(island_us=island_per_layer, params_per_layer=params_per_layer,
                    params_fixed=p_low - low * params_per_layer)
    for backend in backends:
        try:
            (h_low, h_high), load = _timed(device, backend)
        except Exception as e:  # a backend the toy cannot build: its primitives' costs stand
            from bcg.errors import first_line

            out.errors[backend] = first_line(e)
            continue
        per_layer = (h_high - h_low) / (high - low)
        out.layer_total_us[backend] = per_layer
        out.per_layer_us[backend] = max(per_layer - island_per_layer, 0.0)
        out.fixed_us[backend] = max(h_low - low * per_layer - load, 0.0)
    out.seconds = time.perf_counter() - t0
    _CACHE[key] = dataclasses.replace(out)
    return out
