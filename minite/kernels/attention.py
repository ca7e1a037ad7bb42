"""Flash attention (chapter 07): FlashAttention-2's forward and backward in Triton, causal, GQA, packed sequences.

    O = softmax(Q K^T * scale + mask) V          q (B, H, T_q, D), k/v (B, KVH, T_k, D), H % KVH == 0

The T_q x T_k score matrix never reaches HBM: each program owns BLOCK_M query rows and streams the keys through
on-chip memory in blocks of BLOCK_N, keeping a running max m, a running sum l and an unnormalised accumulator
(the online softmax). It stores O and the row log-sum-exp LSE = m + log l (natural log, (B, H, T_q) fp32), which
the backward uses to recompute P instead of keeping it, and which chapters 08 and 13 use to merge partial results.

Causal masking is bottom-right aligned (FlashAttention >= 2.1, PyTorch's ``causal_lower_right``): query i sees
keys j <= i + T_k - T_q, so the last query sees every key, which is what a KV-cache prefill needs. For T_q == T_k
this is the usual mask. A query row that sees no key gets LSE = -inf and output 0 (never NaN).
Non-finite keys/values under the causal mask never change a row that cannot see them (a row that sees one is NaN):
P V gives a masked key weight 0, and 0 * NaN = NaN. The reference cleans k, v (``_finite_kv``); the kernels clean
the tiles of the diagonal key blocks only, the one place a key is masked for some rows (``_fwd_loop``).
Layouts: "bhsd" (B, H, T, D) for ``attention``, any strides (a (B, H, T, D) view of (B, T, H, D) memory too);
"thd" (total_tokens, H, D) with ``cu_seqlens`` for ``attention_varlen`` (Transformer Engine's packed format: no
padding, nothing computed across sequences); the fused qkv projection (B, T, (H + 2 KVH) D) for ``attention_qkv``,
which the GPT uses: RoPE and attention with no layout copy, and one d(qkv) buffer in the backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minite import _validate as _v
from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels import _common as C  # launchable: wrap_triton while torch.compile traces; op: torch.ops
from minite.kernels import rope as _rope

__all__ = ["attention_ref", "attention", "attention_varlen", "attention_qkv", "attention_fwd", "attention_bwd",
           "attention_qkv_fwd", "attention_qkv_bwd", "AttentionFunction", "QKVAttentionFunction",
           "Attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128  # D is padded up to a power of two >= 16 inside the kernel; larger D would not fit on-chip
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e)), and exp2 is the GPU's native instruction


# ------------------------------------------------------------------------------------------ 1. reference
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  scale: float | None = None, return_lse: bool = False):
    """softmax(q k^T * scale [+ bottom-right causal mask]) v with k/v heads repeated for GQA. The spec.

    The output comes from PyTorch's SDPA at the input precision (the fast path the GPT's "torch" backend runs);
    the LSE (B, H, T_q), when asked for, from an fp32 logsumexp of the explicit scores. Rows that see no key
    give output 0 and LSE -inf."""
    B, H, Tq, D = q.shape
    Tk, KVH = k.shape[2], k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if H != KVH:
        k = k.repeat_interleave(H // KVH, dim=1)  # (B, H, T_k, D): query head h reads kv head h // (H / KVH)
        v = v.repeat_interleave(H // KVH, dim=1)  # (B, H, T_k, D)
    k_in, seen_bad = k, None
    if causal and Tk:  # masked keys/values must not leak: P V multiplies a masked 0 by the value, and 0 * NaN = NaN
        k, v, seen_bad = _finite_kv(k, v, Tq)
    keep = None
    if causal and Tq != Tk:  # bottom-right mask: query i sees keys j <= i + T_k - T_q
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)  # (T_q, T_k)
    if Tk == 0:
        o = q.new_zeros(B, H, Tq, v.shape[-1])
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal and keep is None, scale=scale)
        if keep is not None:  # rows with no visible key: 0, not the NaN of a softmax over nothing
            o = o.masked_fill(~keep.any(-1)[:, None], 0.0)
        if seen_bad is not None:  # a row that sees a non-finite key or value: NaN in full
            o = o.masked_fill(seen_bad[..., None], float("nan"))
    if not return_lse:
        return o
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(ct) @ k_in.to(ct).transpose(-1, -2)) * scale  # (B, H, T_q, T_k)
    if causal:  # masked_fill, not a product with 0: a masked NaN score becomes -inf
        s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1).float()  # (B, H, T_q)
    return o, lse if seen_bad is None else lse.masked_fill(seen_bad, float("nan"))


def _finite_kv(k, v, Tq):
    """(k, v with every non-finite entry 0, (B, H, T_q) bool: row i sees a key j <= i + T_k - T_q whose k or v row is
    not finite; or None when every entry is finite). SDPA of the cleaned k, v leaks nothing into rows that cannot see
    a bad key (0 * NaN in P V, and in dS K of the backward); the rows that can are set to NaN by the caller.

    On the CPU a host check is free: finite inputs (the usual case) skip the copies. On CUDA (and while compiling)
    the clean-up always runs, as tensor ops: a check there would be a host sync per call. The kernels do their
    own: cleaning every key block in the loop took sm_90 spills from 16 to 200-1300 bytes per thread at D = 64, so
    they clean the diagonal blocks only, in their masked loops (``_fwd_loop``, ``_dq_loop``)."""
    if k.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()):
            return k, v, None
    Tk = k.shape[2]
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, H, T_k)
    upto = bad.cumsum(-1) > 0  # (B, H, T_k): some key j' <= j is bad
    last = torch.arange(Tq, device=k.device) + (Tk - Tq)  # (T_q,) the last key row i sees (bottom-right)
    seen = upto[..., last.clamp(min=0)] & (last >= 0)  # (B, H, T_q)
    return torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0), seen

# -------------------------------------------------------------------------------------------- 2. kernels
# Every tensor is read through its own (batch, head, token) strides, D with stride 1: (B, H, T, D) contiguous,
# a (B, T, H, D) view of the GPT's fused qkv projection, and the packed thd layout (batch stride 0, token stride
# H * D, tokens counted from the sequence's first) are all one code path, and no launcher copies.
# Each key loop is split as in Triton's fused-attention tutorial: a main loop over blocks every row of the tile
# sees in full (no mask, no NaN scrub: k and v go from shared memory straight into the MMA), then a masked loop
# over the diagonal blocks (causal) and the ragged tail (T not a multiple of the block).
@triton.jit
def _seq(CU, b, T_Q, T_K, VARLEN: tl.constexpr):
    # (first token, query length, key length) of sequence b: from cu_seqlens when packed, else (0, T_q, T_k)
    if VARLEN:
        start = tl.load(CU + b).to(tl.int64)
        n = tl.load(CU + b + 1).to(tl.int64) - start
        return start, n, n
    else:
        return b * 0, T_Q, T_K


@triton.jit
def _lse_row(b, h, start, H, T_Q, VARLEN: tl.constexpr):
    # LSE and Delta: (B, H, T_q) for bhsd, (H, total) for thd (T_Q is then the total token count)
    if VARLEN:
        return h * T_Q + start
    else:
        return (b * H + h) * T_Q


@triton.jit
def _tile(P, rows, st, offs_d, n, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # The (rows, BLOCK_D) tile at P + row * st + d. Masked on rows < n only in a masked loop (the main loops read
    # whole blocks), on d < HEAD_DIM only when D is padded to BLOCK_D.
    ptr = P + rows[:, None] * st + offs_d[None, :]
    if MASKED:
        return tl.load(ptr, mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _put(P, rows, st, offs_d, n, x, HEAD_DIM: tl.constexpr):
    tl.store(P + rows[:, None] * st + offs_d[None, :], x.to(P.dtype.element_ty),
             mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _fwd_loop(q, K, V, k_st, v_st, lo, hi, offs_m, offs_n, offs_d, Tk, off, qk_scale, m_i, l_i, acc,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Key blocks lo .. hi of the online softmax. K, V: key 0 of this sequence and kv head.
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        k = _tile(K, cols, k_st, offs_d, Tk, MASKED, HEAD_DIM, BLOCK_D)  # (BLOCK_N, BLOCK_D)
        v = _tile(V, cols, v_st, offs_d, Tk, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # A masked key has p = 0, and P V would form 0 * NaN from a non-finite v_j: on the diagonal, v_j is zeroed
        # and s_ij made NaN for every i (kept where row i sees key j, -inf from the mask below where it does not).
        # Finite inputs: bad = 0, nothing changes. Tensor cores take it through k, fp32's FMA dot through s.
        if MASKED and CAUSAL and PREC != "ieee":
            bad = v - v  # 0 where v is finite, NaN where it is NaN or inf
            k = k + bad
            v = tl.where(bad == 0.0, v, tl.zeros_like(v))
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N) scores, log2 units
        if MASKED:
            if CAUSAL and PREC == "ieee":
                bad = v - v
                v = tl.where(bad == 0.0, v, tl.zeros_like(v))
                s = s + tl.sum(bad, 1)[None, :]
            keep = cols[None, :] < Tk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + off)
            s = tl.where(keep, s, float("-inf"))  # where, not a product: a masked NaN score becomes -inf too
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: avoid -inf - -inf = NaN
        alpha = tl.exp2(m_i - m_safe)  # rescale what was summed under the old max (0 when m_i = -inf)
        p = tl.exp2(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N), masked entries exp2(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _key_ranges(m0, Tq, Tk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # For the query tile m0 .. m0 + BLOCK_M: (full, hi). Key blocks 0 .. full are seen in full by every row (the
    # main loop); full .. hi hold the diagonal (causal) and the ragged tail (the masked loop); keys past hi are
    # in the future of every row of the tile (causal block skipping) and are never loaded.
    off = Tk - Tq  # bottom-right causal: row i sees keys j <= i + off
    hi = Tk
    full = Tk // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(Tk, tl.maximum(m0 + BLOCK_M + off, 0))
        full = tl.minimum(full, tl.maximum(m0 + off + 1, 0) // BLOCK_N * BLOCK_N)
    hi = tl.where(m0 < Tq, hi, 0)  # packed batch: this sequence may be shorter than the grid
    return tl.minimum(full, hi), hi


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, CU, T_Q, T_K, H, KVH, qk_scale,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                     GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                     PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid (cdiv(T_q, BLOCK_M), B * H): program (i, b*H + h) owns query rows i*BLOCK_M ... of head h of sequence b.
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a Python float as fp64: keep the state fp32
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    g = h // GROUP  # GQA: GROUP query heads per kv head
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    Q += b * sqb + h * sqh + start * sqt  # token 0 of (sequence b, head h); thd: batch stride 0
    O += b * sob + h * soh + start * sot
    K += b * skb + g * skh + start * skt
    V += b * svb + g * svh + start * svt
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key columns within a block
    offs_d = tl.arange(0, BLOCK_D)  # D padded to a power of two >= 16 (tl.dot's minimum on the GPU)
    q = _tile(Q, offs_m, sqt, offs_d, Tq, True, HEAD_DIM, BLOCK_D)
    if UPCAST:  # bf16 under the interpreter: its arithmetic is wrong there, so compute in fp32
        q = q.to(tl.float32)
    # Online softmax state, in log2 units (qk_scale = scale * log2(e), so exp2 replaces exp):
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(s - m_i) @ V, normalised at the end
    full, hi = _key_ranges(m0, Tq, Tk, CAUSAL, BLOCK_M, BLOCK_N)
    off = Tk - Tq
    m_i, l_i, acc = _fwd_loop(q, K, V, skt, svt, 0, full, offs_m, offs_n, offs_d, Tk, off, qk_scale, m_i, l_i, acc,
                              False, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_N)
    m_i, l_i, acc = _fwd_loop(q, K, V, skt, svt, full, hi, offs_m, offs_n, offs_d, Tk, off, qk_scale, m_i, l_i, acc,
                              True, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_N)
    empty = l_i == 0.0  # rows that saw no key
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # 0 for empty rows
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)  # ln
    _put(O, offs_m, sot, offs_d, Tq, o, HEAD_DIM)
    tl.store(LSE + _lse_row(b, h, start, H, T_Q, VARLEN) + offs_m, lse, mask=offs_m < Tq)


@triton.jit
def _attn_bwd_pre_kernel(O, DO, DELTA, CU, T_Q, H, sob, soh, sot, sdb, sdh, sdt, VARLEN: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # Delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the term the softmax backward subtracts. Grid as forward.
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    start, Tq, _ = _seq(CU, b, T_Q, T_Q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _tile(O + b * sob + h * soh + start * sot, offs_m, sot, offs_d, Tq, True, HEAD_DIM, BLOCK_D)
    do = _tile(DO + b * sdb + h * sdh + start * sdt, offs_m, sdt, offs_d, Tq, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + _lse_row(b, h, start, H, T_Q, VARLEN) + offs_m, delta, mask=offs_m < Tq)


# Backward (derived in the notebook). With P recomputed from the LSE, P = exp(S*scale - LSE):
#   dV = P^T dO      dP = dO V^T      dS = P * (dP - Delta),  Delta = rowsum(dO * O)
#   dQ = dS K * scale                 dK = dS^T Q * scale
# dK/dV sum over query rows, dQ over key columns: two kernels, each owning the rows it writes, so no atomics.
# GQA: the dK/dV program of kv head g also loops over the GROUP query heads that read g and sums their terms.
# dK/dV rows are per key: whatever a non-finite k_j or v_j does stays in row j (which some row sees, so it is NaN
# in the reference too), and this kernel needs no scrub; its masked loops mask P only.
@triton.jit
def _dkdv_loop(k, v, dk, dv, Q, DO, LSE, DELTA, q_sh, q_st, do_sh, do_st, l_sh, lo, hi, offs_n, offs_d, Tq, off,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    # Query blocks lo .. hi of each of the GROUP query heads that read these keys, as one flat loop (a loop over
    # heads around it spilled registers on sm_90). Q, DO, LSE, DELTA: query 0 of the first head; *_sh: head strides.
    nb = (hi - lo) // BLOCK_M
    for it in range(0, nb * GROUP):
        j = it // nb
        offs_m = lo + (it - j * nb) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _tile(Q + j * q_sh, offs_m, q_st, offs_d, Tq, MASKED, HEAD_DIM, BLOCK_D)
        do = _tile(DO + j * do_sh, offs_m, do_st, offs_d, Tq, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            q, do = q.to(tl.float32), do.to(tl.float32)
        if MASKED:
            lse2 = tl.load(LSE + j * l_sh + offs_m, mask=offs_m < Tq, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + j * l_sh + offs_m, mask=offs_m < Tq, other=0.0)
        else:
            lse2 = tl.load(LSE + j * l_sh + offs_m) * 1.4426950408889634
            delta = tl.load(DELTA + j * l_sh + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M) = (S^T), log2
        p_t = tl.exp2(s_t - lse2[None, :])  # P^T, recomputed
        if MASKED:
            keep = offs_m[None, :] < Tq
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + off)
            p_t = tl.where(keep, p_t, 0.0)  # where, not *: no inf * 0
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)  # (dO V^T)^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)  # dK += dS^T Q (times scale below)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, T_Q, T_K, H, KVH, qk_scale, scale,
                          sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
                          sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                          GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                          PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid (cdiv(T_k, BLOCK_N), B * KVH): program owns BLOCK_N keys of kv head g; loops over queries.
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 under Inductor
    pid_n = tl.program_id(0).to(tl.int64)
    bg = tl.program_id(1).to(tl.int64)
    b, g = bg // KVH, bg % KVH
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _tile(K + b * skb + g * skh + start * skt, offs_n, skt, offs_d, Tk, True, HEAD_DIM, BLOCK_D)
    v = _tile(V + b * svb + g * svh + start * svt, offs_n, svt, offs_d, Tk, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query blocks: lo .. dhi partly see these keys (causal diagonal), dhi .. full see all of them, full .. end is
    # the ragged tail. Queries above lo see none of these keys (causal block skipping).
    off = Tk - Tq
    end = tl.where(n0 < Tk, (Tq + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    lo = n0 * 0
    dhi = n0 * 0
    if CAUSAL:
        lo = tl.minimum(tl.maximum(n0 - off, 0) // BLOCK_M * BLOCK_M, end)
        dhi = tl.minimum((tl.maximum(n0 + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, end)
    full = tl.maximum(tl.minimum(Tq // BLOCK_M * BLOCK_M, end), dhi)
    h = g * GROUP  # the first of the GROUP query heads that read kv head g
    Qh = Q + b * sqb + h * sqh + start * sqt
    DOh = DO + b * sdob + h * sdoh + start * sdot
    row = _lse_row(b, h, start, H, T_Q, VARLEN)  # LSE / Delta rows: one head further is T_Q further, both layouts
    dk, dv = _dkdv_loop(k, v, dk, dv, Qh, DOh, LSE + row, DELTA + row, sqh, sqt, sdoh, sdot, T_Q, lo, dhi, offs_n,
                        offs_d, Tq, off, qk_scale, True, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_M, GROUP)
    dk, dv = _dkdv_loop(k, v, dk, dv, Qh, DOh, LSE + row, DELTA + row, sqh, sqt, sdoh, sdot, T_Q, dhi, full, offs_n,
                        offs_d, Tq, off, qk_scale, False, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_M, GROUP)
    dk, dv = _dkdv_loop(k, v, dk, dv, Qh, DOh, LSE + row, DELTA + row, sqh, sqt, sdoh, sdot, T_Q, full, end, offs_n,
                        offs_d, Tq, off, qk_scale, True, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_M, GROUP)
    _put(DK + b * sdkb + g * sdkh + start * sdkt, offs_n, sdkt, offs_d, Tk, dk * scale, HEAD_DIM)
    _put(DV + b * sdvb + g * sdvh + start * sdvt, offs_n, sdvt, offs_d, Tk, dv, HEAD_DIM)


@triton.jit
def _dq_loop(q, do, K, V, k_st, v_st, lo, hi, offs_m, offs_n, offs_d, Tq, Tk, off, qk_scale, lse2, delta, dq,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Key blocks lo .. hi of dQ. A masked entry has P = 0, and dS = P (dP - Delta) is NaN when v_j is not finite
    # (dP = dO V^T), dS K forms 0 * NaN when k_j is not: dS is masked with where, k_j zeroed in the masked loop,
    # and a row that sees a bad k_j still gets NaN: through dP (tensor cores) or S (fp32), as in the forward.
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        k = _tile(K, cols, k_st, offs_d, Tk, MASKED, HEAD_DIM, BLOCK_D)
        v = _tile(V, cols, v_st, offs_d, Tk, MASKED, HEAD_DIM, BLOCK_D)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if MASKED and CAUSAL and PREC != "ieee":
            bad = k - k  # 0 where k is finite, NaN where not
            v = v + bad  # dP_ij NaN for every i: kept by the rows that see key j (dS NaN), masked in the others
            k = tl.where(bad == 0.0, k, tl.zeros_like(k))
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        if MASKED:
            keep = (cols[None, :] < Tk) & (offs_m[:, None] < Tq)
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + off)
            ds = tl.where(keep, ds, 0.0)  # where, not P = 0: 0 * NaN would be NaN
            if CAUSAL and PREC == "ieee":
                k = tl.where(k - k == 0.0, k, tl.zeros_like(k))
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)  # dQ += dS K (times scale below)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, T_Q, T_K, H, KVH, qk_scale, scale,
                        sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
                        GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                        PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid as the forward: program owns BLOCK_M query rows of head h and loops over the keys they see.
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 under Inductor
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    g = h // GROUP
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    K += b * skb + g * skh + start * skt
    V += b * svb + g * svh + start * svt
    l_base = _lse_row(b, h, start, H, T_Q, VARLEN)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _tile(Q + b * sqb + h * sqh + start * sqt, offs_m, sqt, offs_d, Tq, True, HEAD_DIM, BLOCK_D)
    do = _tile(DO + b * sdob + h * sdoh + start * sdot, offs_m, sdot, offs_d, Tq, True, HEAD_DIM, BLOCK_D)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse2 = tl.load(LSE + l_base + offs_m, mask=offs_m < Tq, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + l_base + offs_m, mask=offs_m < Tq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, hi = _key_ranges(m0, Tq, Tk, CAUSAL, BLOCK_M, BLOCK_N)
    off = Tk - Tq
    dq = _dq_loop(q, do, K, V, skt, svt, 0, full, offs_m, offs_n, offs_d, Tq, Tk, off, qk_scale, lse2, delta, dq,
                  False, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = _dq_loop(q, do, K, V, skt, svt, full, hi, offs_m, offs_n, offs_d, Tq, Tk, off, qk_scale, lse2, delta, dq,
                  True, CAUSAL, UPCAST, PREC, HEAD_DIM, BLOCK_D, BLOCK_N)
    _put(DQ + b * sdqb + h * sdqh + start * sdqt, offs_m, sdqt, offs_d, Tq, dq * scale, HEAD_DIM)


# ------------------------------------------------------------------------------------------ 3. launchers
# GPU tiles (fp16/bf16, picked when ``gpu_tiles``), each chosen by compiling for sm_90 as the JIT does (the gate:
# python -m minite.gpu_compile --examples attention): every tl.dot has M >= 64 rows per warpgroup, so it lowers to
# wgmma with no warpgroup computing another's rows, and none spills (triton 3.7.1: forward 227 / 252 registers at
# D = 64 / 128 causal, dQ 176 / 201, dK/dV 199 / 255). (BLOCK_M queries, BLOCK_N keys, warps, stages).
_GPU_TILES = {  # kind -> {BLOCK_D: tile}
    "fwd": {64: (128, 128, 8, 3), 128: (128, 64, 8, 3)},
    "dq": {64: (128, 64, 8, 3), 128: (128, 32, 8, 3)},  # dots: S, dP (128 x BLOCK_N), dQ (128 x D); 128 x 64
    # at D = 128 takes 255 registers and spills packed (varlen): 128 x 32, as Triton's tutorial, takes 208
    # dots: S^T, dP^T (128 keys x BLOCK_M), dK, dV (128 x D). 64 queries at D = 64 took 254 registers (no margin
    # for another ptxas), 32 take 199, as in Triton's tutorial.
    "dkdv": {64: (32, 128, 8, 3), 128: (32, 128, 8, 3)},
}


def _tiles(kind: str, T_q: int, T_k: int, D: int, dtype: torch.dtype, gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel `kind` ("fwd", "dq", "dkdv"). Every tl.dot dim >= 16.
    GPU: the tiles above; fp32 (tf32 / ieee dots) keeps small ones (the sm_80 gate: fp32's 128x64 forward tile
    took 225 KiB of shared memory at D = 128, over an A100's 163 KiB). The interpreter (CPU) runs small tiles, so
    that its tests cross every loop: main blocks, diagonal blocks and ragged tails."""
    bd = max(16, triton.next_power_of_2(D))
    if gpu and dtype != torch.float32:
        bm, bn, nw, ns = _GPU_TILES[kind][64 if bd <= 64 else 128]
    elif gpu:
        wide = bd > 64
        bm, bn, nw, ns = (64 if wide else 128, 32 if wide else 64, 8 if wide else 4, 3) if kind == "fwd" else \
            (32 if wide else 64, 32 if wide else 64, 8 if wide else 4, 3)
    else:
        bm, bn, nw, ns = (32, 64, 4, 1) if kind == "dkdv" else (64, 32, 4, 1)
    bm = min(bm, max(16, triton.next_power_of_2(T_q)))  # short sequences (decode, T = 1): one small tile
    bn = min(bn, max(16, triton.next_power_of_2(T_k)))
    if gpu and dtype != torch.float32 and (bn if kind == "dkdv" else bm) < 128:
        nw = min(nw, 4)  # the dots' M (keys for dK/dV, queries otherwise) has 16 rows per warp: no replication
    return bm, bn, nw, ns


