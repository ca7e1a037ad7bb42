"""The attention and decode kernels compile for an H100 (sm_90) with the launchers' GPU tiles, on a machine with
no GPU: Triton's own ptxas turns them into cubins without a driver. The interpreter accepts what the GPU compiler
refuses (tl.dot with K < 16: checked, a BLOCK_N of 8 fails here; shared memory over 227 KiB; ops without a GPU
lowering). A subprocess, because the kernels must be decorated with the interpreter off. Triton 3.7 pads small
M and N of a dot itself; older releases refused them, so test_gpu_tiles_are_legal keeps every dim >= 16."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from minite.kernels import attention as A, decode as Dk

    def build(fn, types, consts, nw):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": nw})
        assert k.metadata.shared <= 232448, (fn.__name__, k.metadata.shared)  # H100: 227 KiB per block

    types = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}
    types.update(LSE="*fp32", DELTA="*fp32", CU="*i32", LEN="*i32", O_PART="*fp32", L_PART="*fp32",
                 qk_scale="fp32", scale="fp32")
    D = 128
    meta = dict(GROUP=4, CAUSAL=True, VARLEN=False, UPCAST=False, PREC="tf32", HEAD_DIM=D, BLOCK_D=D)
    bm, bn, nw = A._blocks(8192, 8192, D)
    build(A._attn_fwd_kernel, types, dict(meta, BLOCK_M=bm, BLOCK_N=bn), nw)
    bm, bn, nw = A._blocks(8192, 8192, D, True)
    build(A._attn_bwd_dkdv_kernel, types, dict(meta, BLOCK_M=bm, BLOCK_N=bn), nw)
    build(A._attn_bwd_dq_kernel, types, dict(meta, VARLEN=True, BLOCK_M=bm, BLOCK_N=bn), nw)
    build(Dk._decode_partial_kernel, types, dict(GROUP=4, UPCAST=False, PREC="tf32", BLOCK_G=16, BLOCK_D=D,
                                                  BLOCK_N=32), 4)
    build(Dk._lse_merge_kernel, dict(types, O="*bf16"), dict(BLOCK_S=16, BLOCK_D=D), 4)
    print("compiled for sm_90")
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])  # this checkout's minite, whatever the cwd
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert r.returncode == 0 and "compiled for sm_90" in r.stdout, r.stderr[-3000:]
