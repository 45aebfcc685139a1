"""``bcg analyze``: which backend should this model use on this machine, with which capture ceiling and buckets,
judged before anything is captured or compiled.

The run, in the order CUPTI needs (once the profiler is loaded it slows later host work, so it comes last):

1. this machine's launch, replay, break, capture and compile costs (:mod:`bcg.bench.machine`), on CUDA the host
   costs of the real replay paths on toy engines (:mod:`bcg.bench.paths`), and, for each kernels setting the
   variants use, the host times of eager forwards at up to three sizes (:func:`bcg.bench.profile.host_times`), the
   others interpolated (:mod:`bcg.bench.host_sizes`);
   under ``--cpu-cores`` both again with the process pinned to each core count (:mod:`bcg.bench.cores`);
2. with ``--validate`` only: every variant built, captured and timed (:mod:`bcg.bench.validate`);
3. every size's profiled eager forwards, and the step ``full`` would capture run eagerly, both kernels settings in one
   profiler session (:func:`bcg.bench.profiled.profile_settings`), then the machine's device times.

The machine's costs do not depend on the model: they come from the disk cache where an entry matches this machine
and software (:mod:`bcg.bench.machine_cache`; ``--machine-cache``), else are measured and kept there. The eager
engines are built once per kernels setting (again after ``--validate``). ``timings`` says where the time went by
part (``parts_s``: eager engines, machine, replay paths, host times, profiles, machine (device), composition), where
the machine's costs came from (``machine_cache``) and how many runs and profiles each size took (``repeats``).

:func:`bcg.bench.findings.findings` turns that into predictions, a recommendation and the seed's four parameters;
:func:`bcg.bench.verdict.verdict` into one sentence; what it was computed from goes to inputs.json
(:mod:`bcg.bench.replay`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from bcg.bench import replay
from bcg.bench.config import AnalyzeConfig, BenchError
from bcg.bench.cores import pinned
from bcg.bench.engines import BuildRecord, EngineSpec, engine_for, memory_note
from bcg.bench.findings import EAGER_OF, Measurements, findings
from bcg.bench.forecast import Profiled
from bcg.bench.host_sizes import interpolate, timed_sizes
from bcg.bench.machine import replace_device
from bcg.bench.machine_cache import MachineCache
from bcg.bench.predict import HostTimes
from bcg.bench.profile import FullStep, host_times
from bcg.bench.profiled import profile_settings
from bcg.bench.recommend import Workload
from bcg.bench.validate import measure_variants, prompt_for
from bcg.bench.variants import parse_variant
from bcg.bench.verdict import MEMORY_SHARE_LIMIT, verdict

__all__ = ["run_analyze", "sample_lengths", "workload"]


class Stopwatch:
    """Seconds spent in each named part of a run (a part entered twice adds up)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0


def sample_lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    """``n`` seeded log-uniform prompt lengths in ``[low, high]`` (short prompts are common, long ones rare).

    Example::

        >>> xs = sample_lengths(100, 16, 2048, seed=0)
        >>> len(xs), min(xs) >= 16, max(xs) <= 2048
        (100, True, True)
    """
    low, high = max(1, min(low, high)), max(1, high)
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    xs = torch.exp(math.log(low) + u * (math.log(high) - math.log(low)))
    return [min(max(int(round(x)), low), high) for x in xs.tolist()]


def workload(cfg: AnalyzeConfig) -> Workload:
    """The prompt lengths of a resolved config's workload, and where they came from."""
    if cfg.lengths_file is not None:
        return Workload(tuple(cfg.lengths or ()), f"--lengths-file {cfg.lengths_file}")
    if cfg.lengths is not None:
        return Workload(tuple(cfg.lengths), "--lengths")
    lengths = sample_lengths(cfg.num_prompts, 16, cfg.chunked_prefill_size, cfg.seed)
    return Workload(tuple(lengths), f"{cfg.num_prompts} seeded log-uniform lengths in 16..{cfg.chunked_prefill_size}")


