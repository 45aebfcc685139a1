"""The prefill engine: validate prompts, schedule chunks, run them through the runner, sample greedily."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, get_type_hints

import numpy as np
import torch

from bcg.models.base import CausalLM
from bcg.models.config import ModelConfig, get_preset
from bcg.models.hf import is_transformers_model
from bcg.models.model_impl import load_model_folder
from bcg.models.registry import build_model
from bcg.ops.kernels import fused_available
from bcg.runtime.batch import PrefillBatch, PrefillItem
from bcg.runtime.config import EngineConfig
from bcg.runtime.runner import Runner
from bcg.runtime.runner.buckets import default_ladder
from bcg.runtime.runner.telemetry import BatchRecord, Telemetry
from bcg.runtime.runner.verify import verify_buckets
from bcg.runtime.scheduler import Chunk, plan_batches

__all__ = ["Engine", "PrefillResult"]

Prompt = Sequence[int] | torch.Tensor
_NO_SLOTS = torch.empty(0, dtype=torch.long)


@dataclass
class PrefillResult:
    """Output of :meth:`Engine.prefill`.

    Attributes:
        logits: (num_prompts, vocab) fp32 logits at each prompt's last token.
        next_tokens: (num_prompts,) greedy first output token.
        batches: one record per forward (tokens, requests, bucket replayed or why it ran eagerly).
    """

    logits: torch.Tensor
    next_tokens: torch.Tensor
    batches: list[BatchRecord]


def _load_model(model: Any, cfg: EngineConfig) -> tuple[CausalLM, EngineConfig]:
    """The model to serve and the config with its device and dtype settled (a transformers model keeps its own)."""
    if is_transformers_model(model):
        if cfg.model_impl == "native":
            raise ValueError("model_impl='native' needs a checkpoint folder, a preset or a ModelConfig; a transformers "
                             "model object runs as written (model_impl='auto' or 'transformers')")
        from bcg.models.hf.load import place
        from bcg.models.hf.model import HFCausalLM

        device, dtype = place(model, cfg.device, cfg.dtype)
        cfg = replace(cfg, device=str(device), dtype=str(dtype).removeprefix("torch."))
        return HFCausalLM(model, auto_islands=cfg.auto_islands), cfg
    device, dtype = cfg.torch_device, cfg.torch_dtype
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        return load_model_folder(model, cfg.model_impl, device, dtype, cfg.auto_islands), cfg
    if cfg.model_impl == "transformers":
        raise ValueError(f"model_impl='transformers' needs a checkpoint folder or a transformers model, not "
                         f"{model!r} (presets, ModelConfigs and built models are bcg's own)")
    if isinstance(model, torch.nn.Module):
        return model.to(device=device, dtype=dtype), cfg
    if isinstance(model, ModelConfig):
        return build_model(model, device, dtype, cfg.seed), cfg
    return build_model(get_preset(str(model)), device, dtype, cfg.seed), cfg


class Engine:
    """Prefill-only inference engine with a pluggable CUDA-graph backend.

    Args:
        model: a preset name (``"tiny-dense"``, ``"llama-dense"``, ...), a Hugging Face checkpoint folder, a
            :class:`ModelConfig`, a built model, or a transformers ``*ForCausalLM`` (run as written, see below).
        config: an :class:`EngineConfig`; keyword arguments override or replace it field by field.
        **options: any field of :class:`EngineConfig` (the signature lists each with its default;
            ``help(EngineConfig)`` says what each does).

    Example::

        from bcg.runtime import Engine
        eng = Engine("tiny-dense", backend="breakable", device="cpu", seed=0)
        res = eng.prefill([[1, 2, 3], [4, 5, 6, 7, 8]])
        res.logits.shape, res.next_tokens      # (2, vocab), greedy next tokens

    A transformers model (``AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()``) runs with
    its own modules and weights through :class:`~bcg.models.hf.model.HFCausalLM`. The engine never casts it: with
    ``dtype`` unset the model's dtype is the engine's, and another dtype is an error saying how to load it; with
    ``device`` unset it stays where it is, and another device moves it (``.to``, dtypes kept). Its attention
    implementation is switched to bcg's and uncapturable modules become islands, in place
    (``engine.model.restore()`` undoes both).
    """

    def __init__(self, model: Any = "tiny-dense", config: EngineConfig | None = None, **kwargs: Any) -> None:
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown Engine option(s) {unknown}; valid options: {sorted(names)}")
        base = {f.name: getattr(config, f.name) for f in fields(EngineConfig)} if config else {}
        t0 = time.perf_counter()
        model, self.config = _load_model(model, EngineConfig(**{**base, **kwargs}))
        self.model = model.eval()
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.device, self.dtype = self.config.torch_device, self.config.torch_dtype
        cfg = self.config
        # The fused kernels are the native models' (a transformers model's modules run as written).
        is_native = isinstance(self.model, CausalLM)
        kernels = cfg.kernels or ("fused" if fused_available(self.device) and is_native else "torch")
        if kernels == "fused" and self.device.type == "cuda" and not fused_available(self.device):
            raise ValueError("kernels='fused' needs Triton on CUDA, which cannot be imported here; install the triton "
                             "that matches your torch, or pass kernels='torch'")
        self.model.set_kernels(kernels)
        sizes = cfg.buckets or default_ladder(cfg.max_tokens or cfg.chunked_prefill_size)
        # The pool must hold one largest-bucket dummy batch during capture and the biggest live batch.
        kv_tokens = max(cfg.kv_tokens or 4 * cfg.chunked_prefill_size, max(sizes))
        self.kv_pool = self.model.make_kv_pool(kv_tokens, self.device, self.dtype)
        self.runner = Runner(self.model, cfg, self.kv_pool, sizes)
        self.runner.telemetry.auto_islands = list(getattr(self.model, "auto_islands", ()))
        self.runner.telemetry.notes = list(getattr(self.model, "notes", ()))
        t0 = time.perf_counter()
        self.runner.build()
        self.build_ms = (time.perf_counter() - t0) * 1e3
        if cfg.verify and self.runner.handles:
            verify_buckets(self.runner)

    @property
    def telemetry(self) -> Telemetry:
        """Per-bucket build records and per-batch replay records."""
        return self.runner.telemetry

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Prompt]) -> PrefillResult:
        """Prefills every prompt and returns last-token logits and greedy next tokens.

        Prompts are lists of token ids or 1-D integer tensors (on the CPU or the engine's device). Prompts longer
        than ``chunked_prefill_size`` are split into chunks; chunks of several prompts are packed per forward.
        """
        ids, lengths = self._validate(prompts)
        all_slots = self.kv_pool.alloc(sum(lengths))  # all or nothing: a failure leaves the pool untouched
        slots = all_slots.split(lengths)
        records: list[BatchRecord] = []
        logits = torch.empty(len(ids), self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        try:
            for plan in plan_batches(lengths, self.config.chunked_prefill_size):
                items = [self._item(ids[c.request], slots[c.request], c) for c in plan]
                batch = PrefillBatch(items, self.kv_pool)
                hidden = self.runner.forward(batch)
                records.append(self.runner.last_record)
                last = [i for i, c in enumerate(plan) if c.is_last]
                if last:
                    # Common case, every request ends here in order: slices, no index tensors copied to the device.
                    rows = batch.logits_indices if len(last) == len(plan) else batch.logits_indices[last]
                    reqs = [plan[i].request for i in last]
                    dest = slice(reqs[0], reqs[-1] + 1) if reqs[-1] - reqs[0] == len(reqs) - 1 else reqs
                    logits[dest] = self.model.compute_logits(hidden[rows]).float()
        finally:
            self.kv_pool.free(all_slots)
        return PrefillResult(logits, logits.argmax(dim=-1), records)

    @staticmethod
    def _item(ids: torch.Tensor, slots: torch.Tensor, chunk: Chunk) -> PrefillItem:
        # ids were validated and slots come from the pool, all CPU int64: no per-item normalisation needed.
        start, end = chunk.start, chunk.end
        if start == 0 and chunk.is_last:  # a whole prompt: no slicing ops on the host's per-request path
            return PrefillItem.unchecked(ids, slots, 0, _NO_SLOTS)
        return PrefillItem.unchecked(ids[start:end], slots[start:end], start, slots[:start])

    def _validate(self, prompts: Sequence[Prompt]) -> tuple[list[torch.Tensor], list[int]]:
        """CPU int64 tensors of the prompts and their lengths, or a clear error naming the bad prompt."""
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or isinstance(prompts, str):
            raise TypeError("prefill() takes a list of prompts (lists of token ids or 1-D integer tensors), "
                            f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prefill() needs at least one prompt; got an empty list")
        vocab, out, lengths = self.model.config.vocab_size, [], []
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                if p.dtype == torch.long and p.device.type == "cpu" and p.dim() == 1:  # already what we need
                    t = p
                elif p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                    raise TypeError(f"prompt {i} is a {p.dtype} tensor; token ids must be an integer tensor "
                                    "(e.g. torch.long)")
                elif p.device.type != "cpu" and p.device != self.device:
                    raise ValueError(f"prompt {i} is on {p.device}, but the engine runs on {self.device}; "
                                     f"pass it on the CPU or on {self.device}")
                elif p.dim() != 1:
                    raise ValueError(f"prompt {i} has shape {tuple(p.shape)}; a prompt is a 1-D tensor of ids")
                else:
                    t = p.to(device="cpu", dtype=torch.long)
            else:
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in p):
                    raise TypeError(f"prompt {i} must contain Python ints (token ids)")
                t = torch.tensor(list(p), dtype=torch.long)
            n = t.shape[0]
            if n == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            out.append(t)
            lengths.append(n)
        # One range check for the whole batch (numpy: cheaper per call); find the culprit only on error.
        every = np.concatenate([t.numpy() for t in out])
        if every.min() < 0 or every.max() >= vocab:
            i = next(i for i, t in enumerate(out) if t.min() < 0 or t.max() >= vocab)
            bad = int(out[i].min()) if out[i].min() < 0 else int(out[i].max())
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab})")
        total, capacity = sum(lengths), self.kv_pool.num_free
        if total > capacity:
            raise ValueError(f"the prompts need {total} KV slots but the pool has {capacity} free; raise "
                             "kv_tokens or prefill fewer/shorter prompts")
        return out, lengths


def _signature_with_options() -> inspect.Signature:
    """``Engine.__init__``'s signature with ``**kwargs`` spelled out as EngineConfig's fields and defaults, so
    ``help(Engine)`` and editors show every option; built from the dataclass, so it cannot drift from it."""
    init = inspect.signature(Engine.__init__, eval_str=True)
    head = [p for p in init.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = get_type_hints(EngineConfig)

    def default(f: Any) -> Any:
        if f.default is not MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not MISSING else inspect.Parameter.empty

    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default(f),
                                 annotation=hints.get(f.name, f.type)) for f in fields(EngineConfig)]
    return init.replace(parameters=head + options)


Engine.__init__.__signature__ = _signature_with_options()  # type: ignore[attr-defined]
