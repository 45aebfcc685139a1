"""Triton kernels compiled for the H200 (sm_90) ahead of time, on a CPU: what the interpreter never checks.

The interpreter runs a kernel's Python as numpy, so a compiled kernel's own rules (globals must be constexpr, types
must unify across loop iterations, a block must fit the registers) only show on the GPU. Triton's wheel brings the
compiler and ptxas, so the CPU tier compiles the kernel for sm_90 and reads ptxas's report: it must compile and must
not spill. Needs ``triton`` importable (the ``test`` extra).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is not installed (pip install -e .[test])"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the interpreter decorates no compiled kernel"),
]


def compile_sm90(kernel, types: dict[str, str], constants: dict[str, int], num_warps: int, num_stages: int = 3,
                 ptx: list[str] | None = None, aligned: tuple[str, ...] = ()) -> str:
    """``kernel`` compiled for sm_90 with ``types`` (argument -> Triton type) and ``constants``; ptxas's report (and
    the PTX appended to ``ptx`` when given). ``aligned`` arguments are known multiples of 16, as Triton's launcher
    specialises pointers and integers that are (without it the loads cannot be vectorised or pipelined)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert sorted([*types, *constants]) == sorted(kernel.arg_names), "every argument typed or constant, once"
    signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    if ptx is not None:
        ptx.append(compiled.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True)
    return report.stdout + report.stderr


def spill_bytes(report: str) -> list[int]:
    """The spill stores of every function in ptxas's report, in bytes."""
    return [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]


def assert_no_spills(report: str) -> None:
    # Whole numbers: "800 bytes spill stores" holds the text "0 bytes spill stores" too.
    spills = spill_bytes(report)
    assert spills and not any(spills), report


@pytest.mark.parametrize("width", [256, 8192])  # the narrowest sort of a 256-pick model and the widest
def test_dsa_topk_kernel_compiles_for_sm90_without_spills(width):
    from bcg.ops.kernels import triton_dsa

    types = {"q_ptr": "*bf16", "q_row_stride": "i32", "w_ptr": "*bf16", "w_row_stride": "i32", "keys_ptr": "*bf16",
             "read_slots_ptr": "*i64", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "scratch_ptr": "*i64",
             "out_ptr": "*i64", "num_tokens": "i32", "num_requests": "i32", "row0": "i32"}
    constants = dict(HEADS=4, HEAD_DIM=64, D_BLOCK=64, Q_HEAD_STRIDE=64, KEY_STRIDE=64, TOPK=256, L_BLOCK=width,
                     BLOCK_K=64, R_BLOCK=64)
    report = compile_sm90(triton_dsa._index_topk_kernel, types, constants, num_warps=triton_dsa.sort_warps(width))
    assert_no_spills(report)


@pytest.mark.parametrize("has_bias", [False, True])
def test_moe_combine_kernel_compiles_for_sm90(has_bias):
    from bcg.ops.kernels import triton_moe

    types = {"y_ptr": "*bf16", "y_stride": "i32", "slot_ptr": "*i64", "w_ptr": "*fp32", "w_stride": "i32",
             "out_ptr": "*bf16", "out_stride": "i32", "n_cols": "i32", "bias_ptr": "*bf16", "bias_stride": "i32",
             "expert_ptr": "*i64"}
    report = compile_sm90(triton_moe._combine_kernel, types, dict(TOP_K=4, BLOCK=1024, HAS_BIAS=has_bias),
                          num_warps=4)
    assert_no_spills(report)


def test_the_pdl_benchmarks_kernel_waits_and_releases_only_where_asked():
    """benchmarks/pdl.py's kernel: with GDC its PTX holds the grid-dependency wait and release PDL needs, without
    it neither (what the H200 run compares)."""
    import importlib.util as iu

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = iu.spec_from_file_location("pdl_bench", Path(__file__).resolve().parents[3] / "benchmarks" / "pdl.py")
    pdl = iu.module_from_spec(spec)
    spec.loader.exec_module(pdl)
    kernel = pdl._add_one_kernel
    for gdc in (True, False):
        signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "GDC": "constexpr"}
        constexprs = {(3,): 1024, (4,): gdc}
        ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == gdc and ("griddepcontrol.launch_dependents" in ptx) == gdc


