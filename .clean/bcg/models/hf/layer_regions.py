"""The decoder layers of a transformers body, each run through :func:`bcg.models.regions.run_layer`.

transformers' decoder body loops over its layers itself, so bcg cannot call :func:`~bcg.models.regions.run_layer`
from the loop as its native models do. Instead each layer in ``body.layers`` gets an instance ``forward`` (one shared
function, bound per layer) that hands the call to the region runner when one is installed (``compile=``) and
otherwise runs the layer's class ``forward``: one context-variable read per layer call outside a compiled stack.
A call that carries the region flag is the compiled region itself, and runs the class ``forward``, which passes the
flag down through ``**kwargs`` to the attention (``bcg_attention`` or :class:`~.fused_attention.FusedAttention`).
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

from bcg.models.regions import REGION_FLAG, is_regional, run_layer
from bcg.ops.context import LayerIds

__all__ = ["install_layer_regions", "remove_layer_regions"]


def _layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get(REGION_FLAG) or not is_regional():
        return type(self).forward(self, *args, **kwargs)
    return run_layer(self, self.__dict__["bcg_layer_ids"], *args, **kwargs)


def install_layer_regions(body: nn.Module, num_layers: int) -> bool:
    """Routes every layer of ``body.layers`` through the region runner; False if the body has no such list or a
    layer's attention index is not its position (nothing is installed then)."""
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers:
        return False
    ids = []
    for i, layer in enumerate(layers):
        found = {m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        if found != {i} or "forward" in vars(layer):  # an island already, or not indexed by position
            return False
        ids.append(LayerIds(attention=i))
    for layer, layer_ids in zip(layers, ids):
        layer.__dict__["bcg_layer_ids"] = layer_ids
        layer.forward = types.MethodType(_layer_forward, layer)
    return True


def remove_layer_regions(body: nn.Module) -> None:
    """Undoes :func:`install_layer_regions`."""
    for layer in getattr(body, "layers", ()):
        forward = vars(layer).get("forward")
        if getattr(forward, "__func__", None) is _layer_forward:
            del layer.forward
        layer.__dict__.pop("bcg_layer_ids", None)
