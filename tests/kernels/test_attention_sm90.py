"""The sm_90 / sm_80 compile gate (minite/gpu_compile.py), checked on a machine with no GPU.

`make test` records every launch of a minite kernel while the suite runs under the interpreter and compiles each
distinct one for sm_90 and sm_80 at the end (float scalars typed fp32 as an eager launch passes them, and fp64 as
Inductor does). This file checks the gate itself and the GPU's own tiles, which the interpreter tests never
launch (they pick small tiles on the CPU):
- it fails on a planted fp64 float scalar (the H100 crash of 2026-11-25: Inductor typed attention's qk_scale fp64
  and the loop-carried m_i became fp64), on a float that leaks into fp32 math, and on shared memory over a
  block's limit (fp32 attention's old 128x64 tile at D = 128 on an A100);
- minite's attention, decode, LoRA, FP8 GEMM and row kernels at the tiles the launchers pick on a GPU, at the
  benchmarks' shapes, compile for sm_90 (no spills) and sm_80, with their floats typed fp32 and fp64.
A subprocess, because the kernels must be decorated with the interpreter off.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLANTED = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        # the attention bug in small: a running max seeded fp32 and updated with `x * scale`
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, n, BLOCK):
            x = tl.load(X + i + offs, mask=i + offs < n, other=0.0)
            m = tl.maximum(m, x * scale)
        tl.store(O + offs, m)

    @triton.jit
    def _leak_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        # no loop: compiles, but multiplies in fp64 (slow on every GPU, and not what the fp32 kernel means)
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(O + offs, x * scale, mask=offs < n)

    @triton.jit
    def _fixed_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        scale = tl.cast(scale, tl.float32)  # the fix minite's kernels use
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, n, BLOCK):
            x = tl.load(X + i + offs, mask=i + offs < n, other=0.0)
            m = tl.maximum(m, x * scale)
        tl.store(O + offs, m)
''')

SCRIPT = textwrap.dedent('''
    import json, sys
    import minite._triton as T
    from minite.gpu_compile import compile_record, gate

    out = {}
    def rec(module, kernel, sig, consts, warps=4, stages=3):
        return {"module": module, "kernel": kernel, "signature": sig, "constexprs": consts, "num_warps": warps,
                "num_stages": stages}

    # 1. planted kernels
    sig = {"X": "*fp32", "O": "*fp32", "n": "i32", "scale": "float"}
    for name in ("_loop_kernel", "_leak_kernel", "_fixed_kernel"):
        for ft in ("fp32", "fp64"):
            out[f"{name}/{ft}"] = compile_record(rec("planted_kernels", name, sig, {"BLOCK": 128}), 90, ft)

    # 2. fp32 attention's old forward tile (128 x 64 at D = 128) on an A100, and the one the launcher picks now
    from minite.kernels import attention as A
    ptr = {n: "*fp32" for n in ("Q", "K", "V", "O", "LSE", "CU")}
    sig = dict(ptr, T_Q="i32", T_K="i32", H="i32", KVH="i32", D="i32", qk_scale="float")
    meta = dict(GROUP=1, CAUSAL=True, VARLEN=False, UPCAST=False, PREC="ieee", HEAD_DIM=128, BLOCK_D=128)
    old = rec("minite.kernels.attention", "_attn_fwd_kernel", sig, dict(meta, BLOCK_M=128, BLOCK_N=64), 8)
    out["old_fp32_tile/sm80"] = compile_record(old, 80, "fp32")
    bm, bn, nw = A._blocks(8192, 8192, 128, fp32=True)
    out["new_fp32_tile/sm80"] = compile_record(
        rec("minite.kernels.attention", "_attn_fwd_kernel", sig, dict(meta, BLOCK_M=bm, BLOCK_N=bn), nw), 80, "fp32")

    # 3. the GPU's own tiles at the benchmarks' shapes: the launchers' heuristics with the interpreter off
    T._INTERPRET_AT_IMPORT = False
    from minite.kernels import decode as Dk, fp8_gemm as G
    from minite.kernels._common import row_launch
    gpu = []
    for dt in ("bf16", "fp16"):
        p = {n: "*" + dt for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
        p.update(LSE="*fp32", DELTA="*fp32", CU="*i32")
        ints = dict(T_Q="i32", T_K="i32", H="i32", KVH="i32", D="i32")
        for D in (64, 128):
            for varlen in (False, True):
                m = dict(GROUP=4, CAUSAL=True, VARLEN=varlen, UPCAST=False, PREC="tf32", HEAD_DIM=D, BLOCK_D=D)
                bm, bn, nw = A._blocks(8192, 8192, D)
                gpu.append(rec(A.__name__, "_attn_fwd_kernel", dict(p, **ints, qk_scale="float"),
                               dict(m, BLOCK_M=bm, BLOCK_N=bn), nw))
                bm, bn, nw = A._blocks(8192, 8192, D, True)
                for k in ("_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
                    gpu.append(rec(A.__name__, k, dict(p, **ints, qk_scale="float", scale="float"),
                                   dict(m, BLOCK_M=bm, BLOCK_N=bn), nw))
        pd = {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "LEN": "*i32", "O_PART": "*fp32", "L_PART": "*fp32",
              "H": "i32", "KVH": "i32", "T_MAX": "i32", "D": "i32", "CHUNK": "i32", "qk_scale": "float"}
        for D in (64, 128):
            gpu.append(rec(Dk.__name__, "_decode_partial_kernel", pd, dict(
                GROUP=3, UPCAST=False, PREC="tf32", BLOCK_G=16, BLOCK_D=D, BLOCK_N=64 if D <= 64 else 32)))
        # LoRA's GPU tiles (three kernels since issue 33): minite/gpu_examples.py's lora(), gated by --examples
        block, nw = row_launch(16384)
        pn = {"X_ptr": "*" + dt, "W_ptr": "*" + dt, "B_ptr": "*" + dt, "Y_ptr": "*" + dt, "Mean_ptr": "*fp32",
              "Rstd_ptr": "*fp32", "X_row_stride": "i32", "Y_row_stride": "i32", "N_ROWS": "i32", "N_COLS": "i32",
              "eps": "float"}
        gpu.append(rec("minite.kernels.rmsnorm", "_norm_fwd_kernel", pn, dict(
            LAYERNORM=True, ACC={"dtype": "fp32"}, BLOCK_SIZE=block, BLOCK_ROWS=1), nw))
    pg = {"A_ptr": "*fp8e4nv", "B_ptr": "*fp8e4nv", "C_ptr": "*bf16", "A_scale_inv_ptr": "*fp32",
          "B_scale_inv_ptr": "*fp32"}
    for acc in ("fast", "split"):
        bm, bn, bk, nw, ns = G._tiles(4096, 4096, 4096, True, acc)
        gpu.append(rec(G.__name__, "_fp8_gemm_kernel", pg, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                                                  SPLIT_ACC=acc == "split"), nw, ns))
    budget = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    fails = gate(gpu, archs=(90, 80), jobs=2, check_spills=True, spill_budget=budget)
    out["gpu_tiles"] = {"n": len(gpu), "fails": fails}
    print("RESULT " + json.dumps(out))
''')


# Register spills ptxas -v reports today (ptxas of triton 3.7.1, 2026-11-25) for the GPU tiles below, in bytes. The
# gate fails when a tile spills more, or a tile not listed spills at all. Spills cost speed, not correctness: they
# are issue 20's to remove (attention's backward runs at 0.55x FlashAttention-2), with a GPU to time each change.
# Attention's forward and dQ: lower since they clean the diagonal key blocks under a branch (fwd D=64 16 -> 0,
# varlen 196 -> 72; D=128 8 -> 0, varlen 128 -> 60; dQ varlen D=64 4 -> 0), a ptxas allocation change, untimed.
# The H100 runs triton 3.6 and its own ptxas: its counts are unverified (the fp8 GEMM's, with 4.7 KB spilled per
# thread, is hard to square with the 1178 TFLOP/s measured there).
SPILL_BUDGET = {
    "_attn_bwd_dkdv_kernel[BLOCK_D=128,BLOCK_M=32,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=False; *bf16/*fp32/*i32; warps=8]": 248,
    "_attn_bwd_dkdv_kernel[BLOCK_D=128,BLOCK_M=32,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=False; *fp16/*fp32/*i32; warps=8]": 248,
    "_attn_bwd_dkdv_kernel[BLOCK_D=128,BLOCK_M=32,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *bf16/*fp32/*i32; warps=8]": 264,
    "_attn_bwd_dkdv_kernel[BLOCK_D=128,BLOCK_M=32,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *fp16/*fp32/*i32; warps=8]": 264,
    "_attn_bwd_dkdv_kernel[BLOCK_D=64,BLOCK_M=64,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=False; *bf16/*fp32/*i32; warps=4]": 36,
    "_attn_bwd_dkdv_kernel[BLOCK_D=64,BLOCK_M=64,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=False; *fp16/*fp32/*i32; warps=4]": 36,
    "_attn_fwd_kernel[BLOCK_D=128,BLOCK_M=128,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *bf16/*fp32/*i32; warps=8]": 60,
    "_attn_fwd_kernel[BLOCK_D=128,BLOCK_M=128,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *fp16/*fp32/*i32; warps=8]": 60,
    "_attn_fwd_kernel[BLOCK_D=64,BLOCK_M=128,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *bf16/*fp32/*i32; warps=4]": 72,
    "_attn_fwd_kernel[BLOCK_D=64,BLOCK_M=128,BLOCK_N=64,CAUSAL=True,GROUP=4,PREC=tf32,UPCAST=False,VARLEN=True; *fp16/*fp32/*i32; warps=4]": 72,
    "_decode_partial_kernel[BLOCK_D=128,BLOCK_G=16,BLOCK_N=32,GROUP=3,PREC=tf32,UPCAST=False; *bf16/*fp32/*i32; warps=4]": 20,
    "_decode_partial_kernel[BLOCK_D=128,BLOCK_G=16,BLOCK_N=32,GROUP=3,PREC=tf32,UPCAST=False; *fp16/*fp32/*i32; warps=4]": 20,
    "_fp8_gemm_kernel[BLOCK_K=128,BLOCK_M=256,BLOCK_N=128,GROUP_M=8,SPLIT_ACC=False; *bf16/*fp32/*fp8e4nv; warps=8]": 4688,
    "_fp8_gemm_kernel[BLOCK_K=128,BLOCK_M=256,BLOCK_N=128,GROUP_M=8,SPLIT_ACC=True; *bf16/*fp32/*fp8e4nv; warps=8]": 4964,
}


def _run(tmp_path, script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (tmp_path / "planted_kernels.py").write_text(PLANTED)
    # Triton's own cache (as the gate after pytest): a failed compile is never cached, a repeated one is quick
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script, json.dumps(SPILL_BUDGET)], env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert r.returncode == 0 and "RESULT " in r.stdout, (r.stdout + r.stderr)[-4000:]
    return r.stdout, json.loads(r.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    return _run(tmp_path_factory.mktemp("gate"), SCRIPT)


def test_gate_fails_on_a_planted_fp64_scalar(gate_run):
    _, out = gate_run
    assert out["_loop_kernel/fp32"]["ok"], out["_loop_kernel/fp32"]  # an eager launch types the float fp32
    bad = out["_loop_kernel/fp64"]  # Inductor's typing: the H100's error, here on the CPU
    assert not bad["ok"] and "Loop-carried variable m" in bad["why"] and "fp64" in bad["why"], bad
    leak = out["_leak_kernel/fp64"]  # compiles, but computes in fp64: caught in the TTIR
    assert not leak["ok"] and "leaks" in leak["why"], leak
    assert out["_fixed_kernel/fp64"]["ok"] and out["_fixed_kernel/fp32"]["ok"], out


def test_gate_fails_on_shared_memory_over_the_block_limit(gate_run):
    _, out = gate_run
    old, new = out["old_fp32_tile/sm80"], out["new_fp32_tile/sm80"]
    assert not old["ok"] and "shared memory" in old["why"] and old["shared"] > 166912, old
    assert new["ok"] and new["shared"] <= 166912, new


def test_gpu_tiles_compile_for_sm90_and_sm80(gate_run):
    text, out = gate_run
    assert out["gpu_tiles"]["n"] >= 20 and out["gpu_tiles"]["fails"] == 0, text[-4000:]
