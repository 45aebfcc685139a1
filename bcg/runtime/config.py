"""Engine configuration: one dataclass, mapped 1:1 to CLI flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bcg.models.model_impl import check_model_impl
from bcg.runtime.compile import COMPILERS

__all__ = ["BACKENDS", "EngineConfig", "resolve_backend"]

# Names follow SGLang's --cuda-graph-backend-prefill values; "disabled" is an alias of "eager".
BACKENDS = ("eager", "breakable", "full", "tc_piecewise")
_ALIASES = {"disabled": "eager"}


def resolve_backend(name: str) -> str:
    """Canonical backend name; raises ValueError naming the valid choices."""
    name = _ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)} (or 'disabled')")
    return name


@dataclass
class EngineConfig:
    """Everything an :class:`~bcg.runtime.engine.Engine` needs besides the model.

    Attributes:
        backend: "eager" ("disabled"), "breakable", "full" or "tc_piecewise".
        device: "cuda", "cpu" or a torch device string; None picks CUDA when available.
        dtype: "bfloat16", "float16" or "float32"; None picks bfloat16 on CUDA and float32 on CPU.
        seed: seed of the random weights (same seed, same weights, whatever the backend).
        chunked_prefill_size: most tokens one forward processes; longer prompts are split into chunks.
        max_tokens: capture ceiling in tokens (the largest bucket); None means ``chunked_prefill_size``.
        buckets: explicit bucket list (token counts); None means the default ladder up to ``max_tokens``.
        max_padding_factor: run eagerly when the bucket would be more than this many times the real tokens.
        kv_tokens: KV pool capacity in tokens; None means ``4 * chunked_prefill_size``.
        max_requests: request slots of the "full" backend (the most requests one of its graphs packs); None means
            ``max(chunked_prefill_size // 512, 1)``.
        prefix_capacity: cached-prefix keys (summed over a batch's requests) a "full" graph can attend to: bucket
            ``b`` reads ``b + prefix_capacity`` key slots per layer. None means ``chunked_prefill_size``; a batch
            with more keys runs eagerly (reason "too_many_keys").
        tc_compiler: "inductor" or "eager" (no compilation), used by "tc_piecewise".
        kernels: the models' non-matmul ops: "fused" (the fused kernels of ``bcg.ops.kernels``: Triton on CUDA, their
            plain-torch references elsewhere) or "torch" (plain torch ops); None picks "fused" on CUDA, "torch" else.
        compile: compile the layer stack once with ``torch.compile`` before capturing it (``bcg.runtime.compile``):
            "inductor" (fused kernels, CUDA) or "eager" (trace only, no code generated: the CPU path); None compiles
            nothing. For "eager", "breakable" and "full" ("tc_piecewise" compiles itself: use ``tc_compiler``).
        model_impl: which implementation runs a checkpoint folder (vLLM's flag): "auto" (bcg's own model classes
            when they cover the architecture, else the checkpoint's transformers code), "native" or "transformers"
            (``AutoModelForCausalLM`` run as written, ``bcg.models.hf``). A transformers model object always runs as
            written; presets and ModelConfigs are native.
        auto_islands: run the modules of a transformers model that a CUDA graph cannot capture (host reads,
            data-dependent shapes) as eager islands, named in ``telemetry.auto_islands``; False refuses graph capture
            instead, naming module, op and fix.
        debug: run the whole layer stack as one eager break through the same runner path (bisects graph bugs).
        verify: after capture, replay every bucket against eager at the same padded shape and disable buckets
            that differ (bcg.runtime.runner.verify); costs one extra forward pair per bucket at startup.
        warmup: forward passes per bucket before its capture.
        progress: show a progress bar while capturing.
    """

    backend: str = "breakable"
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    chunked_prefill_size: int = 2048
    max_tokens: int | None = None
    buckets: list[int] | None = None
    max_padding_factor: float = 2.0
    kv_tokens: int | None = None
    max_requests: int | None = None
    prefix_capacity: int | None = None
    tc_compiler: str = "inductor"
    kernels: str | None = None
    compile: str | None = None
    model_impl: str = "auto"
    auto_islands: bool = True
    debug: bool = False
    verify: bool = False
    warmup: int = 2
    progress: bool = True

    def __post_init__(self) -> None:
        self.backend = resolve_backend(self.backend)
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.tc_compiler not in ("inductor", "eager"):
            raise ValueError(f"tc_compiler must be 'inductor' or 'eager', got {self.tc_compiler!r}")
        if self.kernels is not None and self.kernels not in ("fused", "torch"):
            raise ValueError(f"kernels must be 'fused', 'torch' or None (fused on CUDA), got {self.kernels!r}")
        if self.compile is not None and self.compile not in COMPILERS:
            raise ValueError(f"compile must be one of {', '.join(COMPILERS)} or None, got {self.compile!r}")
        if self.compile is not None and self.backend == "tc_piecewise":
            raise ValueError("compile= does not apply to backend='tc_piecewise', which compiles its pieces itself; "
                             "choose its compiler with tc_compiler='inductor' or 'eager'")
        check_model_impl(self.model_impl)
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.prefix_capacity is not None and self.prefix_capacity < 0:
            raise ValueError(f"prefix_capacity must be >= 0, got {self.prefix_capacity}")
        if self.max_padding_factor < 1.0:
            raise ValueError(f"max_padding_factor must be >= 1.0, got {self.max_padding_factor}")

    @property
    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        try:
            dtype = getattr(torch, self.dtype)
        except AttributeError:
            dtype = None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch dtype name such as 'bfloat16', got {self.dtype!r}")
        return dtype