def _meta(q: Tensor, k: Tensor, causal: bool, varlen: bool) -> dict:
    D, upcast = q.shape[-1], q.dtype == torch.bfloat16 and interpreting()  # bf16 math is wrong when interpreted
    return dict(GROUP=q.shape[-3 if not varlen else 1] // k.shape[-3 if not varlen else 1], CAUSAL=causal,
                VARLEN=varlen, UPCAST=upcast, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)))


def _dims(q, k, cu_seqlens, max_seqlen):
    """(B, H, KVH, T_Q, T_K, grid length in queries, in keys) for either layout; T_Q = total tokens for thd."""
    if cu_seqlens is None:
        (B, H, Tq, _), KVH, Tk = q.shape, k.shape[1], k.shape[2]
        return B, H, KVH, Tq, Tk, Tq, Tk
    return cu_seqlens.numel() - 1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], max_seqlen, max_seqlen


def _unit(t: Tensor) -> Tensor:
    """t itself when D has stride 1 (any other strides are passed to the kernels), else a dense copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, token) strides: (B, H, T, D) in any memory order, or thd (total, H, D) with batch stride 0."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, t.stride(1), t.stride(0))


def _like(x: Tensor) -> Tensor:
    """A new tensor shaped like x, (B, H, T, D) or thd, stored in x's order: a (B, H, T, D) view of (B, T, H, D)
    memory (heads inside tokens, as a qkv projection writes them) gives a (B, H, T, D) view of new (B, T, H, D)
    memory, whose (B, T, H * D) view is then free. Dense either way."""
    if x.dim() == 4 and x.stride(1) < x.stride(2):
        B, H, T, D = x.shape
        return x.new_empty((B, T, H, D)).transpose(1, 2)
    return x.new_empty(x.shape)


def _forward(q, k, v, o, causal, scale, cu_seqlens, max_seqlen) -> Tensor:
    """Launch the forward into o (any strides with D's = 1) -> lse."""
    q, k, v = _unit(q), _unit(k), _unit(v)
    B, H, KVH, Tq, Tk, Mq, Mk = _dims(q, k, cu_seqlens, max_seqlen)
    lse = torch.empty((H, Tq) if cu_seqlens is not None else (B, H, Tq), dtype=torch.float32, device=q.device)
    if o.numel():
        D = q.shape[-1]
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        bm, bn, nw, ns = _tiles("fwd", Mq, Mk, D, q.dtype, C.gpu_tiles(q))
        C.launchable(_attn_fwd_kernel)[(triton.cdiv(Mq, bm), B * H)](
            q, k, v, o, lse, cu_seqlens if cu_seqlens is not None else q, Tq, Tk, H, KVH, scale * LOG2E,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), **_meta(q, k, causal, cu_seqlens is not None),
            BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
    return lse


@C.register_op("attention_fwd")  # torch.ops.minite.attention_fwd, for torch.compile (section 4)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
                  cu_seqlens: Tensor | None = None, max_seqlen: int = 0) -> tuple[Tensor, Tensor]:
    """Launch the forward. bhsd: q (B, H, T_q, D), k/v (B, KVH, T_k, D) -> o like q, lse (B, H, T_q) fp32.
    thd (cu_seqlens given): q (total, H, D), k/v (total, KVH, D) -> o like q, lse (H, total) fp32.
    Any strides with D's = 1 (else that tensor is copied); o is stored in q's order (``_like``)."""
    o = _like(q)
    return o, _forward(q, k, v, o, causal, scale, cu_seqlens, max_seqlen)


