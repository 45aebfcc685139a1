"""Hugging Face transformers decoders run as written, behind bcg's CausalLM interface (``model_impl="transformers"``).

Nothing of the model is converted: :class:`~bcg.models.hf.model.HFCausalLM` switches its attention to bcg's island
through transformers' own attention registry, runs its decoder body as the captured layer stack, and turns what a
graph cannot capture into islands or refuses it by name. transformers is an optional dependency: this package's
``__init__`` imports none of it, so ``import bcg.models.hf`` and :func:`is_transformers_model` work without it, and
:func:`require_transformers` says how to install it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MIN_TRANSFORMERS", "UnsupportedModelError", "is_transformers_model", "require_transformers"]

# Oldest transformers the adapter is tested with (5.17 and 5.24 are); 5.x has the registry and APIs it uses.
MIN_TRANSFORMERS = (5, 17)


class UnsupportedModelError(ValueError):
    """A transformers model does something bcg's transformers path cannot honour; the message names it and the fix."""


def is_transformers_model(obj: Any) -> bool:
    """Whether ``obj`` is a transformers ``PreTrainedModel`` (checked by class, without importing transformers).

    Example:
        >>> import torch
        >>> is_transformers_model(torch.nn.Linear(2, 2))
        False
    """
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(obj).__mro__)


def require_transformers(why: str) -> Any:
    """The ``transformers`` module, or an ImportError saying ``why`` it is needed and how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{why} needs the transformers package, which is not installed: pip install "
                          "'transformers>=5.17' (or pip install -e '.[hf]' in a clone of bcg)") from None

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"{why} needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (the versions it is "
                          f"tested with); found {transformers.__version__}")
    return transformers
