"""FlashAttention's variable-length forward, called as cheaply as this torch version allows.

An attention island runs at every replay of every layer, so its host cost is paid ~24 times per forward on a
launch-bound GPU. ``torch.nn.attention.varlen.varlen_attn`` is a ``torch.library.custom_op``: each call goes
through the Python custom-op dispatcher and launches an extra kernel (a zeroed RNG-state tensor) around the one
flash kernel. The aten op underneath, ``aten._flash_attention_forward``, computes the same thing without that
wrapper. :func:`flash_varlen` uses the aten op where a once-per-device probe shows it agrees with ``varlen_attn``,
and ``varlen_attn`` otherwise, or when ``BCG_FLASH=wrapper`` in the environment at import (or
``FORCE_WRAPPER = True``) asks for it.

With ``out=`` the result is written in place wherever the torch build can: through
``aten._flash_attention_forward_no_dropout_inplace`` on the direct path, ``varlen_attn_out`` on the wrapper's
(torch 2.13 has both). A build with neither (torch 2.11) returns a new tensor that is copied into ``out``: one
device-to-device copy per call, which :func:`copy_reason` names.

FlashAttention-2 treats ``max_seqlen_q == 1`` with GQA as "every sequence has exactly one query" and reshapes q
accordingly, which fails (or would misplace rows) when a sequence is empty, e.g. the padded rows' sequence of a batch
that fills its bucket. ``max_seqlen_q`` is only an upper bound, so :func:`flash_varlen` passes 2 instead of 1 there.

On a CPU (graphs are emulated there) both functions run :func:`~bcg.ops.flash_reference.reference_flash_varlen`,
the kernel's contract in plain torch, so the callers' host logic runs in CI exactly as it calls the kernel.

Two behaviours differ between torch versions and are detected, never assumed: how ``varlen_attn`` spells causal
(``window_size=(-1, 0)`` or ``is_causal``) and GQA (``enable_gqa`` or fewer K/V heads as they are), and whether
the causal mask is aligned bottom-right when keys outnumber queries (:func:`varlen_causal_is_bottom_right`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import Tensor

from bcg import env
from bcg.errors import first_line
from bcg.ops.flash_reference import reference_flash_varlen

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without the varlen API
    varlen_attn = None
try:
    from torch.nn.attention.varlen import varlen_attn_out
except ImportError:  # torch without the in-place varlen API (2.11)
    varlen_attn_out = None

__all__ = ["copy_reason", "flash_varlen", "flash_varlen_lse", "is_varlen_usable", "runs_flash_varlen",
           "uses_aten_flash", "varlen_attn", "varlen_attn_out", "varlen_causal_is_bottom_right"]

logger = logging.getLogger(__name__)

_VARLEN_PARAMS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
_FLASH = getattr(torch.ops.aten, "_flash_attention_forward", None)
_FLASH_INPLACE = getattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace", None)
# Keyword arguments of the aten op in this torch build (scale and the window sizes are keyword-only in 2.5+).
_FLASH_KWARGS = frozenset(a.name for a in _FLASH.default._schema.arguments if a.kwarg_only) if _FLASH else frozenset()
_FLASH_INPLACE_KWARGS = (frozenset(a.name for a in _FLASH_INPLACE.default._schema.arguments if a.kwarg_only)
                         if _FLASH_INPLACE else frozenset())
_HALF = (torch.float16, torch.bfloat16)
# Device types whose tensors run the reference instead of the kernel (the CPU, where graphs are emulated).
REFERENCE_DEVICE_TYPES = frozenset({"cpu"})


def is_varlen_usable(q: Tensor) -> bool:
    """Whether the FlashAttention kernel can run on ``q`` (CUDA, fp16/bf16, torch with varlen_attn)."""
    return varlen_attn is not None and q.is_cuda and q.dtype in _HALF


def runs_flash_varlen(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`flash_varlen` runs for ``device``/``dtype``: the kernel where it is usable, the reference on
    a CPU (in fp16/bf16 too: the reference refuses what the kernel refuses).

    Example:
        >>> cpu = torch.device("cpu")
        >>> runs_flash_varlen(cpu, torch.bfloat16), runs_flash_varlen(cpu, torch.float32)
        (True, False)
    """
    if device.type in REFERENCE_DEVICE_TYPES:
        return dtype in _HALF
    return is_varlen_usable(torch.empty(0, device=device, dtype=dtype))


def _kernel_max_seqlen_q(max_seqlen_q: int, q: Tensor, k: Tensor) -> int:
    """``max_seqlen_q``, or 2 where FlashAttention-2 would take its one-query-per-sequence GQA path (max 1, more
    query than K/V heads): that path reshapes q to ``(num_seqs, kv_heads, groups, head_dim)`` and fails on an empty
    sequence. The bound is an upper bound, so 2 computes the same rows through the general path."""
    return 2 if max_seqlen_q == 1 and q.shape[1] > k.shape[1] else max_seqlen_q


def flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, *, is_causal: bool, out: Tensor | None = None,
) -> Tensor:
    """Variable-length FlashAttention forward over packed ``(tokens, heads, head_dim)`` tensors.

    Args:
        q: ``(total_q, num_heads, head_dim)``; k, v: ``(total_k, num_kv_heads, head_dim)`` (GQA when fewer heads).
        cu_seqlens_q, cu_seqlens_k: int32 ``(num_seqs + 1,)`` on the device.
        max_seqlen_q, max_seqlen_k: host ints, upper bounds of the sequence lengths.
        is_causal: causal mask per sequence (bottom-right aligned where the kernel is, see
            :func:`varlen_causal_is_bottom_right`).
        out: optional contiguous ``q``-shaped buffer to write the result into (returned).

    Example::

        o = flash_varlen(q, k, v, cu_q, cu_k, 64, 64, is_causal=True)      # CUDA, bf16
    """
    max_seqlen_q = _kernel_max_seqlen_q(max_seqlen_q, q, k)
    if q.device.type in REFERENCE_DEVICE_TYPES:
        return reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      is_causal=is_causal, out=out)[0]
    if varlen_attn is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available in this torch build")
    if uses_aten_flash(q.device):
        if out is not None and _FLASH_INPLACE is not None:
            _FLASH_INPLACE(out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal,
                           False)
            return out
        result = _FLASH(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal, False)[0]
    elif out is not None and varlen_attn_out is not None:
        return _wrapper(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, out)
    else:
        result = _wrapper(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal)
    if out is None:
        return result
    out.copy_(result)  # no in-place route in this torch build: copy_reason() says so, logged once per device
    return out


def copy_reason(device: torch.device) -> str | None:
    """Why :func:`flash_varlen` with ``out=`` copies its result into ``out`` on ``device`` (one device-to-device
    copy per call), or None where it writes ``out`` in place. Settles :func:`uses_aten_flash` (call it eagerly).

    Example::

        copy_reason(torch.device("cuda"))   # None on torch 2.13; on 2.11: "torch 2.11... has neither ..."
    """
    if device.type in REFERENCE_DEVICE_TYPES:
        return None
    if varlen_attn is None:
        return "this torch build has no FlashAttention varlen at all"
    direct = uses_aten_flash(device)
    if (_FLASH_INPLACE if direct else varlen_attn_out) is not None:
        return None
    missing = [name for name, op in (("aten._flash_attention_forward_no_dropout_inplace", _FLASH_INPLACE),
                                     ("torch.nn.attention.varlen.varlen_attn_out", varlen_attn_out)) if op is None]
    route = "the direct aten op" if direct else "varlen_attn (the direct aten op is not usable: see the log)"
    return (f"torch {torch.__version__} has no {' and no '.join(missing)}, so FlashAttention varlen ({route}) "
            "returns a new tensor that is copied into the output buffer: one device-to-device copy per call")


def flash_varlen_lse(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, out: Tensor, *, scale: float | None = None, window_left: int | None = None,
) -> Tensor | None:
    """Causal varlen FlashAttention written into ``out`` (contiguous, like ``q``), with an optional scale and left
    window; returns the log-sum-exp, fp32 ``(total_q, num_heads)`` (natural log of each row's softmax denominator).

    ``window_left`` ``w`` lets query ``i`` see keys ``i - w .. i`` (bottom-right aligned, as the kernel's causal mask
    is where :func:`varlen_causal_is_bottom_right`). Returns None, writing nothing, when this torch build's aten op
    lacks an argument asked for or returns the log-sum-exp in a layout not known here (the caller takes another
    path).

    Example::

        lse = flash_varlen_lse(q, k, v, cu_q, cu_k, 64, 64, out, window_left=127)     # CUDA, bf16
    """
    max_seqlen_q = _kernel_max_seqlen_q(max_seqlen_q, q, k)
    if q.device.type in REFERENCE_DEVICE_TYPES:
        window = {} if window_left is None else {"window_size_left": window_left, "window_size_right": 0}
        _, lse = reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        is_causal=True, scale=scale, out=out, **window)
        return lse.t()
    needed = {"window_size_left", "window_size_right"} if window_left is not None else set()
    if scale is not None:
        needed.add("scale")
    if _FLASH is None or not needed <= _FLASH_KWARGS:
        return None
    kwargs: dict[str, object] = {}
    if scale is not None:
        kwargs["scale"] = scale
    if window_left is not None:
        kwargs.update(window_size_left=window_left, window_size_right=0)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, True, False)
    if _FLASH_INPLACE is not None and needed <= _FLASH_INPLACE_KWARGS:
        lse = _FLASH_INPLACE(out, *args, **kwargs)
        copy_out = None
    else:
        copy_out, lse = _FLASH(*args, **kwargs)[:2]
    num_heads, total_q = q.shape[1], q.shape[0]
    if lse.dim() == 2 and tuple(lse.shape) == (num_heads, total_q):
        lse = lse.t()
    elif lse.dim() == 3 and lse.shape[1] == num_heads:  # padded per sequence: (num_seqs, heads, max_seqlen_q)
        lens = cu_seqlens_q.diff().long()
        starts = torch.repeat_interleave(cu_seqlens_q[:-1].long(), lens, output_size=total_q)
        seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=q.device), lens, output_size=total_q)
        rows = seq * lse.shape[2] + torch.arange(total_q, device=q.device) - starts
        lse = lse.transpose(1, 2).reshape(-1, num_heads)[rows]
    else:
        return None
    if copy_out is not None:
        out.copy_(copy_out)
    return lse


