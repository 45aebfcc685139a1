"""This machine's measured costs kept on disk between runs of ``bcg analyze``: what does not depend on the model.

The microbenchmarks of :mod:`bcg.bench.machine` (the host's launch, replay, break, piece, capture and compile costs;
the device time of a tiny and a medium kernel) and the real replay paths of :mod:`bcg.bench.paths` take several
seconds on a GPU (an Inductor compile among them) and give the same answer for every model on the same machine. Each
is stored as one JSON file under :func:`cache_dir`, named by a hash of its key and holding the key itself, so an entry
is used only where every part of the key matches:

* the machine: the device's name (the GPU's, else the CPU's model), the cores this process may run on and torch's
  thread count (the host costs scale with them: ``--cpu-cores`` runs get entries of their own);
* the software: torch's version and its CUDA, triton's version, Python's major and minor version;
* what was measured and how: :data:`METHOD` (raised whenever the measuring code changes what it returns) and the
  shapes the measuring code runs (the kernel counts and repetitions of ``machine_probes.py`` and
  ``machine_compile.py``, the toy model and layer counts of ``paths.py``), and the compilers, guards and backends
  asked for. bcg's version and commit are not in it: a commit that leaves the measured paths alone keeps the entries.

``--machine-cache use`` (the default) reads an entry where one matches and measures and writes one where none does;
``refresh`` measures again and overwrites; ``off`` neither reads nor writes. An entry that cannot be read is measured
again, and why is one of the run's notes. ``BCG_CACHE_DIR`` moves the folder (for tests and debugging).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bcg.bench import machine, machine_compile, paths
from bcg.bench import machine_probes as probes
from bcg.bench.defaults import MACHINE_CACHE_MODES

__all__ = ["METHOD", "MachineCache", "cache_dir", "identity"]

# Raise when machine*.py or paths.py changes what a measurement returns or how it is taken: old entries stop matching.
# 2: paths.py subtracts the toy's islands back to back; 3: its fixed cost less the load, not eager's; 4: the mixed
# chain; 5: the fused chain; 6: the segments' start on the device
METHOD = 6


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the entries live: ``$BCG_CACHE_DIR`` (tests, debugging), else ``$XDG_CACHE_HOME/bcg``, else
    ``~/.cache/bcg``.

    Example::

        >>> cache_dir({"XDG_CACHE_HOME": "/scratch/cache"}).as_posix()
        '/scratch/cache/bcg'
    """
    if environ.get("BCG_CACHE_DIR"):
        return Path(environ["BCG_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bcg"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def identity(device: torch.device | str, host: bool = True) -> dict[str, Any]:
    """The machine and software part of every key: the device's name, torch (and its CUDA), triton and Python, and
    with ``host`` the cores this process may use and torch's threads.

    Example::

        identity("cpu")["torch"] == torch.__version__
    """
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    out: dict[str, Any] = {"device": device.type, "device_name": name, "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": _version("triton"),
                           "python": f"{sys.version_info.major}.{sys.version_info.minor}", "method": METHOD}
    if host:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        out.update(cores=cores, threads=torch.get_num_threads())
    return out


def _machine_shape() -> dict[str, Any]:
    return {"kernels": probes.N_KERNELS, "breaks": probes.N_BREAKS, "medium": probes.N_MEDIUM,
            "medium_elements": probes.MEDIUM_ELEMENTS, "graphs": probes.N_GRAPHS, "reps": probes.REPS,
            "block_kernels": machine_compile.COMPILE_BLOCK_KERNELS, "chain": probes.N_CHAIN,
            "chain_shape": probes.CHAIN_SHAPE}


def _paths_shape() -> dict[str, Any]:
    from bcg.models.config import PRESETS

    return {"layers": list(paths.LAYERS), "bucket": paths.BUCKET, "reps": paths.REPS,
            "model": dataclasses.asdict(PRESETS["tiny-dense"])}


@dataclass
class MachineCache:
    """The disk cache of one run (``mode`` one of :data:`~bcg.bench.defaults.MACHINE_CACHE_MODES`): it answers each
    measurement from an entry or by measuring, and records where each answer came from (``sources``: "disk",
    "measured", or "process" when this process had measured it already) and any entry it could not use (``notes``).

    Example::

        cache = MachineCache("use")
        costs = cache.machine_costs("cuda", compilers=("inductor",), guards=True)
        cache.sources["machine"]       # "disk" on the second run on this machine
    """

    mode: str = "use"
    root: Path = field(default_factory=cache_dir)
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MACHINE_CACHE_MODES:
            raise ValueError(f"--machine-cache must be one of {', '.join(MACHINE_CACHE_MODES)}, got {self.mode!r}")

    def path(self, what: str, key: dict[str, Any]) -> Path:
        """The file of the entry ``what`` ("machine", "paths", "device") under ``key``."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return self.root / f"{what}-{digest}.json"

    def _read(self, what: str, key: dict[str, Any]) -> dict[str, Any] | None:
        if self.mode != "use":
            return None
        path = self.path(what, key)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != json.loads(json.dumps(key, default=str)):
                raise ValueError("its key differs from this run's")
            return entry["value"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # not an entry of ours
            self.notes.append(f"the cached {what} costs in {path} could not be used ({e}); measured again")
            return None

    def _write(self, what: str, key: dict[str, Any], value: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        path = self.path(what, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "value": value},
                                      indent=1, default=str))
            os.replace(tmp, path)  # whole or not at all: a reader never sees half an entry
            self.files[what] = str(path)
        except OSError as e:
            self.notes.append(f"the {what} costs could not be cached in {self.root} ({e}); the next run measures "
                              "them again")

    def _get(self, what: str, key: dict[str, Any], measure: Callable[[bool], Any], load: Callable[[dict], Any],
             seconds: Callable[[Any], float]) -> Any:
        """The entry ``what`` under ``key``, else ``measure(fresh)`` (``fresh``: past this process's own copy too,
        as ``refresh`` asks), kept on disk unless the mode is off."""
        value = self._read(what, key)
        if value is not None:
            try:
                out = load(value)
                self.sources[what], self.files[what] = "disk", str(self.path(what, key))
                return out
            except (TypeError, ValueError, KeyError) as e:
                self.notes.append(f"the cached {what} costs in {self.path(what, key)} could not be used ({e}); "
                                  "measured again")
        out = measure(self.mode == "refresh")
        # seconds 0: this process had measured them already (machine.py and paths.py keep one copy each)
        self.sources[what] = "process" if seconds(out) == 0.0 else "measured"
        if not getattr(out, "errors", None):  # a toy engine that failed to build may build next time: not kept
            self._write(what, key, dataclasses.asdict(out) if dataclasses.is_dataclass(out) else out)
        return out

    def machine_costs(self, device: torch.device | str, compilers: tuple[str, ...], guards: bool
                      ) -> machine.MachineCosts:
        """:func:`bcg.bench.machine.measure`'s host costs, from an entry where one matches."""
        key = {**identity(device), "shape": _machine_shape(), "compilers": sorted(compilers), "guards": guards}

        def load(v: dict) -> machine.MachineCosts:
            v = dict(v, compile_ms={c: tuple(x) for c, x in v.get("compile_ms", {}).items()})
            return dataclasses.replace(machine.MachineCosts(**v), seconds=0.0, cached=True)

        return self._get("machine", key, lambda fresh: machine.measure(device, compilers, guards, cache=not fresh),
                         load, lambda c: c.seconds)

    def path_costs(self, device: torch.device | str, backends: tuple[str, ...]) -> paths.PathCosts:
        """:func:`bcg.bench.paths.measure_paths`'s replay-path costs, from an entry where one matches."""
        key = {**identity(device), "shape": _paths_shape(), "backends": sorted(backends)}
        return self._get("paths", key, lambda fresh: paths.measure_paths(device, backends, cache=not fresh),
                         lambda v: dataclasses.replace(paths.PathCosts(**v), seconds=0.0), lambda p: p.seconds)

    def device_costs(self, costs: machine.MachineCosts) -> machine.MachineCosts:
        """Fills in ``costs``' device times (:data:`bcg.bench.machine.DEVICE_FIELDS`, by
        :func:`bcg.bench.machine.measure_device`), from an entry where one matches: they depend on the device, not on
        the host's cores."""
        key = {**identity(costs.device, host=False), "shape": _machine_shape()}
        before = costs.seconds

        def measure(fresh: bool) -> dict[str, Any]:
            machine.measure_device(costs, cache=not fresh)
            return {**{f: getattr(costs, f) for f in machine.DEVICE_FIELDS}, "seconds": costs.seconds - before}

        def load(v: dict) -> dict[str, Any]:
            machine.replace_device(costs, v)
            return v

        self._get("device", key, measure, load, lambda v: v["seconds"])
        return costs

    def report(self) -> dict[str, Any]:
        """What results.json's ``timings.machine_cache`` holds: the mode, the folder, each answer's source and
        file."""
        return {"mode": self.mode, "dir": str(self.root), "sources": dict(self.sources), "files": dict(self.files)}