def _backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, cu_seqlens, max_seqlen) -> None:
    """Delta, then dK/dV (one program per key block and kv head), then dQ, written into dq, dk, dv (any strides
    with D's = 1: slices of one d(qkv) buffer, for ``attention_qkv_bwd``)."""
    do, q, k, v, o = (_unit(t) for t in (do, q, k, v, o))
    lse = lse.contiguous()  # (B, H, T_q) / (H, total), indexed densely; context parallelism passes a slice
    (B, H, KVH, Tq, Tk, Mq, Mk), D = _dims(q, k, cu_seqlens, max_seqlen), q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cu = cu_seqlens if cu_seqlens is not None else q
    meta = _meta(q, k, causal, cu_seqlens is not None)
    delta = torch.empty_like(lse)
    gpu = C.gpu_tiles(q)
    C.launchable(_attn_bwd_pre_kernel)[(triton.cdiv(Mq, 64), B * H)](
        o, do, delta, cu, Tq, H, *_strides(o), *_strides(do), VARLEN=meta["VARLEN"], HEAD_DIM=D,
        BLOCK_D=meta["BLOCK_D"], BLOCK_M=64)
    args = (cu, Tq, Tk, H, KVH, scale * LOG2E, scale)
    bm, bn, nw, ns = _tiles("dkdv", Mq, Mk, D, q.dtype, gpu)
    C.launchable(_attn_bwd_dkdv_kernel)[(triton.cdiv(Mk, bn), B * KVH)](
        q, k, v, do, lse, delta, dk, dv, *args, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
    bm, bn, nw, ns = _tiles("dq", Mq, Mk, D, q.dtype, gpu)
    C.launchable(_attn_bwd_dq_kernel)[(triton.cdiv(Mq, bm), B * H)](
        q, k, v, do, lse, delta, dq, *args, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)


@C.register_op("attention_bwd")
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True,
                  scale: float | None = None, cu_seqlens: Tensor | None = None,
                  max_seqlen: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward -> dq, dk, dv, each stored in its input's order (``_like``)."""
    dq, dk, dv = _like(q), _like(k), _like(v)
    if not (q.numel() and k.numel()):
        return dq.zero_(), dk.zero_(), dv.zero_()
    _backward(do, q, k, v, o, lse, dq, dk, dv, causal, scale, cu_seqlens, max_seqlen)
    return dq, dk, dv


# The GPT's layout: q, k, v straight out of the fused projection. qkv (B, T, (H + 2 KVH) D) is a (B, T, H + 2 KVH, D)
# tensor: heads 0 .. H are q, then KVH of k, then KVH of v. RoPE rotates q and k together (one (B, T, H + KVH, D)
# slice, one launch), v is read where it lies, o is written (B, T, H, D) so that its (B, T, H * D) view feeds the out
# projection. The backward writes dq, dk, dv into one d(qkv) buffer and un-rotates dq, dk there, in place: no
# transpose, no contiguous() and no concatenation of the three gradients (the GPT-2 step paid 2.85 ms for those
# on an H200).
def _rope_bthd(x: Tensor, cos: Tensor, sin: Tensor, sign: int, out: Tensor) -> None:
    """out = x (B, T, NH, D) rotated by sign * t theta (RoPE, chapter 04's kernel). out may be x: each program reads
    its token's heads before it writes them, element by element in the same thread."""
    B, T, NH, D = x.shape
    if B * T * NH == 0:
        return
    C.launchable(_rope._rope_kernel)[(B * T,)](
        x, out, cos, sin, T, NH, x.stride(0), x.stride(2), x.stride(1), out.stride(0), out.stride(2), out.stride(1),
        cos.stride(0), HALF=D // 2, SIGN=sign, ACC=C.tl_compute_dtype(x.dtype), BLOCK_H=triton.next_power_of_2(NH),
        BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4 if NH * D <= 4096 else 8)


def _split(qkv: Tensor, n_head: int, n_kv_head: int) -> tuple[Tensor, int, int]:
    B, T, N = qkv.shape
    D = N // (n_head + 2 * n_kv_head)
    return qkv.view(B, T, n_head + 2 * n_kv_head, D), n_head, n_kv_head


@C.register_op("attention_qkv_fwd")
def attention_qkv_fwd(qkv: Tensor, cos: Tensor, sin: Tensor, n_head: int, n_kv_head: int, causal: bool = True,
                      scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, T, (H + 2 KVH) D), cos/sin (T, D/2) -> o (B, T, H, D), lse (B, H, T) fp32, and q, k rotated
    (B, T, H + KVH, D) (saved for the backward)."""
    x, H, KVH = _split(qkv, n_head, n_kv_head)
    B, T, _, D = x.shape
    qk, o = x.new_empty((B, T, H + KVH, D)), x.new_empty((B, T, H, D))
    _rope_bthd(x[:, :, :H + KVH], cos, sin, 1, qk)
    lse = _forward(qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), x[:, :, H + KVH:].transpose(1, 2),
                   o.transpose(1, 2), causal, scale, None, 0)  # (B, heads, T, D) views
    return o, lse, qk


@C.register_op("attention_qkv_bwd")
def attention_qkv_bwd(do: Tensor, qkv: Tensor, qk: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor,
                      n_head: int, n_kv_head: int, causal: bool = True, scale: float | None = None) -> Tensor:
    """do, o (B, T, H, D) -> d(qkv) (B, T, (H + 2 KVH) D): one buffer, no concatenation."""
    x, H, KVH = _split(qkv, n_head, n_kv_head)
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    dx = dqkv.view(x.shape)
    if qkv.numel():
        def t(a):
            return a.transpose(1, 2)  # (B, T, heads, D) -> (B, heads, T, D) view
        _backward(t(do), t(qk[:, :, :H]), t(qk[:, :, H:]), t(x[:, :, H + KVH:]), t(o), lse, t(dx[:, :, :H]),
                  t(dx[:, :, H:H + KVH]), t(dx[:, :, H + KVH:]), causal, scale, None, 0)
        _rope_bthd(dx[:, :, :H + KVH], cos, sin, -1, dx[:, :, :H + KVH])  # d(rotate)/dx = rotate back, in place
    return dqkv


# ------------------------------------------------------------------------------------ 4. autograd.Function
class AttentionFunction(torch.autograd.Function):
    """Its setup_ctx and backward are also the gradient of torch.ops.minite.attention_fwd: one formula."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cu_seqlens, max_seqlen):
        o, lse = C.op("attention_fwd", attention_fwd)(q, k, v, causal, scale, cu_seqlens, max_seqlen)
        AttentionFunction.setup_ctx(ctx, (q, k, v, causal, scale, cu_seqlens, max_seqlen), (o, lse))
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        q, k, v, causal, scale, cu_seqlens, max_seqlen = inputs
        cu = () if cu_seqlens is None else (cu_seqlens,)
        ctx.save_for_backward(q, k, v, *output, *cu)  # O(T) extra memory: the LSE, not the T x T matrix P
        ctx.args = (causal, scale, max_seqlen)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *cu = ctx.saved_tensors
        causal, scale, max_seqlen = ctx.args
        cu_seqlens = cu[0] if cu else None
        dq, dk, dv = C.op("attention_bwd", attention_bwd)(do, q, k, v, o, lse, causal, scale, cu_seqlens, max_seqlen)
        return dq, dk, dv, None, None, None, None


C.register_autograd("attention_fwd", AttentionFunction.backward, setup_context=AttentionFunction.setup_ctx)


class QKVAttentionFunction(torch.autograd.Function):
    """RoPE + attention on the fused qkv projection; also the gradient of torch.ops.minite.attention_qkv_fwd."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_head, n_kv_head, causal, scale):
        out = C.op("attention_qkv_fwd", attention_qkv_fwd)(qkv, cos, sin, n_head, n_kv_head, causal, scale)
        QKVAttentionFunction.setup_ctx(ctx, (qkv, cos, sin, n_head, n_kv_head, causal, scale), out)
        ctx.mark_non_differentiable(out[1], out[2])
        return out

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        qkv, cos, sin, n_head, n_kv_head, causal, scale = inputs
        o, lse, qk = output
        ctx.save_for_backward(qkv, qk, o, lse, cos, sin)  # v is read from qkv, q and k rotated from qk
        ctx.args = (n_head, n_kv_head, causal, scale)

    @staticmethod
    def backward(ctx, do, _dlse, _dqk):
        qkv, qk, o, lse, cos, sin = ctx.saved_tensors
        dqkv = C.op("attention_qkv_bwd", attention_qkv_bwd)(do, qkv, qk, o, lse, cos, sin, *ctx.args)
        return dqkv, None, None, None, None, None, None


C.register_autograd("attention_qkv_fwd", QKVAttentionFunction.backward, setup_context=QKVAttentionFunction.setup_ctx)


# -------------------------------------------------------------------------------------------- 5. functional
def _check(q, k, v, varlen: bool = False) -> None:
    nd = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != nd or k.dim() != nd or v.dim() != nd:
        lay = "(total_tokens, H, D) thd" if varlen else "4-D (B, H, T, D)"
        raise ValueError(f"attention expects {lay} tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on "
                         f"{'total tokens' if varlen else 'batch'} or head dim")
    H, KVH = q.shape[1], k.shape[1]
    if KVH == 0 or H % KVH:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads KVH={KVH}")
    if q.shape[-1] == 0:
        raise ValueError(f"attention: head dim D=0 (q {tuple(q.shape)}): q, k, v hold no features")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"attention needs floating-point tensors, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def _check_triton(q: torch.Tensor) -> None:
    if q.dtype not in _DTYPES:
        raise ValueError(f"the Triton attention kernel takes fp16, bf16 or fp32, got {q.dtype} "
                         "(use backend='torch' for fp64)")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernel supports head dim D <= {MAX_HEAD_DIM}, got D={q.shape[-1]}")


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None,
              return_lse: bool = False, backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention; q (B, H, T_q, D), k/v (B, KVH, T_k, D) -> (B, H, T_q, D) in q's dtype.
    ``scale`` defaults to 1/sqrt(D); causal is bottom-right aligned. ``return_lse=True`` also returns the
    (B, H, T_q) fp32 log-sum-exp in natural-log units (-inf for rows that see no key).
    q, k, v may be strided views (e.g. ``x.view(B, T, H, D).transpose(1, 2)``): the Triton path reads them in
    place, and stores the output in q's memory order, as SDPA's flash path does."""
    _check(q, k, v)
    scale = _v.scale("attention", scale)  # None, or finite and > 0
    # auto on a GPU: SDPA where it was faster (minite/choices.py); not for the LSE (the reference's is an fp32 pass)
    if resolve_backend(q, backend, op=None if return_lse else "attention") == "triton":
        _check_triton(q)
        o, lse = AttentionFunction.apply(q, k, v, causal, scale, None, 0)
        return (o, lse) if return_lse else o
    return attention_ref(q, k, v, causal, scale, return_lse)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, causal: bool = True,
                     scale: float | None = None, return_lse: bool = False,
                     backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Packed variable-length attention in Transformer Engine's thd layout: q (total, H, D), k/v (total, KVH, D),
    sequence b is tokens cu_seqlens[b] : cu_seqlens[b+1] (int32, (B + 1,), starting at 0). No padding is computed
    and no token attends across sequences. LSE, when asked for, is (H, total) fp32."""
    _check(q, k, v, varlen=True)
    scale = _v.scale("attention_varlen", scale)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        what = (tuple(cu_seqlens.shape), cu_seqlens.dtype) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of B + 1 offsets, got {what}")
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or cu[-1] != q.shape[0] or min(lens) < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to total tokens {q.shape[0]}, got {cu}")
    if max(lens) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence ({max(lens)})")
    if resolve_backend(q, backend) == "triton":
        _check_triton(q)
        cu_dev = cu_seqlens.to(device=q.device, dtype=torch.int32)
        o, lse = AttentionFunction.apply(q, k, v, causal, scale, cu_dev, int(max_seqlen))
        return (o, lse) if return_lse else o
    outs = [attention_ref(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
                          causal, scale, return_lse) for a, b in zip(cu[:-1], cu[1:])]  # (1, H, T_b, D) each
    o = torch.cat([(x[0] if return_lse else x)[0].transpose(0, 1) for x in outs])  # (total, H, D)
    return (o, torch.cat([x[1][0] for x in outs], dim=-1)) if return_lse else o

def attention_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, n_head: int, n_kv_head: int, *, causal: bool = True,
                  scale: float | None = None, backend: str | None = None) -> Tensor:
    """RoPE and attention on the output of a fused qkv projection, the GPT's layout, with no copy in or out.

    qkv (B, T, (H + 2 KVH) D): per token, H query heads, then KVH key heads, then KVH value heads. cos/sin (T, D/2):
    the RoPE angles of positions 0 .. T-1 (``RotaryEmbedding.cos[:T]``). Returns o (B, T, H, D), stored densely, so
    ``o.view(B, T, H * D)`` feeds the output projection. The Triton path's backward returns d(qkv) as one buffer."""
    _v.tensor("attention_qkv", "qkv", qkv, floating=True)
    H, KVH = n_head, n_kv_head
    if qkv.dim() != 3 or KVH <= 0 or H % KVH or qkv.shape[-1] % (H + 2 * KVH):
        raise ValueError(f"attention_qkv: qkv must be (B, T, (H + 2 KVH) D) with H % KVH == 0, got shape "
                         f"{tuple(qkv.shape)}, H={H}, KVH={KVH}")
    B, T, N = qkv.shape
    D = N // (H + 2 * KVH)
    if D % 2 or tuple(cos.shape) != (T, D // 2) or cos.shape != sin.shape:
        raise ValueError(f"attention_qkv: cos/sin must be (T, D/2) = ({T}, {D // 2}) with D even, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    scale = _v.scale("attention_qkv", scale)
    if qkv.stride(-1) != 1 or qkv.stride(0) != T * N and B > 1 or qkv.stride(1) != N and T > 1:
        qkv = qkv.contiguous()  # views of it must address (B, T, heads, D)
    if resolve_backend(qkv, backend, op="attention") == "triton":  # auto on a GPU: SDPA where it was faster
        _check_triton(qkv.view(B, T, H + 2 * KVH, D))
        cos, sin = cos.contiguous(), sin.contiguous()  # one row stride for both
        return QKVAttentionFunction.apply(qkv, cos, sin, H, KVH, causal, scale)[0]
    x = qkv.view(B, T, H + 2 * KVH, D)
    q, k = (_rope.rope_ref(t, cos, sin, layout="bthd") for t in (x[:, :, :H], x[:, :, H:H + KVH]))
    o = attention_ref(q.transpose(1, 2), k.transpose(1, 2), x[:, :, H + KVH:].transpose(1, 2), causal, scale)
    return o.transpose(1, 2)  # (B, T, H, D)



# ----------------------------------------------------------------------------------------------- 6. Module
class Attention(nn.Module):
    """Parameter-free module around ``attention`` (the projections live in ``CausalSelfAttention``)."""

    def __init__(self, causal: bool = True, scale: float | None = None, backend: str | None = None):
        super().__init__()
        self.causal, self.scale, self.backend = causal, scale, backend

    def forward(self, q, k, v):
        return attention(q, k, v, causal=self.causal, scale=self.scale, backend=self.backend)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, backend={self.backend!r}"
