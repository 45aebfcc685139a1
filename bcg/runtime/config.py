"""Engine configuration: one dataclass, every field checked when it is made.

The ``bcg`` command maps the fields a benchmark varies to flags of the same name (``bcg bench --help``); the others
are set in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bcg.leaks import LEAK_CHECK_MODES
from bcg.models.impl_names import check_model_impl
from bcg.ops.attention import ATTENTION_BACKENDS
from bcg.runtime.backend_registry import BACKENDS, DEFAULT_FULL_GRAPH_TOKENS, resolve_backend
from bcg.runtime.compile import COMPILERS
from bcg.runtime.config_checks import bucket_list, check_bool, check_int, check_number, device_name, dtype_name
from bcg.runtime.schedule_policies import SCHEDULE_POLICIES

__all__ = ["BACKENDS", "DEFAULT_FULL_GRAPH_TOKENS", "SCHEDULE_POLICIES", "EngineConfig", "describe_buckets",
           "resolve_backend"]


def describe_buckets(buckets: list[int]) -> str:
    """Buckets as a user reads them: every size when there are few, else the range and how many.

    Example:
        >>> describe_buckets([8, 16]), describe_buckets(list(range(4, 68, 4)))
        ('8,16', '4..64 (16 buckets)')
    """
    if len(buckets) <= 6:
        return ",".join(map(str, buckets))
    return f"{buckets[0]}..{buckets[-1]} ({len(buckets)} buckets)"


@dataclass
class EngineConfig:
    """Everything an :class:`~bcg.runtime.engine.Engine` needs besides the model.

    Fields left ``None`` are chosen for the machine; :meth:`resolved` settles them, and an engine's ``config`` is
    always resolved, so ``engine.config.kernels`` says which kernels it runs (``engine.config.describe()``: all of it
    in one line).

    Attributes:
        backend: "eager" ("disabled"), "breakable", "full" or "tc_piecewise".
        device: "cuda", "cuda:N", "cpu" or a torch.device; None picks CUDA when available.
        dtype: "bfloat16", "float16", "float32" or a torch dtype; None picks bfloat16 on CUDA and float32 on CPU.
        seed: seed of the random weights (same seed, same weights, whatever the backend).
        chunked_prefill_size: most tokens one forward processes; longer prompts are split into chunks.
        max_tokens: capture ceiling in tokens (the largest bucket); None means ``chunked_prefill_size``.
        buckets: explicit bucket list (token counts); None means the default ladder up to ``max_tokens``.
        max_padding_factor: the padding bound for large buckets: a batch of ``n`` tokens replays bucket ``b`` when
            ``b <= max_padding_factor * n``, or when ``max_padding_tokens`` allows it.
        max_padding_tokens: padded rows always worth replaying: a batch replays a bucket at most this many rows
            larger whatever the ratio (a few padded rows cost nothing next to eager's launch cost).
        max_replay_failures: consecutive replay failures of one bucket that disable it (a good replay resets the
            count); each failed batch runs eagerly. ``Engine.enable_bucket`` / ``Engine.recapture`` bring it back.
        kv_tokens: KV pool capacity in tokens; None sizes it automatically: ``kv_memory_fraction`` of the free
            device memory on CUDA, the model's context length plus one chunk on the CPU (at most a quarter of the
            available RAM), and never less than the largest bucket.
        kv_memory_fraction: share of the free CUDA memory (after the model is loaded, before capture) the KV pool
            takes when ``kv_tokens`` is None.
        max_requests: request slots of the "full" backend (the most requests one of its graphs packs); None means
            ``max(chunked_prefill_size // 512, 1)``.
        prefix_capacity: cached-prefix keys (summed over a batch's requests) a "full" graph can attend to: bucket
            ``b`` reads ``b + prefix_capacity`` key slots per layer. None means ``chunked_prefill_size``; a batch
            with more keys runs eagerly (reason "too_many_keys").
        attention_backend: the attention kernel of the islands ("varlen": FlashAttention varlen, CUDA in half
            precision; "sdpa": per-request SDPA, any device; "triton": bcg's Triton varlen kernel, CUDA in half
            precision) or "static" (inside the graph: backend "full"'s; "static_triton": the same with bcg's
            Triton kernel reading the KV pool in place, opt-in); None
            picks "static" for "full", else "varlen" where it runs and "sdpa" elsewhere (``bcg.ops.attention``).
        max_logit_rows: rows of the LM head inside a captured graph (bucket ``b`` computes ``min(b, max_logit_rows)``
            requests' logits); a batch that ends more requests computes the rest eagerly after the replay.
        tc_compiler: "inductor" or "traced" (no compilation), used by "tc_piecewise".
        kernels: the models' non-matmul ops: "fused" (the fused kernels of ``bcg.ops.kernels``: Triton on CUDA, their
            plain-torch references elsewhere) or "torch" (plain torch ops); None picks "fused" on CUDA, "torch" else.
        compile: compile the layer stack once with ``torch.compile`` before capturing it (``bcg.runtime.compile``):
            "inductor" (fused kernels, CUDA) or "traced" (dynamo's trace only, no code generated: the CPU path); None
            compiles nothing. For "eager", "breakable" and "full" ("tc_piecewise" compiles itself: use ``tc_compiler``).
        model_impl: which implementation runs a checkpoint folder (vLLM's flag): "auto" (bcg's own model classes
            when they cover the architecture, else the checkpoint's transformers code), "native" or "transformers"
            (``AutoModelForCausalLM`` run as written, ``bcg.models.hf``). A transformers model object always runs as
            written; presets and ModelConfigs are native.
        auto_islands: run the modules of a transformers model that a CUDA graph cannot capture (host reads,
            data-dependent shapes) as eager islands, named in ``telemetry.auto_islands``; False refuses graph capture
            instead, naming module, op and fix.
        debug: run the whole layer stack as one eager break through the same runner path (bisects graph bugs).
        leak_check: at capture, report the tensors an island allocates and keeps without returning them
            (``bcg.leaks``): "warn", "raise" or "off"; None reads ``BCG_LEAK_CHECK`` (default "off").
        verify: after capture, replay every bucket against eager at the same padded shape and disable buckets
            that differ (bcg.runtime.runner.verify); costs one extra forward pair per bucket at startup.
        warmup: forward passes per bucket before its capture.
        progress: show a progress bar while capturing.
        tp_size: tensor parallel ranks, one process each (launch with ``torchrun --nproc-per-node tp_size``); 1 runs
            on one device with no process group. It must divide the model's query heads (and FFN sizes).
        tp_timeout_s: how long a tensor parallel rank waits for the others in any collective or agreement before
            raising (a rank died or hangs); used for the process groups bcg creates.
        prefix_cache: keep the KV of submitted prompts in the pool so a later request sharing a prefix reuses it
            (``Engine.submit``; ``bcg.runtime.serving.prefix_cache``); evicted least recently used when the pool runs
            short. None turns it on wherever it is exact: on one process (under tensor parallel every rank would
            have to hold the same cache; it is refused there). ``prefill()`` always computes every prompt in full.
        schedule_policy: the order ``Engine.submit``'s waiting requests are admitted in: "fifo" (first come, first
            served) or "shortest" (shortest prompt first: a lower median time to first token under load, while a
            long prompt may wait as long as shorter ones keep coming); ``bcg.runtime.serving.policy``.
        max_inflight_batches: forwards the serving scheduler launches ahead of the device (at least 1): with 2 it
            prepares and launches the next forward while the device runs the current one.
        full_graph_tokens: backend "breakable" only: the buckets up to this many tokens also hold a whole-step graph
            with the attention inside ("static_triton" where it runs, else "static"); a batch within its request
            slots and key capacity replays that one (no island launched), any other the breakable one. 0: off;
            None: for "breakable" on one CUDA device every bucket up to ``DEFAULT_FULL_GRAPH_TOKENS`` (2048;
            :mod:`bcg.runtime.backend_registry` has the measurements), else 0 (on the CPU the graphs are emulated
            and islands cost no launches; pass a size to build them there too).
    """

    backend: str = "breakable"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    chunked_prefill_size: int = 2048
    max_tokens: int | None = None
    buckets: list[int] | None = None
    max_padding_factor: float = 2.0
    max_padding_tokens: int = 64
    max_replay_failures: int = 3
    kv_tokens: int | None = None
    kv_memory_fraction: float = 0.5
    max_requests: int | None = None
    prefix_capacity: int | None = None
    attention_backend: str | None = None
    max_logit_rows: int = 64
    tc_compiler: str = "inductor"
    kernels: str | None = None
    compile: str | None = None
    model_impl: str = "auto"
    auto_islands: bool = True
    debug: bool = False
    leak_check: str | None = None
    verify: bool = False
    warmup: int = 2
    progress: bool = True
    tp_size: int = 1
    tp_timeout_s: float = 600.0
    prefix_cache: bool | None = None
    schedule_policy: str = "fifo"
    max_inflight_batches: int = 2
    full_graph_tokens: int | None = None

    def __post_init__(self) -> None:
        self.backend = resolve_backend(self.backend)
        self.device = device_name(self.device)
        self.dtype = dtype_name(self.dtype)
        check_int("seed", self.seed, None)
        check_int("chunked_prefill_size", self.chunked_prefill_size, 1)
        check_int("max_tokens", self.max_tokens, 1, optional=True)
        self.buckets = bucket_list(self.buckets)
        check_number("max_padding_factor", self.max_padding_factor, 1.0)
        check_int("max_padding_tokens", self.max_padding_tokens, 0)
        check_int("max_replay_failures", self.max_replay_failures, 1)
        check_int("kv_tokens", self.kv_tokens, 1, optional=True)
        check_number("kv_memory_fraction", self.kv_memory_fraction, 0.0, 1.0, low_open=True)
        check_int("max_requests", self.max_requests, 1, optional=True)
        check_int("prefix_capacity", self.prefix_capacity, 0, optional=True)
        check_int("max_logit_rows", self.max_logit_rows, 1)
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(sorted(ATTENTION_BACKENDS))} or None "
                             f"(chosen for the device), got {self.attention_backend!r}")
        check_int("warmup", self.warmup, 0)
        for name in ("auto_islands", "debug", "verify", "progress"):
            check_bool(name, getattr(self, name))
        for name in ("compile", "tc_compiler"):
            if getattr(self, name) == "eager":  # the old spelling, which also names a backend
                raise ValueError(f"{name}='eager' is now spelled {name}='traced' (dynamo's trace, no code generated)")
        if self.tc_compiler not in ("inductor", "traced"):
            raise ValueError(f"tc_compiler must be 'inductor' or 'traced', got {self.tc_compiler!r}")
        check_int("tp_size", self.tp_size, 1)
        check_number("tp_timeout_s", self.tp_timeout_s, 0.0, low_open=True)
        if self.kernels is not None and self.kernels not in ("fused", "torch"):
            raise ValueError(f"kernels must be 'fused', 'torch' or None (fused on CUDA), got {self.kernels!r}")
        if self.compile is not None and self.compile not in COMPILERS:
            raise ValueError(f"compile must be one of {', '.join(COMPILERS)} or None, got {self.compile!r}")
        if self.compile is not None and self.backend == "tc_piecewise":
            raise ValueError("compile= does not apply to backend='tc_piecewise', which compiles its pieces itself; "
                             "choose its compiler with tc_compiler='inductor' or 'traced'")
        check_model_impl(self.model_impl)
        if self.prefix_cache is not None:
            check_bool("prefix_cache", self.prefix_cache)
            if self.prefix_cache and self.tp_size > 1:
                raise ValueError("prefix_cache=True needs tp_size=1: under tensor parallel every rank would have to "
                                 "hold the same cache; leave prefix_cache unset (off there) or pass False")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got "
                             f"{self.schedule_policy!r}")
        check_int("max_inflight_batches", self.max_inflight_batches, 1)
        check_int("full_graph_tokens", self.full_graph_tokens, 0, optional=True)
        if self.full_graph_tokens and (self.backend != "breakable" or self.tp_size > 1):
            raise ValueError(f"full_graph_tokens={self.full_graph_tokens} adds whole-step graphs to backend="
                             "'breakable' on one process; leave it 0 (or None) with backend="
                             f"{self.backend!r}{' and tp_size > 1' if self.tp_size > 1 else ''}")
        if self.leak_check is not None and self.leak_check not in LEAK_CHECK_MODES:
            raise ValueError(f"leak_check must be one of {', '.join(LEAK_CHECK_MODES)} or None (BCG_LEAK_CHECK), "
                             f"got {self.leak_check!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether served requests share cached prefixes: ``prefix_cache``, or on one process when it is None."""
        return self.prefix_cache if self.prefix_cache is not None else self.tp_size == 1

    @property
    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolved(self) -> EngineConfig:
        """A copy with every choice left to bcg settled for this machine: ``device``, ``dtype``, ``kernels``,
        ``attention_backend``, ``buckets`` (with ``max_tokens``, their largest) and ``full_graph_tokens``.
        Resolving twice changes nothing.

        Raises:
            ValueError: ``kernels="fused"`` on CUDA without Triton (naming the fix).

        Example::

            cfg = EngineConfig(device="cpu", chunked_prefill_size=64).resolved()
            cfg.kernels, cfg.attention_backend, cfg.buckets[-1]        # ('torch', 'sdpa', 64)
        """
        from bcg.ops.kernels import fused_available
        from bcg.runtime.backend_registry import backend_class
        from bcg.runtime.runner.buckets import default_ladder  # the runner package imports this module

        device, dtype = self.torch_device, self.torch_dtype
        has_fused = fused_available(device)
        kernels = self.kernels or ("fused" if has_fused else "torch")
        if kernels == "fused" and device.type == "cuda" and not has_fused:
            raise ValueError("kernels='fused' needs Triton on CUDA, which cannot be imported here; install the triton "
                             "that matches your torch, or pass kernels='torch'")
        attention = self.attention_backend or backend_class(self.backend).default_attention(device, dtype)
        buckets = self.buckets or default_ladder(self.max_tokens or self.chunked_prefill_size)
        full = self.full_graph_tokens
        if full is None:
            on_one_gpu = self.backend == "breakable" and self.tp_size == 1 and device.type == "cuda"
            full = min(max(buckets), DEFAULT_FULL_GRAPH_TOKENS) if on_one_gpu else 0
        return replace(self, device=str(device), dtype=str(dtype).removeprefix("torch."), kernels=kernels,
                       attention_backend=attention, buckets=sorted(set(buckets)), max_tokens=max(buckets),
                       full_graph_tokens=full)

    def describe(self) -> str:
        """What an engine of this config runs, in one line (resolved first, so nothing reads "auto").

        Example::

            EngineConfig(device="cpu", chunked_prefill_size=64).describe()
            # 'backend breakable, kernels torch, attention sdpa, compile none, buckets 4..64 (10 buckets), cpu float32'
        """
        cfg = self.resolved()
        compiler = (f"tc_compiler {cfg.tc_compiler}" if cfg.backend == "tc_piecewise" else
                    f"compile {cfg.compile or 'none'}")
        graphs = "no graphs" if cfg.backend == "eager" else f"buckets {describe_buckets(cfg.buckets)}"
        if cfg.full_graph_tokens:
            graphs += f", full graphs up to {cfg.full_graph_tokens} tokens"
        return (f"backend {cfg.backend}, kernels {cfg.kernels}, attention {cfg.attention_backend}, {compiler}, "
                f"{graphs}, {cfg.device} {cfg.dtype}")
