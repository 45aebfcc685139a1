"""The adaptation of a transformers model, step by step: what :class:`~bcg.models.hf.model.HFCausalLM` does to the
model the first time an adapter is built on it (a second adapter shares the result: :mod:`bcg.models.hf.adaptation`).

In order: the attention switched to ``"bcg"`` (checked, since transformers only warns when it cannot), DSA attention
modules made module islands, one probe forward recording what each layer's attention receives (refusing what bcg
cannot honour), the fusion of the modules that match a known pattern, one probe forward for ops a CUDA graph cannot
capture (automatic islands, or a refusal), and each decoder layer routed through ``run_layer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import Tensor, nn

from bcg.models.hf import UnsupportedModelError
from bcg.models.hf.attention import NAME, AttentionCall
from bcg.models.hf.dsa import install_dsa_islands
from bcg.models.hf.fusion import fuse as fuse_modules
from bcg.models.hf.islands import body_refusal, explain, install_auto_islands, restore_islands
from bcg.models.hf.layer_regions import install_layer_regions
from bcg.models.hf.probes import one_request, probe_layers
from bcg.models.hf.support import check_layer_calls
from bcg.probe import ProbeReport, find_uncapturable

__all__ = ["Adaptable", "adapt"]

logger = logging.getLogger("bcg")


class Adaptable(Protocol):
    """What :func:`adapt` reads and writes of the model it adapts (an :class:`~bcg.models.hf.model.HFCausalLM`):
    named here so this module needs nothing of the class that calls it."""

    hf: nn.Module
    body: nn.Module
    state: Any
    config: Any
    _probing: bool

    def embed(self, ids: Tensor) -> Tensor: ...

    def forward_layers(self, hidden: Tensor, positions: Tensor) -> Tensor: ...


def adapt(model: Adaptable, probe_tokens: int, fuse: bool) -> None:
    """Switches ``model``'s attention, installs the islands, probes, fuses and routes the layers, recording what it
    found in ``model.state`` (see the module doc). The caller restores the model if this raises.

    Raises:
        UnsupportedModelError: the attention cannot be switched, or a layer's attention call cannot be honoured.
    """
    hf_model, body, state, cfg = model.hf, model.body, model.state, model.hf.config
    name = type(hf_model).__name__
    restore_islands(body)
    if cfg._attn_implementation != NAME:
        state.previous_attn_implementation = cfg._attn_implementation or "sdpa"
    hf_model.set_attn_implementation(NAME)
    if cfg._attn_implementation != NAME:
        raise UnsupportedModelError(f"{name} cannot switch its attention to {NAME!r} (it does not dispatch "
                                    "through transformers' AttentionInterface)")
    state.dsa_islands = install_dsa_islands(body, state.island_kv_shapes, lambda: model._probing)
    state.layer_calls = _probe_layers(model, probe_tokens)
    check_layer_calls(cfg, name, state.layer_calls, list(state.island_kv_shapes))
    if fuse and state.dsa_islands:
        # A DSA indexer ranks keys: in half precision a rounding the fused kernels do differently anywhere
        # upstream can change which keys it picks, so these models run as written.
        state.fusion.notes = ["not fused: the DSA indexer's top-k could pick other keys after the fused "
                              "kernels' different roundings; every module runs as written"]
    elif fuse:
        calls = {c.layer_idx: c for c in state.layer_calls}
        state.fusion = fuse_modules(body, cfg, calls, set(state.island_kv_shapes),
                                    lambda: _one_request_run(model, probe_tokens))
    state.report = _probe_capturability(model, probe_tokens)
    state.capture_refusal = body_refusal(body, state.report)
    if state.report and state.capture_refusal is None:
        if state.auto_islands_enabled:
            state.auto_islands = install_auto_islands(body, state.report)
            logger.warning("bcg: %s runs %d modules as automatic islands (eager at replay):\n%s", name,
                           len(state.auto_islands), explain(state.report, hf_model))
        else:
            state.capture_refusal = f"{name} cannot be captured as written: {explain(state.report, hf_model)}"
    install_layer_regions(body, model.config.num_layers)


def _probe_layers(model: Adaptable, num_tokens: int) -> list[AttentionCall]:
    model._probing = True  # the DSA islands record what they cache
    try:
        return probe_layers(model, num_tokens)
    finally:
        model._probing = False


@contextmanager
def _one_request_run(model: Adaptable, num_tokens: int) -> Iterator[Callable[[], None]]:
    """:func:`~bcg.models.hf.probes.one_request`, yielding a function that runs the decoder body on it."""
    with one_request(model, num_tokens) as (ids, positions):
        yield lambda: model.forward_layers(model.embed(ids), positions)


def _probe_capturability(model: Adaptable, num_tokens: int) -> ProbeReport:
    with one_request(model, num_tokens) as (ids, positions):
        hidden = model.embed(ids)
        with find_uncapturable(model.body) as report:
            model.forward_layers(hidden, positions)
    return report
