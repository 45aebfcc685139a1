"""bcg's CausalLM interface (embed / forward_layers / compute_logits) over a transformers ``*ForCausalLM``, as written.

Nothing of the model is converted: its modules and weights run as its authors wrote them. :class:`HFCausalLM`

* switches the model's attention to ``"bcg"`` (:mod:`bcg.models.hf.attention`) through transformers'
  ``set_attn_implementation`` and checks that the switch took (transformers only warns when it cannot);
* makes DSA attention modules module islands (:mod:`bcg.models.hf.dsa`);
* probes one short forward to learn, per layer, what the attention function receives (K/V shapes for the pool,
  window, soft-cap, sinks), refusing what it cannot honour before anything is captured;
* fuses, at load, the modules that match a known pattern (q/k/v and gate/up GEMMs, RMSNorm, RoPE, residual adds on
  bcg's kernels, each checked against the original: :mod:`bcg.models.hf.fusion`);
* probes one forward for ops a CUDA graph cannot capture (:mod:`bcg.probe`) and runs the offending modules as
  automatic islands (:mod:`bcg.models.hf.islands`), or, with ``auto_islands=False``, refuses graph capture naming
  module, op and fix;
* routes each decoder layer through :func:`bcg.models.regions.run_layer`, so ``compile=`` compiles one layer per
  structure (:mod:`bcg.models.hf.layer_regions`);
* checks its two ends against the model's own forward on the same tokens (:meth:`HFCausalLM.check_tail`).

The steps before the last run once per model, in :func:`bcg.models.hf.adapt.adapt`.

The decoder body runs as the captured layer stack: ``body(inputs_embeds=(1, T_pad, hidden), position_ids=(1, T_pad),
use_cache=False)`` applies the final norm itself, so ``compute_logits`` is the LM head plus known tails.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bcg import env
from bcg.capture_rules import UncapturableOpError
from bcg.islands import is_capturing
from bcg.models.hf import UnsupportedModelError, require_transformers
from bcg.models.hf.adapt import adapt
from bcg.models.hf.adaptation import Adaptation
from bcg.models.hf.attention import AttentionCall, register
from bcg.models.hf.load import check_devices
from bcg.models.hf.probes import one_request
from bcg.models.hf.support import LogitTail, check_config
from bcg.ops.kv_cache import KVPool

__all__ = ["HFCausalLM", "HFModelConfig"]

_RESTORED = ("the {} this engine serves was given back with restore() (by this engine or another on the same model): "
             "its attention and modules are transformers' again, so this engine cannot prefill with it. Build a new "
             "Engine(model) to serve it again")


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
    num_heads: int = 0  # the attention's q heads and their width (0 where the config does not say)
    head_dim: int = 0


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind bcg's CausalLM interface (see the module doc).

    Args:
        hf_model: the model, in eval mode or not (it is put in eval mode), on one device, in the dtype it will run.
        auto_islands: run modules a CUDA graph cannot capture as islands; False refuses graph capture instead.
        probe_tokens: tokens of the construction-time probe forwards.
        fuse: fuse what matches a known pattern at load (:mod:`bcg.models.hf.fusion`); False runs every module as
            written; None (default) fuses unless the debug switch ``BCG_HF_FUSION=off`` is set.

    Raises:
        UnsupportedModelError: the model does something bcg cannot honour (the message names it and the fix), or
            another engine adapted it with another ``auto_islands`` / ``fuse`` setting.

    The model is changed in place (its attention implementation, instance ``forward`` overrides for islands and
    for its layers' compiled regions, fused stand-ins for the modules that matched); :meth:`restore` undoes all of
    it. A second adapter on the same model shares the first one's changes (:class:`Adaptation`).

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        model = HFCausalLM(hf)
        pool = model.make_kv_pool(4096, "cuda", torch.bfloat16)
        with forward_context(batch.to_context(16)):
            hidden = model.forward_layers(model.embed(batch.input_ids), batch.positions)
    """

    def __init__(self, hf_model: nn.Module, *, auto_islands: bool = True, probe_tokens: int = 16,
                 fuse: bool | None = None) -> None:
        super().__init__()
        fuse = env.hf_fusion() if fuse is None else fuse
        require_transformers("bcg's transformers path")
        register()
        cfg = hf_model.config
        name = type(hf_model).__name__
        check_config(cfg)
        check_devices(hf_model)
        self.hf = hf_model.eval().requires_grad_(False)
        body = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else getattr(hf_model, "model", None)
        embed, head = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
        if body is None or body is hf_model or embed is None or head is None:
            raise UnsupportedModelError(f"{name} is not a *ForCausalLM with a decoder body, an input embedding and an "
                                        "LM head; load it with AutoModelForCausalLM")
        self._parts = {"body": body, "embed": embed, "head": head}  # not registered twice: they live in self.hf
        self.device, self.dtype = embed.weight.device, embed.weight.dtype
        vocab = head.weight.shape[0]
        if embed.weight.shape[0] != vocab:
            raise UnsupportedModelError(f"{name}: the input embedding has {embed.weight.shape[0]} rows but the LM head "
                                        f"{vocab} outputs; bcg needs one vocabulary")
        heads = getattr(cfg, "num_attention_heads", 0) or 0
        head_dim = getattr(cfg, "head_dim", 0) or (cfg.hidden_size // heads if heads else 0)
        self._config = HFModelConfig(f"transformers:{cfg.model_type}", cfg.model_type, vocab, cfg.hidden_size,
                                     cfg.num_hidden_layers, getattr(cfg, "max_position_embeddings", 0) or 0, heads,
                                     head_dim)
        self.tail = LogitTail.from_config(cfg)
        self._probing = False  # set by the layer probe: the DSA islands record what they cache
        shared = Adaptation.of(hf_model, body, auto_islands, fuse)
        if shared is not None:
            self.state = shared  # the model is adapted: this engine runs the same modules
            shared.attach(hf_model, self)
        else:
            self.state = Adaptation(auto_islands, fuse)
            try:
                adapt(self, probe_tokens, fuse)
            except BaseException:  # refused half way: the model is given back as it was, not half adapted
                self.state.restore(hf_model, body)
                raise
            self.state.attach(hf_model, self)
        self.notes: list[str] = list(self.state.fusion.notes)  # how this model runs, for telemetry
        self.check_tail(min(probe_tokens, 8))

    # What the adaptation found, read through the shared state.
    @property
    def layer_calls(self) -> list[AttentionCall]:
        return self.state.layer_calls

    @property
    def dsa_islands(self) -> list[str]:
        return self.state.dsa_islands

    @property
    def auto_islands(self) -> list[str]:
        return self.state.auto_islands

    @property
    def capture_refusal(self) -> str | None:
        return self.state.capture_refusal

    @property
    def previous_attn_implementation(self) -> str:
        return self.state.previous_attn_implementation

    @property
    def config(self) -> HFModelConfig:
        """What the runtime reads of the model (vocabulary, width, depth, context length).

        Raises:
            RuntimeError: the model was given back (:meth:`restore`). The engine reads this at every prefill, graph
                replays included, so a restored engine refuses to prefill rather than run modules that are not
                bcg's any more.
        """
        state = self.__dict__.get("state")  # None while the adapter is being built
        if state is not None and state.restored:
            raise RuntimeError(_RESTORED.format(type(self.hf).__name__))
        return self._config

    @property
    def is_restored(self) -> bool:
        """Whether the model was given back (:meth:`restore`, by this engine or another on the same model)."""
        return self.state.restored

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

    # ------------------------------------------------------------------ probes (bcg.models.hf.probes)
    def _one_request(self, num_tokens: int) -> AbstractContextManager[tuple[Tensor, Tensor]]:
        return one_request(self, num_tokens)

    def check_tail(self, num_tokens: int = 8) -> float:
        """Compares ``compute_logits(forward_layers(embed(ids)))`` with the model's own ``*ForCausalLM`` forward on
        the same ids (same attention, so only the two ends can differ); returns the relative difference.

        Raises:
            UnsupportedModelError: the model does something before its decoder body or after it (a logit scale,
                soft-capping, an input scale) that the adapter does not reproduce.
        """
        with one_request(self, num_tokens) as (ids, positions):
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
        """Token ids ``(T,)`` -> ``(T, hidden)`` through the model's own input embedding (eager).

        Raises:
            RuntimeError: the model was given back (:meth:`restore`): its modules no longer run bcg's attention, so
                an engine on it would compute something else; build a new engine.
        """
        if self.state.restored:
            raise RuntimeError(_RESTORED.format(type(self.hf).__name__))
        return self.embed_tokens(input_ids)

    def forward_layers(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """The decoder body on ``(T_pad, hidden)`` packed rows at ``positions``, final norm included (captured)."""
        if self.capture_refusal is not None and not torch.compiler.is_compiling() and is_capturing():
            raise UncapturableOpError(self.capture_refusal)
        out = self.body(inputs_embeds=hidden[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_last: Tensor, out: Tensor | None = None) -> Tensor:
        """LM head and known tails on ``(R, hidden)`` final-normed rows -> fp32 ``(R, vocab)``, written into ``out``
        when given (the cast is the copy: one kernel, no device-to-device memcpy in a graph)."""
        logits = self.tail.apply(self.lm_head(hidden_last))
        return logits.float() if out is None else out.copy_(logits)

    def make_kv_pool(self, num_slots: int, device: torch.device | str, dtype: torch.dtype) -> KVPool:
        """A pool of ``num_slots`` tokens whose layers hold what this model's attention caches (probed shapes, in
        the keys' dtype: ``dtype`` is the engine's and is used only when the probe saw no keys)."""
        shapes = [{"k": (c.key[1], c.key[3]), "v": (c.value[1], c.value[3])} for c in self.layer_calls]
        by_layer = {c.layer_idx: s for c, s in zip(self.layer_calls, shapes)}
        by_layer.update(self.state.island_kv_shapes)
        layers = [by_layer[i] for i in range(self.config.num_layers)]
        kv_dtype = self.layer_calls[0].dtype if self.layer_calls else dtype
        return KVPool.for_layers(layers, num_slots, device, kv_dtype)

    def set_kernels(self, impl: str) -> None:
        """Runs the fused stand-ins' non-matmul ops with ``impl``: ``"fused"`` (bcg's kernels: Triton on CUDA, their
        references elsewhere) or ``"torch"`` (the references); the modules left as written run as written.

        Raises:
            ValueError: ``impl`` is neither, or another engine on the same model runs the other one.
        """
        if impl not in ("fused", "torch"):
            raise ValueError(f"kernels must be 'fused' or 'torch', got {impl!r}")
        others = [a for a in self.state.adapters if a is not self]
        if self.state.kernels not in (None, impl) and others:
            raise ValueError(
                f"another engine on this {type(self.hf).__name__} runs its fused modules with "
                f"kernels={self.state.kernels!r}; engines sharing a model object share its modules, so use the same "
                "kernels, or run a copy of the model (copy.deepcopy(model))")
        self.state.kernels = impl
        self.state.fusion.set_kernels(impl)

    def restore(self) -> None:
        """Gives the model back as it was: its previous attention implementation, its own modules and weights (each
        parameter in its own storage again), no islands. Every engine on the model refuses to prefill from now on
        (build a new one to serve it again). Idempotent."""
        self.state.restore(self.hf, self.body)

