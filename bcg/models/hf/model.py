"""bcg's CausalLM interface (embed / forward_layers / compute_logits) over a transformers ``*ForCausalLM``, as written.

Nothing of the model is converted: its modules and weights run as its authors wrote them. :class:`HFCausalLM`

* switches the model's attention to ``"bcg"`` (:mod:`bcg.models.hf.attention`) through transformers'
  ``set_attn_implementation`` and checks that the switch took (transformers only warns when it cannot);
* makes DSA attention modules module islands (:mod:`bcg.models.hf.dsa`);
* probes one short forward to learn, per layer, what the attention function receives (K/V shapes for the pool,
  window, soft-cap, sinks), refusing what it cannot honour before anything is captured;
* probes one forward for ops a CUDA graph cannot capture (:mod:`bcg.probe`) and runs the offending modules as
  automatic islands (:mod:`bcg.models.hf.islands`), or, with ``auto_islands=False``, refuses graph capture naming
  module, op and fix;
* checks its two ends against the model's own forward on the same tokens (:meth:`HFCausalLM.check_tail`).

The decoder body runs as the captured layer stack: ``body(inputs_embeds=(1, T_pad, hidden), position_ids=(1, T_pad),
use_cache=False)`` applies the final norm itself, so ``compute_logits`` is the LM head plus known tails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bcg.capture_rules import UncapturableOpError
from bcg.islands import is_capturing
from bcg.models.hf import UnsupportedModelError, require_transformers
from bcg.models.hf.attention import NAME, AttentionCall, recording_calls, register
from bcg.models.hf.dsa import install_dsa_islands
from bcg.models.hf.islands import body_refusal, explain, install_auto_islands, restore_islands
from bcg.models.hf.support import LogitTail, check_config, check_layer_calls
from bcg.ops.attention import single_request_context
from bcg.ops.context import forward_context
from bcg.ops.kv_cache import KVPool
from bcg.probe import ProbeReport, find_uncapturable

__all__ = ["HFCausalLM", "HFModelConfig"]

logger = logging.getLogger("bcg")


@dataclass(frozen=True)
class HFModelConfig:
    """What bcg's runtime reads from a model's config, under the native :class:`~bcg.models.config.ModelConfig`'s
    names (``arch`` is ``"transformers:<model_type>"``)."""

    arch: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind bcg's CausalLM interface (see the module doc).

    Args:
        hf_model: the model, in eval mode or not (it is put in eval mode), on one device, in the dtype it will run.
        auto_islands: run modules a CUDA graph cannot capture as islands; False refuses graph capture instead.
        probe_tokens: tokens of the construction-time probe forwards.

    Raises:
        UnsupportedModelError: the model does something bcg cannot honour (the message names it and the fix).

    The model is changed in place (its attention implementation, and instance ``forward`` overrides for islands);
    :meth:`restore` undoes both.

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        model = HFCausalLM(hf)
        pool = model.make_kv_pool(4096, "cuda", torch.bfloat16)
        with forward_context(batch.to_context(16)):
            hidden = model.forward_layers(model.embed(batch.input_ids), batch.positions)
    """

    def __init__(self, hf_model: nn.Module, *, auto_islands: bool = True, probe_tokens: int = 16) -> None:
        super().__init__()
        require_transformers("bcg's transformers path")
        register()
        cfg = hf_model.config
        name = type(hf_model).__name__
        check_config(cfg)
        devices = {p.device for p in hf_model.parameters()} | {b.device for b in hf_model.buffers()}
        if len(devices) != 1 or next(iter(devices)).type == "meta":
            raise UnsupportedModelError(f"{name} has parameters on {sorted(map(str, devices))}; bcg runs a model on "
                                        "one device: load it without device_map, then .to(device)")
        self.hf = hf_model.eval().requires_grad_(False)
        body = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else getattr(hf_model, "model", None)
        embed, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
        if body is None or body is hf_model or embed is None or head is None:
            raise UnsupportedModelError(f"{name} is not a *ForCausalLM with a decoder body, an input embedding and an "
                                        "LM head; load it with AutoModelForCausalLM")
        self._parts = {"body": body, "embed": embed, "head": head}  # not registered twice: they live in self.hf
        # A model adapted before (another engine) starts clean: no islands, and the attention it had originally.
        restore_islands(body)
        if cfg._attn_implementation != NAME:
            hf_model.bcg_previous_attn_implementation = cfg._attn_implementation
        self.previous_attn_implementation = getattr(hf_model, "bcg_previous_attn_implementation", "sdpa")
        hf_model.set_attn_implementation(NAME)
        if cfg._attn_implementation != NAME:
            raise UnsupportedModelError(f"{name} cannot switch its attention to {NAME!r} (it does not dispatch "
                                        "through transformers' AttentionInterface)")
        self.device, self.dtype = embed.weight.device, embed.weight.dtype
        vocab = head.weight.shape[0]
        if embed.weight.shape[0] != vocab:
            raise UnsupportedModelError(f"{name}: the input embedding has {embed.weight.shape[0]} rows but the LM head "
                                        f"{vocab} outputs; bcg needs one vocabulary")
        self.config = HFModelConfig(f"transformers:{cfg.model_type}", cfg.model_type, vocab, cfg.hidden_size,
                                    cfg.num_hidden_layers, getattr(cfg, "max_position_embeddings", 0) or 0)
        self.tail = LogitTail.from_config(cfg)
        self.notes: list[str] = []  # how this model runs differently from a native one, for telemetry
        self.capture_refusal: str | None = None  # why graph capture is refused (set by the capturability probe)
        self._probing = False
        self.island_kv_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.dsa_islands = install_dsa_islands(body, self.island_kv_shapes, lambda: self._probing)
        self.layer_calls = self._probe_layers(probe_tokens)
        check_layer_calls(cfg, name, self.layer_calls, list(self.island_kv_shapes))
        self.report = self._probe_capturability(probe_tokens)
        self.auto_islands: list[str] = []
        self.capture_refusal = body_refusal(body, self.report)
        if self.report and self.capture_refusal is None:
            if auto_islands:
                self.auto_islands = install_auto_islands(body, self.report)
                logger.warning("bcg: %s runs %d modules as automatic islands (eager at replay):\n%s", name,
                               len(self.auto_islands), explain(self.report, hf_model))
            else:
                self.capture_refusal = f"{name} cannot be captured as written: {explain(self.report, hf_model)}"
        self.check_tail(min(probe_tokens, 8))

    @property
    def body(self) -> nn.Module:
        """The decoder body (``model.get_decoder()``)."""
        return self._parts["body"]

    @property
    def embed_tokens(self) -> nn.Module:
        return self._parts["embed"]

    @property
    def lm_head(self) -> nn.Module:
        return self._parts["head"]

    # ------------------------------------------------------------------ probes
    def _probe_layers(self, num_tokens: int) -> list[AttentionCall]:
        """One forward that records every attention call (computing nothing) and the DSA islands' cache shapes."""
        self._probing = True
        try:
            with torch.inference_mode(), recording_calls() as calls:
                ids = torch.arange(num_tokens, device=self.device) % self.config.vocab_size
                self.forward_layers(self.embed(ids), torch.arange(num_tokens, device=self.device))
        finally:
            self._probing = False
        name = type(self.hf).__name__
        seen = sorted(c.layer_idx for c in calls)  # DSA module islands run the model's module, which calls it too
        if seen != list(range(self.config.num_layers)):
            raise UnsupportedModelError(
                f"{name}: the attention function ran for layers {seen}, expected one call for each of the "
                f"{self.config.num_layers} layers; some attention modules bypass transformers' AttentionInterface")
        dtypes = {c.dtype for c in calls}
        if len(dtypes) > 1:
            raise UnsupportedModelError(f"{name}: its layers' keys come in several dtypes {sorted(map(str, dtypes))}")
        return sorted(calls, key=lambda c: c.layer_idx)

    @contextmanager
    def _one_request(self, num_tokens: int) -> Iterator[tuple[Tensor, Tensor]]:
        """A forward context of one request of ``num_tokens`` over a small pool of its own; yields (ids, positions)."""
        pool = self.make_kv_pool(num_tokens, self.device, self.dtype)
        ctx = single_request_context(num_tokens, pool, self.dtype)
        ids = torch.randint(0, self.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode(), forward_context(ctx):
            yield ids.to(self.device), torch.arange(num_tokens, device=self.device)

    def _probe_capturability(self, num_tokens: int) -> ProbeReport:
        with self._one_request(num_tokens) as (ids, positions):
            hidden = self.embed(ids)
            with find_uncapturable(self.body) as report:
                self.forward_layers(hidden, positions)
        return report

    def check_tail(self, num_tokens: int = 8) -> float:
        """Compares ``compute_logits(forward_layers(embed(ids)))`` with the model's own ``*ForCausalLM`` forward on
        the same ids (same attention, so only the two ends can differ); returns the relative difference.

        Raises:
            UnsupportedModelError: the model does something before its decoder body or after it (a logit scale,
                soft-capping, an input scale) that the adapter does not reproduce.
        """
        with self._one_request(num_tokens) as (ids, positions):
            ours = self.compute_logits(self.forward_layers(self.embed(ids), positions))
            theirs = self.hf(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0].float()
        rel = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item()
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        if not rel <= tol:
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: bcg's embedding + LM head differ from the model's own forward by {rel:.3g} "
                "(relative): the model does something before its decoder body or after it (a logit scale, "
                "soft-capping, an input scale) that bcg's transformers path does not reproduce")
        return rel

    # ------------------------------------------------------------------ the CausalLM interface
    def embed(self, input_ids: Tensor) -> Tensor:
        """Token ids ``(T,)`` -> ``(T, hidden)`` through the model's own input embedding (eager)."""
        return self.embed_tokens(input_ids)

    def forward_layers(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """The decoder body on ``(T_pad, hidden)`` packed rows at ``positions``, final norm included (captured)."""
        if self.capture_refusal is not None and not torch.compiler.is_compiling() and is_capturing():
            raise UncapturableOpError(self.capture_refusal)
        out = self.body(inputs_embeds=hidden[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_last: Tensor) -> Tensor:
        """LM head and known tails on ``(R, hidden)`` final-normed rows -> fp32 ``(R, vocab)``."""
        return self.tail.apply(self.lm_head(hidden_last)).float()

    def make_kv_pool(self, num_slots: int, device: torch.device | str, dtype: torch.dtype) -> KVPool:
        """A pool of ``num_slots`` tokens whose layers hold what this model's attention caches (probed shapes, in
        the keys' dtype: ``dtype`` is the engine's and is used only when the probe saw no keys)."""
        shapes = [{"k": (c.key[1], c.key[3]), "v": (c.value[1], c.value[3])} for c in self.layer_calls]
        by_layer = {c.layer_idx: s for c, s in zip(self.layer_calls, shapes)}
        by_layer.update(self.island_kv_shapes)
        layers = [by_layer[i] for i in range(self.config.num_layers)]
        kv_dtype = self.layer_calls[0].dtype if self.layer_calls else dtype
        return KVPool.for_layers(layers, num_slots, device, kv_dtype)

    def set_kernels(self, impl: str) -> None:
        """The fused kernels are the native models': a transformers model's modules run as written whatever
        ``impl`` is, and ``"fused"`` says so (log and :attr:`notes`) rather than do nothing silently."""
        if impl not in ("fused", "torch"):
            raise ValueError(f"kernels must be 'fused' or 'torch', got {impl!r}")
        if impl == "fused":
            note = ("kernels='fused' has no effect on a transformers model: its modules run as written (the fused "
                    "kernels are the native models')")
            if note not in self.notes:
                self.notes.append(note)
            logger.warning("bcg: %s", note)

    def restore(self) -> None:
        """Gives the model back as it was: its previous attention implementation, no islands."""
        restore_islands(self.body)
        self.hf.set_attn_implementation(self.previous_attn_implementation)
