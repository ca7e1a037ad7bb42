"""The launches a GPU makes at the benchmarks' shapes, for the sm_90 gate (``python -m minite.gpu_compile --examples``).

One function per kernel family. Each calls the family's PUBLIC launchers (the functions its autograd Function and
its ``torch.ops.minite`` op call) on CPU tensors from ``torch.empty`` at the shapes benchmarks/bench_*.py time,
inside ``gpu_compile.capture_gpu_launches()``: the launchers pick the tiles they pick on a GPU (``gpu_tiles``),
and each launch is recorded with the JIT's specialisation but not run. Nothing here computes anything, so a
family takes well under a second and no memory beyond what a launcher touches itself (torch.zeros outputs).

A family's owner keeps its function in step with the kernels: new launchers, new tiles, the shapes the benchmark
times. A launch the gate must not see spill, replicate or miss wgmma is listed here only once it is fixed or
its budget in SPILL_BUDGET says why.
"""
from __future__ import annotations

import torch

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn

# Register spills (bytes) a GPU tile may have, by gpu_compile.describe(record); absent means 0. Each entry says why
# the tile spills and why that is the right tile anyway: a spill costs speed on every step.
SPILL_BUDGET: dict[str, int] = {
    # fp8_gemm's "split" tile (dgrad, wgrad): 256 x 128 holds two fp32 accumulators (the K-block's partial sum and
    # the promoted one), 128 + 128 per thread at 8 warps: 255 registers and one spilled. Kept: it was the fastest of
    # 8 tilings on an H100 (1020 TFLOP/s; 128 x 128 869, 128 x 256 605: benchmarks/bench_fp8_gemm.py --sweep).
    "_fp8_gemm_kernel[A_col_stride=1,BLOCK_K=128,BLOCK_M=256,BLOCK_N=128,B_row_stride=1,C_col_stride=1,FP8_MMA=True,"
    "GROUP_M=8,SPLIT_ACC=True; *bf16/*fp32/*fp8e4nv; warps=8]": 4,
}