def _rms_norm_pdl() -> tuple[dict, bool, bool]:
    """(the kernels' launch options, whether rms_norm's sm_90 PTX waits, whether it releases) in this process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bcg.ops.kernels import triton_norm, triton_utils

    types = {"x_ptr": "*bf16", "x_stride": "i32", "res_ptr": "*bf16", "res_stride": "i32", "w_ptr": "*bf16",
             "out_ptr": "*bf16", "out_stride": "i32", "res_out_ptr": "*bf16", "res_out_stride": "i32",
             "n_cols": "i32", "eps": "fp32", "part_stride": "i32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr",
             "NUM_PARTS": "constexpr"}
    ptx = triton.compile(ASTSource(fn=triton_norm._rms_norm_kernel, signature=types,
                                   constexprs={(12,): True, (13,): 1024, (14,): 1}),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return triton_utils.LAUNCH_OPTIONS, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx


# A fresh process (BCG_PDL is read at import) that stands in for an sm_90 machine: only the compile is asked.
_PDL_PROCESS = f"""
import sys, torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *a: (9, 0)
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_kernel_aot import _rms_norm_pdl
print(_rms_norm_pdl())
"""
_WITH_PDL, _WITHOUT_PDL = "({'launch_pdl': True}, True, True)", "({}, False, False)"


@pytest.mark.parametrize(("value", "expected"), [(None, _WITH_PDL), ("1", _WITH_PDL), ("0", _WITHOUT_PDL)])
def test_pdl_puts_the_grid_dependency_into_every_kernel_and_launch_on_sm90(value, expected):
    """On an sm_90 machine bcg's kernels wait for the kernel before them and launch with PDL by default (and with
    BCG_PDL=1); BCG_PDL=0 leaves both out (rms_norm stands for every kernel)."""
    env = {k: v for k, v in os.environ.items() if k != "BCG_PDL"} | ({"BCG_PDL": value} if value else {})
    out = subprocess.run([sys.executable, "-c", _PDL_PROCESS], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]
    assert "BCG_PDL is set" not in out.stderr


def test_no_pdl_where_the_gpu_cannot_run_it():
    """This process: PDL is compiled in and launched exactly where it runs (an sm_90+ GPU, compiled kernels, and
    BCG_PDL not 0); on a CPU-only machine nothing of it is."""
    import torch

    from bcg.ops.kernels import triton_utils

    capable = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert triton_utils.PDL == (capable and not triton_utils.INTERPRETING and os.environ.get("BCG_PDL", "") != "0")
    assert str(_rms_norm_pdl()) == (_WITH_PDL if triton_utils.PDL else _WITHOUT_PDL)


def test_every_bcg_kernel_starts_with_its_grid_dependency():
    import ast

    from bcg.ops import kernels

    root = Path(kernels.__file__).parent
    found = 0
    for path in root.glob("triton_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith(("_kernel", "_fwd")):
                first = node.body[0]
                assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Call) and \
                    getattr(first.value.func, "id", None) == "grid_dependency", (path.name, node.name)
                found += 1
    assert found == 12


@pytest.mark.parametrize("rows,cols,inner", [(16, 1024, 2816), (64, 1024, 2816), (128, 2048, 8192), (1, 64, 64),
                                             (32, 2048, 8192), (300, 1024, 2816)])
def test_down_projection_kernel_compiles_for_sm90_on_the_tensor_cores(rows, cols, inner):
    """The launcher's own tiles on an H200 (132 SMs), for the llama down projections at short prompts: no spills, the
    loads pipelined through cp.async, Hopper's wgmma where a tile has 64 rows or more, and the split-K sum behind an
    acquire-release atomic (the model's operands are 16-aligned: contiguous rows of 16-multiples)."""
    from bcg.ops.kernels import triton_down_proj

    plan = triton_down_proj.tiling(rows, cols, inner, 132)
    split = plan.split_k
    types = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "w_stride": "i32", "out_ptr": "*bf16",
             "out_stride": "i32", "part_ptr": "*fp32", "count_ptr": "*i32", "n_rows": "i32", "n_cols": "i32",
             "inner": "i32"}
    constants = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=split,
                     K_ITERS=plan.k_iters, SWIGLU=True)
    ptx: list[str] = []
    report = compile_sm90(triton_down_proj._swiglu_down_kernel, types, constants, num_warps=plan.num_warps,
                          num_stages=plan.num_stages, ptx=ptx,
                          aligned=("x_ptr", "x_stride", "w_ptr", "w_stride", "out_ptr", "out_stride", "part_ptr",
                                   "count_ptr", "n_cols", "inner"))
    assert_no_spills(report)
    assert "cp.async" in ptx[0] or plan.k_iters == 1, "the loads are not pipelined"
    assert ("wgmma" in ptx[0]) == (plan.block_m >= 64), "tensor-core instruction"
    assert ("atom" in ptx[0] and ".acq_rel" in ptx[0]) == (split > 1)