def _wrapper(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, is_causal: bool,
    out: Tensor | None = None,
) -> Tensor:
    """``varlen_attn`` (``varlen_attn_out`` into ``out`` when given) with the causal and GQA keywords this torch
    version spells."""
    kwargs: dict[str, object] = {}
    if is_causal:
        kwargs.update({"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True})
    if "enable_gqa" in _VARLEN_PARAMS and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if out is not None:
        return varlen_attn_out(out, q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def uses_aten_flash(device: torch.device) -> bool:
    """Whether :func:`flash_varlen` calls the aten flash op directly on ``device`` (else ``varlen_attn``).

    Decided once per device by :func:`_probe_aten_flash`; never probed inside a stream capture (the capture
    then uses ``varlen_attn``, which is always correct).
    """
    ok = _ATEN_FLASH_OK.get(device)
    if ok is not None:
        return ok and not FORCE_WRAPPER
    if _FLASH is None or FORCE_WRAPPER:
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    _ATEN_FLASH_OK[device] = ok = _probe_aten_flash(device)
    return ok


_ATEN_FLASH_OK: dict[torch.device, bool] = {}
# BCG_FLASH=wrapper (bcg.env); tests and tools may flip it.
FORCE_WRAPPER = env.FLASH_WRAPPER


def _probe_aten_flash(device: torch.device) -> bool:
    """Runs a small causal GQA batch with a cached prefix through the aten op and through ``varlen_attn``."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(5, 4, 64, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(9, 2, 64, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cu_q = torch.tensor([0, 2, 5], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], device=device, dtype=torch.int32)
    try:
        expected = _wrapper(q, k, v, cu_q, cu_k, 3, 5, True).float()
        got = [_FLASH(q, k, v, cu_q, cu_k, 3, 5, 0.0, True, False)[0].float()]
        if _FLASH_INPLACE is not None:
            out = torch.full_like(q, float("nan"))
            _FLASH_INPLACE(out, q, k, v, cu_q, cu_k, 3, 5, 0.0, True, False)
            got.append(out.float())
        ok = all(torch.allclose(g, expected, atol=1e-2, rtol=0) for g in got)
        reason = "" if ok else "its output differs from varlen_attn"
    except (RuntimeError, TypeError) as e:
        ok, reason = False, first_line(e)
    if ok:
        logger.info("bcg: calling aten._flash_attention_forward%s directly on %s (skips varlen_attn's custom-op "
                    "wrapper)", " (in-place)" if _FLASH_INPLACE is not None else "", device)
    else:
        logger.warning("bcg: using varlen_attn on %s; the direct aten flash call is not usable: %s", device, reason)
    return ok


@functools.cache
def varlen_causal_is_bottom_right(device: torch.device) -> bool:
    """Whether the causal mask of :func:`flash_varlen` is bottom-right aligned when keys outnumber queries.

    One query and two keys with equal scores: bottom-right alignment lets the query see both (output = mean of
    the values = 0.5), top-left only the first (output = 0). Runs once per device, eagerly; it also settles
    :func:`uses_aten_flash`, so call it before any capture that attends.
    """
    head_dim = 64
    q = torch.zeros(1, 1, head_dim, device=device, dtype=torch.bfloat16)
    keys = torch.zeros(2, 1, head_dim, device=device, dtype=torch.bfloat16)
    values = torch.stack([torch.zeros(1, head_dim), torch.ones(1, head_dim)]).to(device, torch.bfloat16)
    cu_q = torch.tensor([0, 1], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 2], device=device, dtype=torch.int32)
    out = flash_varlen(q, keys, values, cu_q, cu_k, 1, 2, is_causal=True)
    is_bottom_right = bool(out.float().mean() > 0.25)
    logger.info("varlen causal mask is %s-aligned on %s", "bottom-right" if is_bottom_right else "top-left", device)
    return is_bottom_right
