"""What bcg changed in one transformers model, shared by every adapter built on it while the change lasts.

Engines built on one model object run the same modules (the same islands, the same fused stand-ins, the same
attention implementation), so a second :class:`~bcg.models.hf.model.HFCausalLM` on a model another one adapted
reuses what the first found (:meth:`Adaptation.of`) instead of changing the model under the first one's graphs; one
asking for other settings is refused when it is built, unless no adapter of the model is alive any more (the model is
then given back and adapted anew). :meth:`Adaptation.restore` gives the model back, after which
every engine on it refuses to prefill (``restored``): its modules are transformers' again.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from bcg.models.hf import UnsupportedModelError
from bcg.models.hf.fusion import Fusion
from bcg.models.hf.islands import restore_islands
from bcg.models.hf.layer_regions import remove_layer_regions

__all__ = ["Adaptation"]

_ATTR = "_bcg_adaptation"  # the model's attribute holding its Adaptation while bcg has it


class Adaptation:
    """The adapters' shared state: settings, what the probes found, the fusion, the kernels, and whether the model
    was given back."""

    def __init__(self, auto_islands: bool, fuse: bool) -> None:
        self.auto_islands_enabled, self.fuse_enabled = auto_islands, fuse
        self.previous_attn_implementation = "sdpa"
        self.layer_calls: list[Any] = []  # AttentionCall per layer
        self.island_kv_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.dsa_islands: list[str] = []
        self.auto_islands: list[str] = []
        self.report: Any = None  # the capturability probe's ProbeReport
        self.capture_refusal: str | None = None
        self.fusion = Fusion()
        self.kernels: str | None = None
        self.restored = False
        self.adapters: weakref.WeakSet = weakref.WeakSet()  # the HFCausalLMs running the model through this

    @staticmethod
    def of(model: nn.Module, body: nn.Module, auto_islands: bool, fuse: bool) -> Adaptation | None:
        """The live adaptation of ``model``, if another adapter made one with these settings; None if there is none
        (an adaptation no adapter uses any more is given back first).

        Raises:
            UnsupportedModelError: a live one was made with other settings.
        """
        shared = model.__dict__.get(_ATTR)
        if shared is None:
            return None
        if not shared.adapters:  # every engine that used it is gone: start clean
            shared.restore(model, body)
            return None
        if (shared.auto_islands_enabled, shared.fuse_enabled) != (auto_islands, fuse):
            raise UnsupportedModelError(
                f"{type(model).__name__} already serves another engine with auto_islands="
                f"{shared.auto_islands_enabled}, fuse={shared.fuse_enabled}; a second engine on the same model object "
                "must use the same settings, or run a copy of the model (copy.deepcopy(model))")
        return shared

    def attach(self, model: nn.Module, adapter: nn.Module) -> None:
        """Marks ``model`` as adapted by this (later adapters share it) and ``adapter`` as one running it."""
        model.__dict__[_ATTR] = self
        self.adapters.add(adapter)

    def restore(self, model: nn.Module, body: nn.Module) -> None:
        """Gives ``model`` back: its own modules and weights, no islands, its previous attention (idempotent)."""
        if self.restored:
            return
        self.fusion.restore()
        remove_layer_regions(body)
        restore_islands(body)
        model.set_attn_implementation(self.previous_attn_implementation)
        self.restored = True
        if model.__dict__.get(_ATTR) is self:
            del model.__dict__[_ATTR]
