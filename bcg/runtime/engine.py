"""The prefill engine: validate prompts, reserve KV slots, plan chunks, run them through the runner, sample greedily.
An engine can be called from several threads: its runner serialises the forwards (from loading the static buffers to
the LM head) and each prefill reserves its KV slots from a thread-safe pool. ``prefill`` and ``submit`` plan with the
one planner (:class:`~bcg.runtime.serving.batcher.Batcher`): ``prefill`` inline on the caller's thread over its
reservation, ``submit`` one prompt at a time through a scheduler thread with a prefix cache
(:mod:`bcg.runtime.serving`)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from bcg.ops.parallel import init_tensor_parallel
from bcg.runtime.config import EngineConfig
from bcg.runtime.kv_slots import SlotReservation, default_kv_tokens, make_kv_pool
from bcg.runtime.model_source import load_model
from bcg.runtime.options import engine_config, signature_with_options
from bcg.runtime.prefill import PrefillResult, run_prefill
from bcg.runtime.prompts import validate_prompts
from bcg.runtime.runner import Runner
from bcg.runtime.runner.agreement import RankAgreement
from bcg.runtime.runner.buckets import BucketRecord
from bcg.runtime.runner.build import freeze_heap
from bcg.runtime.runner.telemetry import Telemetry
from bcg.runtime.runner.verify import verify_buckets
from bcg.runtime.serving import ActivityGate, EngineClosedError, PrefixCache, RequestResult, Server
from bcg.runtime.serving.batcher import Batcher
from bcg.runtime.serving.callbacks import served_result
from bcg.runtime.serving.policy import FifoQueue

__all__ = ["Engine", "PrefillResult"]

Prompt = Sequence[int] | torch.Tensor


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

    A server submits one prompt at a time from any thread (:meth:`submit`, :meth:`asubmit`): a scheduler thread packs
    waiting requests into forwards under ``chunked_prefill_size`` tokens, reusing cached prefixes
    (``prefix_cache``), and :meth:`close` (or leaving ``with Engine(...) as eng:``) shuts it down.
    """

    def __init__(self, model: Any = "tiny-dense", config: EngineConfig | None = None, **kwargs: Any) -> None:
        requested = engine_config(config, kwargs)
        if requested.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={requested.device!r} needs CUDA, which is not available here; use "
                             "device='cpu' (graphs are emulated there)")
        self.tp = init_tensor_parallel(requested.tp_size, requested.torch_device, requested.tp_timeout_s)
        t0 = time.perf_counter()
        model, loaded = load_model(model, requested, self.tp)
        # Resolved once, here: every choice left to bcg (kernels, attention, buckets) reads from engine.config.
        self.config = cfg = loaded.resolved()
        self.model = model.eval()
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.device, self.dtype = cfg.torch_device, cfg.torch_dtype
        self.model.set_kernels(cfg.kernels)
        sizes = cfg.buckets
        # The pool must hold one largest-bucket dummy batch during capture; a prefill holds at most its peak. Its
        # bytes per token are read off the model's own pool layout, built on the meta device (no memory).
        per_token = self.model.make_kv_pool(1, "meta", self.dtype).bytes_per_token
        kv_tokens = max(cfg.kv_tokens, max(sizes)) if cfg.kv_tokens else default_kv_tokens(
            per_token, self.model.config.max_position_embeddings, cfg.chunked_prefill_size, max(sizes), self.device,
            cfg.kv_memory_fraction)
        if self.tp.is_parallel:  # every rank allocates the same slots, so every pool has the size of the smallest
            kv_tokens = RankAgreement(self.tp).agree_min(kv_tokens, "the KV pool size")
        self.kv_pool = make_kv_pool(self.model, kv_tokens, per_token, self.device, self.dtype)
        # Forwards in flight, holders of KV slots and recaptures: what prefills, the server and recaptures wait on.
        self._gate = ActivityGate()
        self.runner = Runner(self.model, cfg, self.kv_pool, sizes, self.tp)
        self.runner.telemetry.auto_islands = list(getattr(self.model, "auto_islands", ()))
        self.runner.telemetry.notes[:0] = getattr(self.model, "notes", ())  # before the runner's (attention's)
        t0 = time.perf_counter()
        self.runner.build()
        if hasattr(self.model, "warm_islands"):  # islands that compile kernels per key range (DSA's top-k)
            # Key ranges reach the pool's size or the context, whichever is shorter (prefix hits included).
            self.runner.telemetry.notes += self.model.warm_islands(
                min(kv_tokens, self.model.config.max_position_embeddings))
        self.build_ms = (time.perf_counter() - t0) * 1e3
        if cfg.verify and self.runner.handles:
            verify_buckets(self.runner)
            self.runner.agree_buckets("verify")
        if cfg.verify and self.runner.full is not None and self.runner.full.handles:
            verify_buckets(self.runner.full)  # the whole-step graphs of the small buckets (full_graph_tokens)
        # Every allocation of the engine's own goes through the prefix cache, which evicts unlocked entries for a
        # shortfall first (the pool knows nothing of the cache).
        self.prefix_cache = PrefixCache(self.kv_pool) if cfg.uses_prefix_cache else None
        self._alloc = self.prefix_cache.alloc if self.prefix_cache is not None else self.kv_pool.alloc
        self._server: Server | None = None  # started by the first submit
        self._froze_heap = False  # the first submit froze the heap; close() thaws it
        self._server_lock = threading.Lock()
        self._closed = False

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
        with self._gate.quiet():
            if self.prefix_cache is not None:  # capture runs a dummy batch of `bucket` slots: make room for it
                short = bucket - self.kv_pool.num_free
                if short > 0:
                    self.prefix_cache.evict(short)
            self._gate.hold()  # the dummy batch's slots come back: a prefill short of them waits, not fails
            try:
                return self.runner.recapture(bucket)
            finally:
                self._gate.release()

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Prompt]) -> PrefillResult:
        """Prefills every prompt and returns last-token logits and greedy next tokens.

        Prompts are lists of token ids or 1-D integer tensors (on the CPU or the engine's device), each at most the
        model's context length (``max_position_embeddings``). Prompts longer than ``chunked_prefill_size`` are split
        into chunks; chunks of several prompts are packed per forward, and a prompt's KV slots are reused as soon as
        its last chunk ran. Safe to call from several threads. Computes every prompt in full (the prefix cache
        serves :meth:`submit`).
        """
        self._check_open()
        config = self.model.config
        ids, lengths = validate_prompts(prompts, config.vocab_size, config.max_position_embeddings, self.device)
        if self.runner.agreement is not None:  # tensor parallel: the same prompts on every rank, or nothing runs
            self.runner.agreement.agree_prompts(ids)
        budget = self.config.chunked_prefill_size
        reservation = SlotReservation(self.kv_pool, lengths, budget, on_free=self._gate.notify, alloc=self._alloc)
        try:  # all or nothing: every exit path, KeyboardInterrupt included, returns the reservation
            # Slots first, then the forwards: a prefill waiting for slots is no forward in flight, so a recapture
            # never waits for it (the slots' holder may itself wait for that recapture).
            self._gate.reserve(reservation.reserve, reservation.peak, self.kv_pool)
            with self._gate.active():
                return run_prefill(self.runner, ids, Batcher(self.kv_pool, None, budget, FifoQueue(), reservation))
        finally:
            if reservation.release():
                self._gate.release()

    # ---------------------------------------------------------------- serving
    def submit(self, prompt: Prompt) -> Future[RequestResult]:
        """Queues one prompt for the scheduler thread and returns the future of its :class:`RequestResult`
        (``logits`` ``(1, vocab)``, ``next_tokens`` ``(1,)``, its ``batches``, ``cached_tokens``, ``queue_ms``,
        ``ttft_ms``); safe from any thread, never blocks. A bad prompt raises here, like :meth:`prefill`'s; a forward
        that fails fails the futures of its own requests; :meth:`close` fails those not finished with
        :class:`EngineClosedError`. A pending future can be cancelled. Its done-callbacks run on the engine's callback
        thread (never the scheduler's or the completer's), so a callback may call anything of the engine, ``close``
        and ``recapture`` included. Not under tensor parallel.

        Example::

            with Engine("tiny-dense", device="cpu") as eng:
                eng.submit([1, 2, 3, 4]).result().cached_tokens     # 0
                eng.submit([1, 2, 3, 5]).result().cached_tokens     # 3: its first three tokens' KV was cached
        """
        if self.tp.is_parallel:
            raise ValueError("submit() serves one process; under tensor parallel every rank must run the same "
                             "batches: call prefill() on every rank with the same prompts")
        self._check_open()
        config = self.model.config
        ids, lengths = validate_prompts([prompt], config.vocab_size, config.max_position_embeddings, self.device)
        if lengths[0] > self.kv_pool.num_slots:  # could never be admitted: refuse now, not from the scheduler
            raise ValueError(f"the prompt needs {lengths[0]} KV slots but the pool holds {self.kv_pool.num_slots}; "
                             "raise kv_tokens (or kv_memory_fraction on CUDA) or shorten it")
        if not isinstance(prompt, (list, tuple, range)):  # the caller's tensor or array may change after we return
            ids[0] = ids[0].clone()
        with self._server_lock:  # close() takes it too: no server is started after close() looked for one
            self._check_open()
            if self._server is None:
                self._server = self._make_server()
                weakref.finalize(self, self._server.close)  # an engine dropped without close() stops its threads
                # While it serves, a full collection would walk the model and the engine: a 100+ ms stall for every
                # thread. They leave the collector's sight until close() (process-wide, as the collector is).
                self._froze_heap = freeze_heap() > 0
        return self._server.submit(ids[0])

    def _make_server(self) -> Server:
        cfg, runner = self.config, self.runner  # the runner's forward looked up per call, never the engine
        return Server(forward=lambda batch: runner.forward(batch), lock=runner.lock, pool=self.kv_pool,
                      cache=self.prefix_cache, gate=self._gate, budget=cfg.chunked_prefill_size,
                      policy=cfg.schedule_policy, max_inflight=cfg.max_inflight_batches, device=self.device)

    async def asubmit(self, prompt: Prompt) -> RequestResult:
        """:meth:`submit` for asyncio: ``res = await eng.asubmit(prompt)``; cancelling the task cancels a request
        that has not started."""
        return await served_result(self.submit(prompt))

    def close(self) -> None:
        """Stops the scheduler (launched forwards complete; every request not finished fails with
        :class:`EngineClosedError`) and frees the prefix cache's slots; afterwards :meth:`prefill` and :meth:`submit`
        raise EngineClosedError. Idempotent."""
        with self._server_lock:
            self._closed = True
            server = self._server
        if server is not None:
            server.close()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self._froze_heap:
            self._froze_heap = False
            gc.unfreeze()  # what the engine held (and what it made cyclic) can be collected again

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        server = self._server
        if server is not None and server.failure is not None:  # the scheduler stopped: the whole engine did
            raise EngineClosedError(f"{server.failure}; build a new one")
        if self._closed:
            raise EngineClosedError("the engine is closed; build a new one")


Engine.__init__.__signature__ = signature_with_options(Engine.__init__)  # type: ignore[attr-defined]