def _describe_model(eng: Any, name: str) -> dict[str, Any]:
    mc = eng.model.config
    params = list(eng.model.parameters())
    return {"name": name, "arch": mc.arch, "num_layers": mc.num_layers, "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size, "num_params": sum(p.numel() for p in params),
            "num_param_tensors": len(params), "weight_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtype": str(eng.dtype).replace("torch.", ""), "device": str(eng.device),
            "auto_islands": list(eng.telemetry.auto_islands), "notes": list(eng.telemetry.notes)}


@contextmanager
def _eager(spec: EngineSpec, name: str, model: str) -> Iterator[Any]:
    """The eager engine ``name`` of ``spec`` (freed on exit); a BenchError when it cannot be built: without the
    baseline nothing can be predicted."""
    record = BuildRecord(name)
    with engine_for(spec, name, record) as eng:
        if eng is None:
            raise BenchError(f"the {name} engine of {model!r} could not be built ({record.error})"
                             f"{memory_note(spec.config.torch_device)}")
        yield eng


def _full_settings(cfg: AnalyzeConfig) -> set[str]:
    """The kernels settings a ``full`` variant runs: only their eager engines time and profile the full step."""
    return {v.kernels for v in (parse_variant(b) for b in cfg.backends) if v.backend == "full"}


def _full_step(eng: Any, size: int) -> FullStep | None:
    try:
        return FullStep(eng, size)
    except Exception:  # full cannot stage this model at all: profile_settings records why
        return None


Hosts = dict[int | None, dict[str, dict[int, HostTimes]]]  # core count -> kernels setting -> size -> host times


def _host_phase(cfg: AnalyzeConfig, engines: dict[str, Any], settings: list[str], sizes: list[int], bar: Any,
                info: dict[str, Any], clock: Stopwatch, cache: MachineCache) -> tuple[dict[int | None, Any], Hosts]:
    """Step 1: the machine's costs and the eager host times, per core count."""
    variants = [parse_variant(v, cfg.tc_compiler) for v in cfg.backends]
    compilers = tuple(sorted({v.compile for v in variants if v.compile} |
                             {v.tc_compiler for v in variants if v.backend == "tc_piecewise"}))
    guards = any(v.backend == "tc_piecewise" for v in variants)
    paths_for = tuple(b for b in ("breakable", "full", "tc_piecewise") if any(v.backend == b for v in variants))
    costs: dict[int | None, Any] = {}
    hosts: Hosts = {}
    for k in [None, *(cfg.cpu_cores or [])]:
        bar.set_postfix(step="machine", cores=k or "all")
        with clock.part("machine"), pinned(k):
            costs[k] = cache.machine_costs(cfg.device, compilers if k is None else (), guards)
        if not cfg.emulated and paths_for:  # the real replay paths (CUDA only: under the emulation they say nothing)
            with clock.part("replay paths"), pinned(k):
                p = cache.path_costs(cfg.device, paths_for)
            costs[k].path_layer_us, costs[k].path_fixed_us = dict(p.per_layer_us), dict(p.fixed_us)
            costs[k].path_params_per_layer, costs[k].path_params_fixed = p.params_per_layer, p.params_fixed
            info.setdefault("path_errors", {}).update(p.errors)
        hosts[k] = {}
        for setting in settings:
            eng = engines[setting]
            info.setdefault("model", _describe_model(eng, cfg.model))
            vocab = eng.model.config.vocab_size
            with clock.part("host times"), pinned(k):
                timed = {}
                for n in timed_sizes(sizes):  # the others interpolated (bcg.bench.host_sizes says why)
                    bar.set_postfix(step=f"host times {EAGER_OF[setting]}", tokens=n, cores=k or "all")
                    timed[n] = host_times(eng, prompt_for(vocab, n, cfg.seed), cfg.runs, cfg.warmup,
                                          _full_step(eng, n) if setting in _full_settings(cfg) else None)
                    bar.update()
                hosts[k][setting] = interpolate(timed, sizes)
                bar.update(len(sizes) - len(timed))
    return costs, hosts


