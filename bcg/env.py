"""The debug switches: every ``BCG_*`` environment variable bcg reads is read here and nowhere else.

Configuration is :class:`~bcg.runtime.config.EngineConfig` and the command's flags; these are for debugging only.

* ``BCG_DEBUG=1``: at each replay, check that every captured input of a segment or piece is where it was captured.
* ``BCG_FLASH=wrapper``: the attention islands call ``varlen_attn`` instead of the aten flash op it wraps.
* ``BCG_TP_ALLREDUCE=island``: every tensor parallel all-reduce runs as an eager island, outside the segments.
* ``BCG_LEAK_CHECK=off|warn|raise``: the leak check of captures that do not choose one (read at each capture).
* ``BCG_HF_FUSION=off``: transformers models run every module as written (no load-time fusion; read at each load).
* ``BCG_COMPILE_LOG=1``: torch.compile's own log of bcg's compiles reaches the terminal (by default a failed trace is
  reported in one line by bcg, and dynamo's log of the attempt is kept quiet).
* ``BCG_PDL=0``: bcg's Triton kernels launch without programmatic dependent launch. By default they use it where it
  runs (compiled kernels on sm_90+): each waits for the kernel before it with ``griddepcontrol`` and may be launched
  while that one finishes. The H200 measured it at 0.84x the wall of a 64-token llama-dense prefill, 1-10% off the
  other models' 16- and 64-token prefills, and 2-4% onto three of four models' at 256 tokens
  (``benchmarks/device_bound.py``; ``benchmarks/pdl.py`` shows CUDA graphs keep it), so the runner launches only
  forwards of up to 64 tokens with it (:func:`bcg.ops.kernels.dispatch.pdl_for`).
  ``BCG_PDL=1`` asks for it explicitly and warns where the GPU cannot run it.
* ``BCG_MLP_FUSION=gate_up|down|none``: which one-kernel fusion a SwiGLU MLP's activation rides at short prompts with
  the fused kernels: ``gate_up`` (the default: :mod:`bcg.ops.kernels.gate_up`, in the gate/up projection's epilogue),
  ``down`` (:mod:`bcg.ops.kernels.down_proj`, in the down projection's prologue; measured 1.4-2.8x slower on the
  H200) or ``none`` (SiLU-and-multiply as a kernel of its own); ``benchmarks/mlp_kernels.py`` measures them.
* ``BCG_DOWN_PARTIALS=off``: a dense model's down projection at up to 256 rows is one ``F.linear`` (cuBLAS's split-K
  GEMM and its reduce kernel). By default, with the fused kernels, it is one batched GEMM that leaves four fp32 split-K
  partials to the next layer's add + RMSNorm kernel, which sums them (:mod:`bcg.ops.kernels.down_partials`): on the
  H200 the GEMM took 0.55-0.78x of the two launches at 16-256 rows (``benchmarks/down_partials.py``).
* ``BCG_QKV_FUSION=off``: the attention's q/k/v projection and bcg's RoPE kernel stay two launches at every row count.
  By default, with the fused kernels, up to 16 rows they are one kernel (:mod:`bcg.ops.kernels.qkv_rope`: RoPE, the
  split and the K/V write in the projection's epilogue), which the H200 measured at 0.95x of llama-dense's device
  time at 16 tokens and even on the Llama-3.2-1B shape; at 64 rows it ran 1.00-1.09x, so it stops at 16.
  ``benchmarks/qkv_kernels.py`` and ``benchmarks/device_bound.py`` measure both.
* ``BCG_NORM_FUSION=on``: with the fused kernels, a dense decoder layer's post-attention add + RMSNorm is no kernel of
  its own: the residual add rides the o projection (cuBLAS ``addmm`` with beta=1) and the norm folds into the gate/up
  projection's kernel (:mod:`bcg.ops.kernels.gate_up`: the row's ``rstd`` applied in the epilogue), one launch fewer a
  layer. Only where that is the same arithmetic up to rounding: one rank, an o projection without bias,
  ``BCG_MLP_FUSION=gate_up`` and no compiled regions (:func:`bcg.models.dense.folds_post_attention_norm`). Off: on
  the H200 the gate/up kernel with the norm ran 2.2x as long and the forward's device time rose 19% at 64 tokens
  (DESIGN.md says why).
* ``BCG_INPUT_NORM_FUSION=on`` (with ``BCG_NORM_FUSION=on``): the layer's input add + RMSNorm rides the q/k/v
  projection's kernel too (:func:`bcg.ops.kernels.qkv_proj_rope`'s prologue, up to 16 rows), another launch fewer a
  layer there. Off: measured slower on the H200 too (0.93 -> 1.04 ms device time at 16 tokens on llama-dense).
* ``BCG_TRITON_VARLEN_FROM=<tokens>``: the varlen island runs bcg's Triton kernel from buckets of this many tokens
  at every attention width, FlashAttention below (by default from 2048 tokens, 1024 for attention 2048 wide:
  :func:`bcg.ops.attention.varlen.triton_from_tokens`); for measuring where the kernel's cheaper device time
  outweighs its dearer launch (``benchmarks/device_bound.py`` under each value).
* ``BCG_KV_READS=slots|runs|runs_only``: how the whole-step graphs' attention (``static_triton``) reads a request's
  keys from the KV pool, in every bucket. Unset: by bucket (:data:`bcg.ops.attention.static_triton.RUNS_TOKENS`),
  ``runs`` up to 512 tokens and ``runs_only`` above. ``runs``: each request whose slots run up by one (a fresh pool
  hands out runs) by address, as the islands' kernel reads packed keys, the others through their slots, chosen per
  program by the kernel (two key loops in one kernel); on the H200 its device time was 0.90-1.00x ``slots``' at
  256-2048 tokens on three models (round 15). ``slots``: every key through its slot (rounds 13-14). ``runs_only``:
  one key loop, by address only; a batch with a request whose slots do not run up by one replays the islanded graph
  instead (reason ``slots_not_in_runs``), and so does a bucket whose capture (or recapture, once the pool is
  fragmented) found no run of free slots for its dummy batch: its whole-step capture fails with that reason, logged.
* ``BCG_VARLEN_GRID=flat``: bcg's varlen attention kernel launches one program per row block a sequence has (found
  from the cumulative lengths in the kernel) instead of the longest sequence's blocks for every sequence, whose
  programs past a short or empty sequence return at once. Off (``per_seq``) until measured: on the H200 the whole-step
  graphs' four request slots (three empty) took 1.3-1.5x the kernel's time at 256-1024 tokens at head dim 64
  (round 15, ``benchmarks/attention_reads.py``).
* ``BCG_GC_FREEZE=0``: a serving engine leaves the heap to the garbage collector as it is (by default its first
  ``submit`` moves every object alive then out of the collector's sight, ``gc.freeze()``, until it closes).

``BCG_PDL``, ``BCG_MLP_FUSION``, ``BCG_DOWN_PARTIALS``, ``BCG_QKV_FUSION``, the two norm fusions,
``BCG_TRITON_VARLEN_FROM``, ``BCG_KV_READS`` and ``BCG_VARLEN_GRID`` are read once, at import: they are asked on hot
paths, where an environment lookup per call costs.
"""

