"""Prompt validation: what :meth:`Engine.prefill <bcg.runtime.engine.Engine.prefill>` accepts, as CPU int64 tensors,
or a clear error naming the prompt and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["validate_prompts"]

_INT64 = (-(2**63), 2**63 - 1)
_PLAIN_INTS = frozenset({int})


def _what(p: Any) -> str:
    if p is None:
        return "None"
    name = type(p).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _places(device: torch.device) -> str:
    """Where a prompt tensor may live for an engine on ``device``."""
    return "the CPU" if device.type == "cpu" else f"the CPU or on {device}"


def _from_tensor(i: int, p: torch.Tensor, device: torch.device) -> torch.Tensor:
    if p.dtype == torch.long and p.device.type == "cpu" and p.dim() == 1:  # already what we need
        return p
    if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
        raise TypeError(f"prompt {i} is a {p.dtype} tensor; token ids must be an integer tensor (e.g. torch.long)")
    if p.device.type == "meta":
        raise ValueError(f"prompt {i} is a meta-device tensor, which holds no token ids; pass the ids themselves "
                         f"(a list, or a tensor on {_places(device)})")
    if p.device.type != "cpu" and p.device != device:
        raise ValueError(f"prompt {i} is on {p.device}, but the engine runs on {device}; pass it on "
                         f"{_places(device)}")
    if p.dim() != 1:
        raise ValueError(f"prompt {i} has shape {tuple(p.shape)}; a prompt is a 1-D tensor of ids")
    return p.to(device="cpu", dtype=torch.long)


def _from_sequence(i: int, p: Sequence[Any], vocab: int) -> torch.Tensor:
    # Plain ints are the common case, checked by their types alone (in C: a 2048-id prompt in a few dozen µs, where
    # isinstance per element took hundreds); anything else gets the full check. numpy's integer scalars are ids too,
    # as a numpy array of them is (np.bool_ is no np.integer); bool, an int subclass, is not.
    if not _PLAIN_INTS.issuperset(map(type, p)) and not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in p):
        raise TypeError(f"prompt {i} must contain Python ints or numpy integer scalars (token ids)")
    try:  # numpy builds the array several times faster than torch.tensor does from a list
        return torch.from_numpy(np.array(p, dtype=np.int64))
    except (OverflowError, RuntimeError, ValueError):  # an id beyond int64: name it as what it is
        bad = next(x for x in p if not _INT64[0] <= x <= _INT64[1])
        raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab})") from None


def _one(i: int, p: Any, vocab: int, device: torch.device) -> torch.Tensor:
    if type(p) is list or type(p) is tuple:  # the common case first: the checks below cost microseconds each
        return _from_sequence(i, p, vocab)
    if isinstance(p, torch.Tensor):
        return _from_tensor(i, p, device)
    if isinstance(p, np.ndarray):
        if p.dtype.kind not in "iu":
            raise TypeError(f"prompt {i} is a numpy array of {p.dtype}; token ids must be integers")
        if p.dtype == np.uint64 and p.size and int(p.max()) > _INT64[1]:  # astype would wrap it to a negative id
            raise ValueError(f"prompt {i} has token id {int(p.max())} outside the vocabulary [0, {vocab})")
        return _from_tensor(i, torch.from_numpy(p.astype(np.int64, copy=False)), device)
    if isinstance(p, (str, bytes)):
        raise TypeError(f"prompt {i} is text ({_what(p)}); tokenize it first: a prompt is a list of token ids")
    if isinstance(p, (set, frozenset)):
        raise TypeError(f"prompt {i} is a set, which has no order; pass a list of token ids in prompt order")
    if isinstance(p, int) and not isinstance(p, bool):
        raise TypeError(f"prompt {i} is an int; a prompt is a list of token ids (for one token, pass [[{p}]])")
    if not isinstance(p, Sequence):
        raise TypeError(f"prompt {i} is {_what(p)}; pass a list or tuple of token ids or a 1-D integer tensor "
                        "(an iterator would be consumed by the checks)")
    return _from_sequence(i, p, vocab)


def validate_prompts(prompts: Any, vocab_size: int, max_length: int, device: torch.device
                     ) -> tuple[list[torch.Tensor], list[int]]:
    """CPU int64 tensors of ``prompts`` and their lengths, or a TypeError/ValueError naming the bad prompt.

    A prompt is a list, tuple or range of Python ints, a 1-D integer tensor (CPU or ``device``) or a 1-D integer
    numpy array, with every id in ``[0, vocab_size)`` and at most ``max_length`` (the model's context length) ids.

    Example::

        >>> ids, lengths = validate_prompts([[1, 2], (3,)], vocab_size=8, max_length=16, device=torch.device("cpu"))
        >>> lengths, ids[1].tolist()
        ([2, 1], [3])
    """
    if type(prompts) is not list and (isinstance(prompts, (torch.Tensor, str)) or not isinstance(prompts, Sequence)):
        raise TypeError("prefill() takes a list of prompts (lists of token ids or 1-D integer tensors), "
                        f"got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prefill() needs at least one prompt; got an empty list")
    out, lengths = [], []
    for i, p in enumerate(prompts):
        t = _one(i, p, vocab_size, device)
        n = t.shape[0]
        if n == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if 0 < max_length < n:  # 0: the model states no context length
            raise ValueError(f"prompt {i} has {n} tokens, more than the model's context length "
                             f"(max_position_embeddings={max_length}); shorten it")
        out.append(t)
        lengths.append(n)
    # One range check for the whole batch (numpy: cheaper per call); find the culprit only on error.
    every = out[0].numpy() if len(out) == 1 else np.concatenate([t.numpy() for t in out])
    # Read as unsigned, a negative id is above every vocabulary: one reduction finds both kinds of bad id.
    if every.view(np.uint64).max() >= vocab_size:
        i = next(i for i, t in enumerate(out) if t.min() < 0 or t.max() >= vocab_size)
        bad = int(out[i].min()) if out[i].min() < 0 else int(out[i].max())
        if bad < 0 and not isinstance(prompts[i], (torch.Tensor, np.ndarray)):  # a numpy uint64 beyond int64 wraps
            bad = next((int(x) for x in prompts[i] if isinstance(x, np.uint64) and int(x) > _INT64[1]), bad)
        raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
    return out, lengths