def _profile_phase(cfg: AnalyzeConfig, engines: dict[str, Any], settings: list[str], sizes: list[int],
                   hosts: dict[str, dict[int, HostTimes]], bar: Any, seconds: dict[str, float]
                   ) -> dict[str, dict[int, Profiled]]:
    """Step 3: every size's profiled eager forwards, every kernels setting in one profiler session (after every timed
    run); engines built again after ``--validate`` first run each size once."""
    bar.set_postfix(step="profile " + ", ".join(EAGER_OF[s] for s in settings), tokens=",".join(map(str, sizes)))
    jobs = {}
    for setting in settings:
        vocab = engines[setting].model.config.vocab_size
        jobs[setting] = (engines[setting], {n: prompt_for(vocab, n, cfg.seed) for n in sizes}, hosts[setting])
    out = profile_settings(jobs, warm=cfg.validate, seconds=seconds, full=_full_settings(cfg))
    bar.update(len(sizes) * len(settings))
    return out


def _open_eager(stack: ExitStack, spec: EngineSpec, settings: list[str], model: str, clock: Stopwatch
                ) -> dict[str, Any]:
    """The eager engine of each kernels setting, open until ``stack`` closes."""
    with clock.part("eager engines"):
        return {s: stack.enter_context(_eager(spec, EAGER_OF[s], model)) for s in settings}


def _budget(cfg: AnalyzeConfig, info: dict[str, Any]) -> float | None:
    """The graph-memory budget: ``--memory-budget``, else a share of what the weights leave free on CUDA (the memory
    the KV cache and the graphs share)."""
    if cfg.memory_budget is not None:
        return float(cfg.memory_budget)
    free = info.get("free_bytes")
    return None if free is None else MEMORY_SHARE_LIMIT * free


def _trace_notes(m: Measurements) -> list[str]:
    """What the profile could not attribute: an island none of whose calls got a kernel (every island the models
    mark launches at least one), so its device time was counted as graph work."""
    from bcg.bench.trace import regions

    notes = []
    for setting, by_size in m.profiles.items():
        rs = [r for r in regions(by_size[m.length].trace) if r.island is not None]
        names = {r.island.name for r in rs} - {r.island.name for r in rs if r.kernels}
        notes += [f"{EAGER_OF[setting]}: the profile matched no kernel to island {n} (neither its launches' "
                  "correlation ids nor their ops were recorded); its kernels count as graph work in the predictions"
                  for n in sorted(names)]
    return notes