from __future__ import annotations

import os

__all__ = ["COMPILE_LOG", "DEBUG", "DOWN_PARTIALS", "FLASH_WRAPPER", "INPUT_NORM_FUSION", "KV_READS", "MLP_FUSION",
           "NORM_FUSION", "PDL", "QKV_FUSION", "TP_ALLREDUCE_ISLAND", "TRITON_VARLEN_FROM", "VARLEN_GRID", "gc_freeze",
           "hf_fusion", "leak_check_mode"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


DEBUG: bool = _flag("BCG_DEBUG")
FLASH_WRAPPER: bool = os.environ.get("BCG_FLASH", "").lower() == "wrapper"
TP_ALLREDUCE_ISLAND: bool = os.environ.get("BCG_TP_ALLREDUCE", "").lower() == "island"
COMPILE_LOG: bool = _flag("BCG_COMPILE_LOG")
MLP_FUSION: str = os.environ.get("BCG_MLP_FUSION", "").lower() or "gate_up"
if MLP_FUSION not in ("gate_up", "down", "none"):
    raise ValueError(f"BCG_MLP_FUSION={MLP_FUSION!r}: expected gate_up, down or none (unset: gate_up)")


def _switch(name: str, default: bool) -> bool:
    """An on/off switch (on, off, 1, 0; ``default`` when unset); any other value stops the import, naming it."""
    value = os.environ.get(name, "").lower()
    if value not in ("", "off", "0", "on", "1"):
        raise ValueError(f"{name}={value!r}: expected on or off (unset: {'on' if default else 'off'})")
    return default if not value else value in ("on", "1")


# None when unset: on where the GPU runs it (bcg.ops.kernels.triton_utils decides), without a word where it does not.
PDL: bool | None = _switch("BCG_PDL", True) if os.environ.get("BCG_PDL") else None
QKV_FUSION: bool = _switch("BCG_QKV_FUSION", True)
DOWN_PARTIALS: bool = _switch("BCG_DOWN_PARTIALS", True)
NORM_FUSION: bool = _switch("BCG_NORM_FUSION", False)
INPUT_NORM_FUSION: bool = _switch("BCG_INPUT_NORM_FUSION", False)


def _tokens(name: str) -> int | None:
    """A positive token count (None when unset); anything else stops the import, naming it."""
    value = os.environ.get(name, "")
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive number of tokens (unset: bcg's thresholds)")
    return int(value)


TRITON_VARLEN_FROM: int | None = _tokens("BCG_TRITON_VARLEN_FROM")
VARLEN_GRID: str = os.environ.get("BCG_VARLEN_GRID", "").lower() or "per_seq"
if VARLEN_GRID not in ("per_seq", "flat"):
    raise ValueError(f"BCG_VARLEN_GRID={VARLEN_GRID!r}: expected per_seq or flat (unset: per_seq)")
KV_READS: str | None = os.environ.get("BCG_KV_READS", "").lower() or None
if KV_READS not in (None, "slots", "runs", "runs_only"):
    raise ValueError(f"BCG_KV_READS={KV_READS!r}: expected slots, runs or runs_only (unset: by bucket)")


def leak_check_mode() -> str:
    """``BCG_LEAK_CHECK``, or ``"off"`` when unset (validated by the caller, which names the variable).

    Example:
        >>> leak_check_mode() in ("off", "warn", "raise") or True
        True
    """
    return os.environ.get("BCG_LEAK_CHECK", "") or "off"


def hf_fusion() -> bool:
    """Whether transformers models are fused at load: ``BCG_HF_FUSION`` unset, or anything but ``off``/``0``.

    Example:
        >>> isinstance(hf_fusion(), bool)
        True
    """
    return os.environ.get("BCG_HF_FUSION", "").lower() not in ("off", "0")


def gc_freeze() -> bool:
    """Whether a serving engine freezes the heap (``BCG_GC_FREEZE``, on unless ``0``).

    Example:
        >>> isinstance(gc_freeze(), bool)
        True
    """
    return os.environ.get("BCG_GC_FREEZE", "1") != "0"