@pytest.mark.parametrize("norm", [False, True])  # True: the RMSNorm folded in (BCG_NORM_FUSION)
@pytest.mark.parametrize("rows,hidden,inter", [(16, 1024, 2816), (33, 1024, 2816), (64, 2048, 8192), (128, 2048, 8192),
                                               (16, 3072, 8192), (64, 3072, 8192)])
def test_gate_up_kernel_compiles_for_sm90_on_the_tensor_cores(rows, hidden, inter, norm):
    """The launcher's own tiles on an H200 for the llama gate/up projections, with and without the norm folded in:
    no spills, the loads pipelined, wgmma where a tile has 64 rows or more, and the norm's reduction only where
    asked (without it the kernel is the one it was: no rsqrt)."""
    import triton

    from bcg.ops.kernels import triton_gate_up

    plan = triton_gate_up.tiling(rows, inter, 132)
    types = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "w_up_ptr": "*bf16", "w_stride": "i32",
             "out_ptr": "*bf16", "out_stride": "i32", "norm_ptr": "*bf16", "eps": "fp32", "n_rows": "i32",
             "inter": "i32", "hidden": "i32"}
    constants = dict(NORM=norm, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                     K_ITERS=triton.cdiv(hidden, plan.block_k))
    ptx: list[str] = []
    report = compile_sm90(triton_gate_up._gate_up_silu_kernel, types, constants, num_warps=plan.num_warps,
                          num_stages=plan.num_stages, ptx=ptx,
                          aligned=("x_ptr", "x_stride", "w_ptr", "w_up_ptr", "w_stride", "out_ptr", "out_stride",
                                   "norm_ptr", "inter", "hidden"))
    assert_no_spills(report)
    assert "cp.async" in ptx[0], "the loads are not pipelined"
    assert ("wgmma" in ptx[0]) == (plan.block_m >= 64), "tensor-core instruction"
    assert ("rsqrt" in ptx[0]) == norm, "the norm's rstd"


@pytest.mark.parametrize("rows,hidden,heads,kv_heads,dim,norm", [(16, 1024, 16, 4, 64, False),
                                                                 (64, 2048, 32, 8, 64, False),
                                                                 (64, 1024, 16, 8, 128, True),
                                                                 (33, 2048, 16, 4, 128, False)])
def test_qkv_rope_kernel_compiles_for_sm90_on_the_tensor_cores(rows, hidden, heads, kv_heads, dim, norm):
    """The launcher's own tiles on an H200 for the llama and Qwen3 q/k/v projections with RoPE and the KV write in the
    epilogue: no spills, the loads pipelined, wgmma where a tile has 64 rows or more, and the split-K sum behind an
    acquire-release atomic."""
    from bcg.ops.kernels import triton_qkv_rope

    plan = triton_qkv_rope.tiling(rows, hidden, heads + 2 * kv_heads, dim, norm, 132)
    types = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "w_stride": "i32", "bias_ptr": "*fp32",
             "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "eps": "fp32"}
    types |= {f"{t}_{s}": ("*bf16" if s == "ptr" else "i32") for t in ("q", "k", "v")
              for s in ("ptr", "stride0", "stride1")}
    types |= {"slot_ptr": "*i64"} | {f"{t}_{s}": ("*bf16" if s == "ptr" else "i32") for t in ("kc", "vc")
                                     for s in ("ptr", "stride0", "stride1")}
    types |= {"part_ptr": "*fp32", "count_ptr": "*i32", "n_rows": "i32", "hidden": "i32"}
    types |= {"res_ptr": "*bf16", "res_stride": "i32", "res_out_ptr": "*bf16", "res_out_stride": "i32",
              "nw_ptr": "*bf16", "norm_eps": "fp32"}  # the prologue's, unread with NORM off
    constants = dict(HEADS=heads, KV_HEADS=kv_heads, DIM=dim, HALF_N=plan.half_n, HAS_BIAS=False, HAS_NORM=norm,
                     HAS_CACHE=True, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, SPLIT_K=plan.split_k,
                     K_ITERS=plan.k_iters, NORM=False, ADD=False)
    ptx: list[str] = []
    report = compile_sm90(triton_qkv_rope._qkv_rope_kernel, types, constants, num_warps=plan.num_warps,
                          num_stages=plan.num_stages, ptx=ptx,
                          aligned=("x_ptr", "x_stride", "w_ptr", "w_stride", "part_ptr", "count_ptr", "hidden"))
    assert_no_spills(report)
    assert "cp.async" in ptx[0], "the loads are not pipelined"
    assert ("wgmma" in ptx[0]) == (plan.block_m >= 64), "tensor-core instruction"
    assert ("atom" in ptx[0] and ".acq_rel" in ptx[0]) == (plan.split_k > 1)