def run_analyze(cfg: AnalyzeConfig, environment: dict[str, Any]) -> dict[str, Any]:
    """Runs ``bcg analyze`` for a resolved ``cfg``; returns the analysis as plain data (results.json's content, and
    under ``inputs`` what it was computed from: :func:`bcg.bench.replay.dump`, inputs.json's).

    Example::

        a = run_analyze(AnalyzeConfig(model="tiny-dense", device="cpu").resolved(), environment={})
        a["predictions"]["breakable"], a["recommendation"], a["verdict"]["sentence"]
    """
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    if not cfg.emulated:  # before any engine: what the weights will leave is this minus their bytes
        info["free_bytes"], info["total_bytes"] = torch.cuda.mem_get_info(torch.device(cfg.device))
    spec = cfg.engine_spec().replace(progress=False)
    settings = ["torch"] + (["fused"] if any(parse_variant(v).kernels == "fused" for v in cfg.backends) else [])
    graph_variants = [v for v in cfg.backends if parse_variant(v).backend != "eager"]
    m = Measurements(variants=graph_variants, chunk=cfg.chunked_prefill_size, max_tokens=cfg.max_tokens,
                     length=cfg.length, predict_lengths=cfg.predict_lengths, workload=workload(cfg), costs={},
                     hosts={}, profiles={}, num_params=0, emulated=cfg.emulated, tc_compiler=cfg.tc_compiler,
                     padding=(spec.config.max_padding_factor, spec.config.max_padding_tokens),
                     warmup=spec.config.warmup, cores=list(cfg.cpu_cores or []))
    sizes = m.sizes()
    steps = len(sizes) * len(settings) * (2 + len(m.cores))
    clock = Stopwatch()
    profile_s: dict[str, float] = {}  # of the profiles part: running the profiled forwards, reading their records
    cache = MachineCache(cfg.machine_cache)
    with tqdm(total=steps, desc="bcg analyze", unit="step", disable=not cfg.progress) as bar, ExitStack() as stack:
        engines = _open_eager(stack, spec, settings, cfg.model, clock)
        m.costs, m.hosts = _host_phase(cfg, engines, settings, sizes, bar, info, clock, cache)
        predict_s = time.perf_counter() - t0
        validate_s = None
        if cfg.validate:  # every variant built in turn: the eager engines make room, and come back fresh after
            stack.close()
            bar.set_postfix(step="validate")
            t1 = time.perf_counter()
            m.measured = measure_variants(cfg.engine_spec(), graph_variants, m.lengths(), cfg.length,
                                          cfg.runs, cfg.warmup, cfg.seed, [None, *m.cores])
            validate_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        if cfg.validate:
            engines = _open_eager(stack, spec, settings, cfg.model, clock)
        with clock.part("profiles"):
            m.profiles = _profile_phase(cfg, engines, settings, sizes, m.hosts[None], bar, profile_s)
    with clock.part("machine (device)"):
        cache.device_costs(m.costs[None])
    for c in m.costs.values():  # device times do not depend on the host's cores
        replace_device(c, vars(m.costs[None]))
    m.num_params = info["model"]["num_param_tensors"]
    if "free_bytes" in info:
        info["free_bytes"] = max(info["free_bytes"] - info["model"]["weight_bytes"], 0)
    m.budget_bytes = _budget(cfg, info)
    a: dict[str, Any] = {"schema": "bcg.analyze/2", "kind": "analyze", "environment": environment,
                         "model": info["model"], "machine": {str(k): vars(c) for k, c in m.costs.items()},
                         "workload": {"source": m.workload.source, "num_prompts": len(m.workload.lengths),
                                      "lengths": list(m.workload.lengths)},
                         "lengths": m.lengths(), "length": cfg.length}
    with clock.part("composition"):
        a.update(findings(m))
    a["notes"] = _trace_notes(m) if not cfg.emulated else []
    a["notes"] += [f"the replay path of {b} could not be measured on a toy engine ({why}); its primitives' costs "
                   "stand in" for b, why in info.get("path_errors", {}).items()] + cache.notes
    a["notes"] += [f"{v} was predicted to capture this model but its build failed ({x['error']}); the recommendation "
                   "leaves it out" for v, x in (a.get("validation") or {}).items()
                   if x["predicted_available"] and not x["available"]]
    predict_s += time.perf_counter() - t2
    a["memory"] = {"free_bytes": info.get("free_bytes"), "total_bytes": info.get("total_bytes"),
                   "budget_bytes": m.budget_bytes,
                   "note": None if not cfg.emulated else "no device memory on a CPU: graph memory is an estimate "
                   "of the model's activations only, and nothing is measured"}
    a["timings"] = {"predict_s": predict_s, "validate_s": validate_s, "machine_s": m.costs[None].seconds,
                    "predict_over_validate": predict_s / validate_s if validate_s else None,
                    "parts_s": clock.parts, "profiles_s": profile_s, "machine_cached": m.costs[None].cached,
                    "machine_cache": cache.report(),
                    # how many untimed and timed runs each size's host times took (fewer than --warmup and --runs
                    # once settled; 0: interpolated) and how many profiles its kernels combine
                    "repeats": {EAGER_OF[s]: {n: {"host_warmups": m.hosts[None][s][n].warmups,
                                                  "host_runs": m.hosts[None][s][n].runs, "profiles": p.profiles}
                                              for n, p in by_size.items()} for s, by_size in m.profiles.items()}}
    a["verdict"] = verdict(a)
    a["inputs"] = replay.dump(m)  # what the predictions were computed from: the CLI writes it to inputs.json
    return a