def _e(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------ attention
def attention():
    """bench_attention.py: B*T = 16k tokens, H = 2048 / D, D = 64 and 128, causal and not (bf16; fp16 at D=128);
    the GPT's GQA (4 query heads per kv head) and the varlen (thd) layout at D = 128; the GPT's fused-qkv ops."""
    from minite.kernels.attention import attention_bwd, attention_fwd, attention_qkv_bwd, attention_qkv_fwd

    def run(D, causal, dtype=BF16, T=4096, group=1):
        B, H = 16384 // T, 2048 // D
        q, k, v = _e(B, H, T, D, dtype=dtype), _e(B, H // group, T, D, dtype=dtype), _e(B, H // group, T, D,
                                                                                          dtype=dtype)
        o, lse = attention_fwd(q, k, v, causal)
        attention_bwd(torch.empty_like(o), q, k, v, o, lse, causal)

    for D in (64, 128):
        for causal in (False, True):
            run(D, causal)
    run(128, True, FP16)
    run(64, True, group=4)
    run(128, True, group=4)
    # varlen: 4 sequences of 4096 packed, (total, H, D)
    T, D, H = 4096, 128, 16
    cu = torch.arange(0, 5 * T, T, dtype=torch.int32)
    q, k, v = _e(4 * T, H, D), _e(4 * T, H // 4, D), _e(4 * T, H // 4, D)
    o, lse = attention_fwd(q, k, v, True, cu_seqlens=cu, max_seqlen=T)
    attention_bwd(torch.empty_like(o), q, k, v, o, lse, True, cu_seqlens=cu, max_seqlen=T)
    # the GPT's training step: RoPE + attention on views of the fused qkv projection (GPT-2 124M: 12 heads of 64,
    # T = 1024, batch 16), q/k/v/o/do with token stride (H + 2 KVH) D or H D; and a GQA 4 model at D = 128
    for B, T, H, KVH, D in ((16, 1024, 12, 12, 64), (4, 4096, 16, 4, 128)):
        qkv, cos, sin = _e(B, T, (H + 2 * KVH) * D), _e(T, D // 2, dtype=torch.float32), _e(T, D // 2,
                                                                                            dtype=torch.float32)
        o, lse, qk = attention_qkv_fwd(qkv, cos, sin, H, KVH, True, None)
        attention_qkv_bwd(torch.empty_like(o), qkv, qk, o, lse, cos, sin, H, KVH, True, None)


# ------------------------------------------------------------------------------------------------- decode
def decode():
    """Batch-1 decoding of the GPT (12 heads of 64, GQA 4) and a Llama-like layer (32 heads of 128, GQA 4, batch 8)
    with 1024 cached tokens (bench_attention.py --decode)."""
    from minite.kernels.decode import decode_attention_triton

    for B, H, KVH, D in ((1, 12, 3, 64), (8, 32, 8, 128)):
        T = 1024
        decode_attention_triton(_e(B, H, D), _e(B, KVH, T, D), _e(B, KVH, T, D),
                                torch.full((B,), T, dtype=torch.int32))
    # minite.decoding's CUDA-graph step up to SINGLE_PASS_MAX_LEN keys: one pass (num_splits=1, no merge kernel, the
    # output stored by the partial kernel), on the cache's int64 lengths, in the benchmark's cache (T_max = 1033)
    for B, H, KVH, D in ((1, 12, 3, 64), (1, 32, 8, 128)):
        T = 1033
        decode_attention_triton(_e(B, H, D), _e(B, KVH, T, D), _e(B, KVH, T, D),
                                torch.full((B,), 257, dtype=torch.int64), None, 1, None)


# --------------------------------------------------------------------------------------------------- lora
def lora():
    """bench_lora.py: 8192 rows, K = O = 4096, rank 16 and 64, forward and backward (bf16)."""
    from minite.kernels.lora import lora_bwd, lora_fwd

    N, K, O = 8192, 4096, 4096
    x, w = _e(N, K), _e(O, K)
    for r in (16, 64):
        A, B = _e(r, K), _e(O, r)
        y, g = lora_fwd(x, w, A, B, 2.0)
        lora_bwd(torch.empty_like(y), x, w, A, B, g, 2.0)


# ----------------------------------------------------------------------------------------------- fp8_gemm
def fp8_gemm():
    """bench_fp8_gemm.py at M = N = K = 4096: the GEMM in both accumulation modes, and the fp8 Linear's three GEMMs
    (fprop x @ W^T, dgrad dy @ W, wgrad dy^T @ x, TransformerEngine's modes) with the per-tensor quantize."""
    from minite.formats.fp8 import fp8_quantize_fwd
    from minite.kernels.fp8_gemm import fp8_gemm_raw

    S = 4096
    one = torch.ones(1)
    a, bt = _e(S, S, dtype=FP8), _e(S, S, dtype=FP8)            # A (M, K); B^T (N, K): K-contiguous, as W is
    for split in (True, False):
        fp8_gemm_raw(a, bt.t(), one, one, BF16, split)
    qx, qw, qg = a, bt, _e(S, S, dtype=FP8)                      # x (N, K), W (O, K), dy (N, O)
    fp8_gemm_raw(qx, qw.t(), one, one, BF16, False)              # fprop: fast accumulation
    fp8_gemm_raw(qg, qw, one, one, BF16, True)                   # dgrad
    fp8_gemm_raw(qg.t(), qx, one, one, BF16, True)               # wgrad
    fp8_quantize_fwd(_e(S, S), one, FP8, hw_cast=True)


# ---------------------------------------------------------------------------------------------- fp8_block
def fp8_block():
    """bench_fp8_block.py at M = N = K = 4096: blockwise (A per 1 x 128, B per 128 x 128: DeepSeek-V3) and MX
    (1 x 32, E8M0), each with its quantize kernels; and the linear layer's weight gradient, whose B (x) is scaled
    per 128 x 1 column slice (a vector of B scales, not a scalar)."""
    from minite.kernels.fp8_block import block_scaled_gemm_fwd, quantize_block_fwd

    S = 4096
    x, w = _e(S, S), _e(S, S)
    qa = quantize_block_fwd(x, (1, 128), "blockwise")
    qw = quantize_block_fwd(w, (128, 128), "blockwise")
    block_scaled_gemm_fwd(qa, qw.t(), BF16)
    block_scaled_gemm_fwd(qa, quantize_block_fwd(w, (1, 128), "blockwise").t(), BF16)   # B per 128 x 1
    ma, mw = quantize_block_fwd(x, (1, 32), "mx"), quantize_block_fwd(w, (1, 32), "mx")
    block_scaled_gemm_fwd(ma, mw.t(), BF16)


# ------------------------------------------------------------------------------------------- grouped_gemm
def grouped_gemm():
    """bench_grouped_gemm.py: 8 experts, 16384 routed rows (shares ~ 1 / (e + 1), the last expert empty),
    K = 4096, N = 14336: forward, dx (the forward on w^T) and dw."""
    from minite.kernels.grouped_gemm import grouped_gemm_dw, grouped_gemm_fwd

    E, M, K, N = 8, 16384, 4096, 14336
    share = torch.tensor([1.0 / (e + 1) for e in range(E - 1)] + [0.0])
    counts = (share / share.sum() * M / 16).floor().long() * 16
    counts[0] += M - int(counts.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    x, w = _e(M, K), _e(E, K, N)
    y = grouped_gemm_fwd(x, w, offsets)
    grouped_gemm_fwd(y, w.transpose(1, 2), offsets)               # dx = dy @ w^T
    del y
    grouped_gemm_dw(x, _e(M, N), offsets, BF16)


# ------------------------------------------------------------------------------------------------- norms
def norms():
    """bench_rmsnorm.py: 16384 rows of 2048 (a GPT's width), 8192 (the widest LayerNorm whose backward keeps db in
    registers) and 16384 columns (the widest benchmarked), RMSNorm and LayerNorm, forward and backward."""
    from minite.kernels.rmsnorm import layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd

    for C in (2048, 8192, 16384):
        x, w, b = _e(16384, C), _e(C), _e(C)
        y, rstd = rmsnorm_fwd(x, w)
        rmsnorm_bwd(torch.empty_like(y), x, w, rstd)
        y, mean, rstd = layernorm_fwd(x, w, b)
        layernorm_bwd(torch.empty_like(y), x, w, mean, rstd)


# -------------------------------------------------------------------------------------------------- rope
def rope():
    """bench_rope.py: batch 8, 2048 positions, q 32 heads and k 8, D = 64 and 128, both layouts, fwd and bwd."""
    from minite.kernels.rope import rope_bwd, rope_cos_sin, rope_fwd

    B, T = 8, 2048
    for D in (64, 128):
        cos, sin = rope_cos_sin(T, D)
        for H in (32, 8):
            for layout, shape in (("bhtd", (B, H, T, D)), ("bthd", (B, T, H, D))):
                y = rope_fwd(_e(*shape), cos, sin, layout=layout)
                rope_bwd(y, cos, sin, layout=layout)


# ------------------------------------------------------------------------------------------------ swiglu
def swiglu():
    """bench_swiglu.py: 8192 rows, hidden 11008 and 14336, forward and backward."""
    from minite.kernels.swiglu import swiglu_bwd, swiglu_fwd

    for H in (11008, 14336):
        g, u = _e(8192, H), _e(8192, H)
        swiglu_bwd(swiglu_fwd(g, u), g, u)


# -------------------------------------------------------------------------------------------- cross_entropy
def cross_entropy():
    """bench_cross_entropy.py: 8192 rows of logits over V = 50304 (padded) and 50257 (GPT-2's), fwd and bwd."""
    from minite.kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd

    for V in (50304, 50257):
        logits, target = _e(8192, V), torch.zeros(8192, dtype=torch.long)
        loss, lse = cross_entropy_fwd(logits, target, -100, 0.0)
        cross_entropy_bwd(torch.ones(1), logits, target, lse, -100, 0.0)


# ------------------------------------------------------------------------------------------------ softmax
def softmax():
    """bench_softmax.py: 4096 rows of 4096 and 32768 columns, forward and backward."""
    from minite.kernels.softmax import softmax_bwd, softmax_fwd

    for C in (4096, 32768):
        x = _e(4096, C)
        y = softmax_fwd(x)
        softmax_bwd(y, torch.empty_like(y))


FAMILIES = {"attention": attention, "decode": decode, "lora": lora, "fp8_gemm": fp8_gemm, "fp8_block": fp8_block,
            "grouped_gemm": grouped_gemm, "norms": norms, "rope": rope, "swiglu": swiglu,
            "cross_entropy": cross_entropy, "softmax": softmax}