def test_launches_ask_for_pdl_only_in_forwards_small_enough(monkeypatch):
    """Where PDL is on, a launch inside ``pdl_for`` of more than PDL_MAX_TOKENS rows goes without the attribute (its
    kernel's wait is then a no-op), and every other launch keeps it."""
    from bcg.ops.kernels import triton_utils
    from bcg.ops.kernels.dispatch import PDL_MAX_TOKENS, pdl_for

    monkeypatch.setattr(triton_utils, "LAUNCH_OPTIONS", {"launch_pdl": True})
    launched: list[dict] = []

    class Kernel:  # what Triton's kernel[grid](...) call receives
        def __getitem__(self, grid):
            return lambda *args, **options: launched.append(options)

    def both() -> list[bool]:
        launched.clear()
        triton_utils.launch(Kernel(), (2, 1), 1, BLOCK=16)
        triton_utils.launch_rows(Kernel(), 3, 1, BLOCK=16)
        return [o.get("launch_pdl", False) for o in launched]

    assert both() == [True, True]
    with pdl_for(PDL_MAX_TOKENS):
        assert both() == [True, True]
    with pdl_for(PDL_MAX_TOKENS + 1):
        assert both() == [False, False]
    assert all(o["BLOCK"] == 16 for o in launched)


# How the varlen kernel reads keys (and on which grid): (HAS_KV_SLOTS, HAS_KV_BASE) and the spill stores (bytes)
# ptxas may report at head dim 128 with the default 2048-row blocks (64 x 64, 4 warps: the fastest the H200
# measured, round 13), which spill already reading keys directly; at head dim 64 none may spill.
KEY_READS = {"direct": (False, False, 708), "slots": (True, False, 800), "slots+base": (True, True, 1200),
             "base": (False, True, 708), "direct/flat": (False, False, 1000), "slots+base/flat": (True, True, 1200)}


@pytest.mark.parametrize("reads", list(KEY_READS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_kernel_compiles_for_sm90_in_every_key_mode(head_dim, reads):
    """Every way the kernel reads keys compiles: directly (the islands), through the pool's slots, through them with
    a second loop that reads a request's run of slots by address, chosen per program at run time (the whole-step
    graphs' ``runs``), and by address alone (``runs_only``: the direct mode's one loop from another start, so no
    more spills than it); ``/flat`` on the flat grid (``BCG_VARLEN_GRID=flat``: its block search keeps more values
    live, 956 bytes of spills against 708 at head dim 128)."""
    from bcg.ops.kernels import triton_attention

    has_slots, has_base, max_spill = KEY_READS[reads]
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "CU_Q": "*i32", "CU_K": "*i32",
            "SINKS": "*bf16", "KV_SLOTS": "*i64", "KV_BASE": "*i64", "total_q": "i32"}
    strides = {name: "i32" for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                        "stride_ot", "stride_oh")}
    types = {**ptrs, **strides, "sm_scale": "fp32", "softcap": "fp32", "window_left": "i32"}
    cfg = triton_attention.block_config(head_dim, 2048)
    constants = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, GROUP=4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     HAS_SOFTCAP=False, HAS_WINDOW=False, HAS_SINKS=False, STATIC_BLOCKS_N=0, HAS_KV_SLOTS=has_slots,
                     ZERO_TAIL=has_slots or has_base, SPLIT_MASK=cfg.split_mask, EVEN_D=True, HAS_KV_BASE=has_base,
                     FLAT_SEQS=16 if reads.endswith("/flat") else 0)
    if reads.endswith("/flat"):  # the flat grid's sequence count is an argument; elsewhere a constant None
        types["num_seqs"] = "i32"
    else:
        constants["num_seqs"] = None
    aligned = (*ptrs, "stride_qt", "stride_kt", "stride_vt", "stride_ot")
    report = compile_sm90(triton_attention._varlen_fwd, types, constants, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, aligned=aligned)
    print(reads, head_dim, re.findall(r"Used \d+ registers", report), spill_bytes(report))
    if head_dim == 64:
        assert_no_spills(report)
    else:
        assert max(spill_bytes(report)) <= max_spill, report
