"""The names ``model_impl`` takes (vLLM's flag of the same name) and their check, without torch: ``bcg --help``
lists them; what each one does is :mod:`bcg.models.model_impl`'s.

Example:
    >>> MODEL_IMPLS
    ('auto', 'native', 'transformers')
    >>> check_model_impl("native")
    'native'
"""

from __future__ import annotations

__all__ = ["MODEL_IMPLS", "check_model_impl"]

MODEL_IMPLS = ("auto", "native", "transformers")


def check_model_impl(model_impl: str) -> str:
    """Returns ``model_impl`` or raises ValueError naming the choices.

    Example:
        >>> check_model_impl("onnx")
        Traceback (most recent call last):
        ...
        ValueError: model_impl must be one of auto, native, transformers, got 'onnx'
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    return model_impl
