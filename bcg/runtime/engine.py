"""The prefill engine: validate prompts, schedule chunks, lease KV slots, run the chunks through the runner, sample
greedily. An engine can be called from several threads: its runner serialises the forwards (from loading the static
buffers to the LM head) and each prefill leases its KV slots from a thread-safe pool."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, get_type_hints

import torch

from bcg.ops.kernels import fused_available
from bcg.ops.kv_cache import KVPoolFullError
from bcg.ops.parallel import init_tensor_parallel
from bcg.runtime.batch import PrefillBatch, PrefillItem
from bcg.runtime.config import EngineConfig
from bcg.runtime.kv_slots import SlotLease, default_kv_tokens, make_kv_pool
from bcg.runtime.model_source import load_model
from bcg.runtime.prompts import validate_prompts
from bcg.runtime.runner import Runner
from bcg.runtime.runner.agreement import RankAgreement
from bcg.runtime.runner.buckets import BucketRecord, default_ladder
from bcg.runtime.runner.telemetry import BatchRecord, Telemetry
from bcg.runtime.runner.verify import verify_buckets
from bcg.runtime.scheduler import Chunk, plan_batches

__all__ = ["Engine", "PrefillResult"]

Prompt = Sequence[int] | torch.Tensor


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


class Engine:
    """Prefill-only inference engine with a pluggable CUDA-graph backend.

    Args:
        model: a preset name (``"tiny-dense"``, ``"llama-dense"``, ...), a Hugging Face checkpoint folder, a
            :class:`ModelConfig`, a built model, or a transformers ``*ForCausalLM`` (run as written, see below).
        config: an :class:`EngineConfig`; keyword arguments override or replace it field by field.
        **kwargs: any field of :class:`EngineConfig` (the signature lists each with its default;
            ``help(EngineConfig)`` says what each does).

    With ``tp_size > 1`` every process of a ``torchrun`` group builds the same engine: the process group comes from
    the environment (NCCL on CUDA, gloo on a CPU), each rank holds its shard of the model, every decision is
    agreed across ranks, and every rank returns the same :class:`PrefillResult`.

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
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig (or None, with options as keyword arguments), got "
                            f"{config!r} ({type(config).__name__})")
        base = {f.name: getattr(config, f.name) for f in fields(EngineConfig)} if config else {}
        requested = EngineConfig(**{**base, **kwargs})
        if requested.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={requested.device!r} needs CUDA, which is not available here; use "
                             "device='cpu' (graphs are emulated there)")
        self.tp = init_tensor_parallel(requested.tp_size, requested.torch_device, requested.tp_timeout_s)
        t0 = time.perf_counter()
        model, self.config = load_model(model, requested, self.tp)
        self.model = model.eval()
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.device, self.dtype = self.config.torch_device, self.config.torch_dtype
        cfg = self.config
        # Fused kernels wherever Triton runs: the native models' ops and a transformers model's fused stand-ins.
        has_fused = fused_available(self.device)
        kernels = cfg.kernels or ("fused" if has_fused else "torch")
        if kernels == "fused" and self.device.type == "cuda" and not has_fused:
            raise ValueError("kernels='fused' needs Triton on CUDA, which cannot be imported here; install the triton "
                             "that matches your torch, or pass kernels='torch'")
        self.model.set_kernels(kernels)
        sizes = cfg.buckets or default_ladder(cfg.max_tokens or cfg.chunked_prefill_size)
        # The pool must hold one largest-bucket dummy batch during capture; a prefill holds at most its peak. Its
        # bytes per token are read off the model's own pool layout, built on the meta device (no memory).
        per_token = self.model.make_kv_pool(1, "meta", self.dtype).bytes_per_token
        kv_tokens = max(cfg.kv_tokens, max(sizes)) if cfg.kv_tokens else default_kv_tokens(
            per_token, self.model.config.max_position_embeddings, cfg.chunked_prefill_size, max(sizes), self.device,
            cfg.kv_memory_fraction)
        if self.tp.is_parallel:  # every rank allocates the same slots, so every pool has the size of the smallest
            kv_tokens = RankAgreement(self.tp).agree_min(kv_tokens, "the KV pool size")
        self.kv_pool = make_kv_pool(self.model, kv_tokens, per_token, self.device, self.dtype)
        # Prefills in flight (and those holding KV leases), a recapture in progress, and the condition prefills
        # wait on for slots and recaptures wait on for quiet.
        self._num_active = self._num_leases = self._num_recaptures = 0
        self._slots_freed = threading.Condition()
        self.runner = Runner(self.model, cfg, self.kv_pool, sizes, self.tp)
        self.runner.telemetry.auto_islands = list(getattr(self.model, "auto_islands", ()))
        self.runner.telemetry.notes = list(getattr(self.model, "notes", ()))
        t0 = time.perf_counter()
        self.runner.build()
        self.build_ms = (time.perf_counter() - t0) * 1e3
        if cfg.verify and self.runner.handles:
            verify_buckets(self.runner)
            self.runner.agree_buckets("verify")

    @property
    def telemetry(self) -> Telemetry:
        """Per-bucket build records and per-batch replay records."""
        return self.runner.telemetry

    def enable_bucket(self, bucket: int) -> None:
        """Replays ``bucket`` again after replay failures disabled it (see ``max_replay_failures``).

        Raises:
            ValueError: no such bucket, or its capture failed (no graph to replay): :meth:`recapture` it.
        """
        self.runner.enable_bucket(bucket)

    def recapture(self, bucket: int) -> BucketRecord:
        """Captures ``bucket`` anew and replays it from now on; returns its record (``disabled_reason`` says why if
        this capture failed as well). All or nothing: an interrupted capture leaves the bucket disabled, saying so.

        Prefills in flight finish first and new ones wait: on CUDA another thread's host syncs and allocations
        during a capture would invalidate it.

        Example::

            if eng.telemetry.buckets[16].disabled_reason:
                eng.recapture(16)
        """
        with self._slots_freed:
            self._num_recaptures += 1
            while self._num_active:
                self._slots_freed.wait()
        try:
            return self.runner.recapture(bucket)
        finally:
            with self._slots_freed:
                self._num_recaptures -= 1
                self._slots_freed.notify_all()

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Prompt]) -> PrefillResult:
        """Prefills every prompt and returns last-token logits and greedy next tokens.

        Prompts are lists of token ids or 1-D integer tensors (on the CPU or the engine's device), each at most the
        model's context length (``max_position_embeddings``). Prompts longer than ``chunked_prefill_size`` are split
        into chunks; chunks of several prompts are packed per forward, and a prompt's KV slots are reused as soon as
        its last chunk ran. Safe to call from several threads.
        """
        with self._slots_freed:
            while self._num_recaptures:
                self._slots_freed.wait()
            self._num_active += 1
        try:
            return self._prefill(prompts)
        finally:
            with self._slots_freed:
                self._num_active -= 1
                self._slots_freed.notify_all()

    def _prefill(self, prompts: Sequence[Prompt]) -> PrefillResult:
        config = self.model.config
        ids, lengths = validate_prompts(prompts, config.vocab_size, config.max_position_embeddings, self.device)
        if self.runner.agreement is not None:  # tensor parallel: the same prompts on every rank, or nothing runs
            self.runner.agreement.agree_prompts(ids)
        plan = plan_batches(lengths, self.config.chunked_prefill_size)
        lease = SlotLease(self.kv_pool, plan, on_free=self._notify_slots_freed)
        try:  # all or nothing: every exit path, KeyboardInterrupt included, returns the lease
            self._reserve(lease)
            records: list[BatchRecord] = []
            logits = torch.empty(len(ids), config.vocab_size, dtype=torch.float32, device=self.device)
            for index, chunks in enumerate(plan):
                last = [i for i, c in enumerate(chunks) if c.is_last]
                items = [self._item(ids[c.request], lease, c) for c in chunks]
                batch = PrefillBatch(items, self.kv_pool, None if len(last) == len(chunks) else last, check=False)
                with self.runner.lock:  # a replay's logits are a view of the runner's static buffers
                    out = self.runner.forward(batch)
                    records.append(out.record)
                    if last:
                        self._place(logits, [chunks[i].request for i in last], out.logits)
                lease.finish(index)
        finally:
            if lease.release():
                with self._slots_freed:
                    self._num_leases -= 1
                    self._slots_freed.notify_all()
        return PrefillResult(logits, logits.argmax(dim=-1), records)

    @staticmethod
    def _place(logits: torch.Tensor, requests: list[int], rows: torch.Tensor) -> None:
        """Copies the logits of ``requests`` (in order) into their rows of the result."""
        first, last = requests[0], requests[-1]
        if last - first == len(requests) - 1:  # the common case: consecutive requests, one copy
            logits[first : last + 1].copy_(rows)
            return
        for row, request in enumerate(requests):  # a chunked request in between ends later: no index tensor
            logits[request].copy_(rows[row])

    def _reserve(self, lease: SlotLease) -> None:
        """Reserves the lease's peak, waiting while other prefills of this engine hold the slots it needs."""
        pool, need = self.kv_pool, lease.peak
        if need > pool.num_slots:
            raise ValueError(f"the prompts need {need} KV slots at once but the pool holds {pool.num_slots}; raise "
                             "kv_tokens (or kv_memory_fraction on CUDA) or prefill fewer/shorter prompts")
        with self._slots_freed:
            while True:
                try:
                    lease.reserve()
                except KVPoolFullError:
                    if self._num_leases == 0:  # nothing of this engine will free them: held by someone else
                        raise ValueError(f"the prompts need {need} KV slots but the pool has {pool.num_free} of "
                                         f"{pool.num_slots} free (the rest are allocated outside prefill); free "
                                         "them or raise kv_tokens") from None
                    self._slots_freed.wait()
                else:
                    self._num_leases += 1
                    return

    def _notify_slots_freed(self) -> None:
        with self._slots_freed:
            self._slots_freed.notify_all()

    @staticmethod
    def _item(ids: torch.Tensor, lease: SlotLease, chunk: Chunk) -> PrefillItem:
        # ids were validated and slots come from the pool, all CPU int64: no per-item normalisation needed.
        new_slots, prefix_slots = lease.take(chunk)
        if chunk.start == 0 and chunk.is_last:  # a whole prompt: no slicing ops on the host's per-request path
            return PrefillItem.unchecked(ids, new_slots, 0, prefix_slots)
        return PrefillItem.unchecked(ids[chunk.start : chunk.end], new_slots, chunk.start, prefix_slots)


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
