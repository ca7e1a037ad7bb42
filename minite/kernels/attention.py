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
the tiles of the diagonal key blocks only, the one place a key is masked for some rows (``_fwd_block``).
Layouts: "bhsd" (B, H, T, D) for ``attention``; "thd" (total_tokens, H, D) with ``cu_seqlens`` for
``attention_varlen`` (Transformer Engine's packed format: no padding, nothing computed across sequences).
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

__all__ = ["attention_ref", "attention", "attention_varlen", "attention_fwd", "attention_bwd",
           "AttentionFunction", "Attention", "MAX_HEAD_DIM"]

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
    they clean the diagonal blocks only, under a branch (``_fwd_block``, ``_dq_block``)."""
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
def _rows(b, h, start, NH, T, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Element offset of token `start` of head h of sequence b, and the stride between tokens.
    #   bhsd (B, NH, T, D):      ((b * NH + h) * T + t) * D,   token stride D
    #   thd  (total, NH, D):     ((start + t) * NH + h) * D,   token stride NH * D
    if VARLEN:
        return (start * NH + h) * HEAD_DIM, NH * HEAD_DIM
    else:
        return (b * NH + h) * T * HEAD_DIM, HEAD_DIM


@triton.jit
def _lse_row(b, h, start, H, T_Q, VARLEN: tl.constexpr):
    # LSE and Delta: (B, H, T_q) for bhsd, (H, total) for thd (T_Q is then the total token count)
    if VARLEN:
        return h * T_Q + start
    else:
        return (b * H + h) * T_Q


@triton.jit
def _fwd_block(q, K, V, kv_base, kv_st, n0, offs_m, offs_n, offs_d, d_ok, Tk, off, qk_scale, m_i, l_i, acc,
               diag, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # One key block of the online softmax. `diag`: the block holds keys that some rows of the tile must not see.
    cols = n0 + offs_n
    kv_mask = (cols[:, None] < Tk) & d_ok[None, :]
    k = tl.load(K + kv_base + cols[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BD)
    v = tl.load(V + kv_base + cols[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    # A masked key has p = 0, and P V would form 0 * NaN from a non-finite v_j: on the diagonal, v_j is zeroed and
    # s_ij made NaN for every i (kept where row i sees key j, -inf from the mask below where it does not). Finite
    # inputs: bad = 0, nothing changes. Two spellings, the one with fewer sm_90 spills per dot kind (tests/kernels/
    # test_attention_sm90.py): tensor cores (tf32/fp16/bf16) through k, fp32's FMA dot through s.
    if CAUSAL and PREC != "ieee":
        if diag:
            bad = v - v  # 0 where v is finite, NaN where it is NaN or inf
            k = k + bad
            v = tl.where(bad == 0.0, v, tl.zeros_like(v))
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N) scores, log2 units
    if CAUSAL and PREC == "ieee":
        if diag:
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
    return m_new, l_i, acc


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, CU, T_Q, T_K, H, KVH, D, qk_scale,
                     GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                     PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid (cdiv(T_q, BLOCK_M), B * H): program (i, b*H + h) owns query rows i*BLOCK_M ... of head h of sequence b.
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a Python float as fp64: keep the state fp32
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    q_base, q_st = _rows(b, h, start, H, T_Q, VARLEN, HEAD_DIM)
    kv_base, kv_st = _rows(b, h // GROUP, start, KVH, T_K, VARLEN, HEAD_DIM)  # GQA: GROUP q heads per kv head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key columns within a block
    offs_d = tl.arange(0, BLOCK_D)  # D padded to a power of two >= 16 (tl.dot's minimum on the GPU)
    m_ok, d_ok = offs_m < Tq, offs_d < D
    q = tl.load(Q + q_base + offs_m[:, None] * q_st + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # bf16 under the interpreter: its arithmetic is wrong there, so compute in fp32
        q = q.to(tl.float32)
    # Online softmax state, in log2 units (qk_scale = scale * log2(e), so exp2 replaces exp):
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(s - m_i) @ V, normalised at the end
    off = Tk - Tq  # bottom-right causal: row i sees keys j <= i + off
    hi = Tk
    if CAUSAL:  # causal block skipping: key blocks right of the diagonal hold no visible key, never load them
        hi = tl.minimum(Tk, tl.maximum(pid_m * BLOCK_M + BLOCK_M + off, 0))
    hi = tl.where(pid_m * BLOCK_M < Tq, hi, 0)  # packed batch: this sequence may be shorter than the grid
    diag0 = hi  # key blocks from diag0 on hold keys in the future of some rows of the tile (none if not causal)
    if CAUSAL:
        diag0 = tl.maximum(pid_m * BLOCK_M + off + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, hi, BLOCK_N):
        m_i, l_i, acc = _fwd_block(q, K, V, kv_base, kv_st, n0, offs_m, offs_n, offs_d, d_ok, Tk, off, qk_scale,
                                   m_i, l_i, acc, n0 >= diag0, CAUSAL, UPCAST, PREC)
    empty = l_i == 0.0  # rows that saw no key
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # 0 for empty rows
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)  # ln
    tl.store(O + q_base + offs_m[:, None] * q_st + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + _lse_row(b, h, start, H, T_Q, VARLEN) + offs_m, lse, mask=m_ok)


@triton.jit
def _attn_bwd_pre_kernel(O, DO, DELTA, CU, T_Q, H, D, VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    # Delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the term the softmax backward subtracts. Grid as forward.
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    start, Tq, _ = _seq(CU, b, T_Q, T_Q, VARLEN)
    base, st = _rows(b, h, start, H, T_Q, VARLEN, HEAD_DIM)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    ptr = base + offs_m[:, None] * st + offs_d[None, :]
    o = tl.load(O + ptr, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + _lse_row(b, h, start, H, T_Q, VARLEN) + offs_m, tl.sum(o * do, 1), mask=offs_m < Tq)


# Backward (derived in the notebook). With P recomputed from the LSE, P = exp(S*scale - LSE):
#   dV = P^T dO      dP = dO V^T      dS = P * (dP - Delta),  Delta = rowsum(dO * O)
#   dQ = dS K * scale                 dK = dS^T Q * scale
# dK/dV sum over query rows, dQ over key columns: two kernels, each owning the rows it writes, so no atomics.
# GQA: the dK/dV program of kv head g also loops over the GROUP query heads that read g and sums their terms.
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, T_Q, T_K, H, KVH, D, qk_scale, scale,
                          GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                          PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid (cdiv(T_k, BLOCK_N), B * KVH): program owns BLOCK_N keys of kv head g; loops over queries.
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 under Inductor
    pid_n = tl.program_id(0).to(tl.int64)
    bg = tl.program_id(1).to(tl.int64)
    b, g = bg // KVH, bg % KVH
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    kv_base, kv_st = _rows(b, g, start, KVH, T_K, VARLEN, HEAD_DIM)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < D)
    k = tl.load(K + kv_base + offs_n[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BD)
    v = tl.load(V + kv_base + offs_n[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    off = Tk - Tq
    lo = 0
    if CAUSAL:  # queries above the first one that sees key pid_n*BLOCK_N see none of this block: skip them
        lo = tl.maximum(pid_n * BLOCK_N - off, 0) // BLOCK_M * BLOCK_M
    hi = tl.where(pid_n * BLOCK_N < Tk, Tq, 0)
    for j in range(0, GROUP):
        h = g * GROUP + j
        q_base, q_st = _rows(b, h, start, H, T_Q, VARLEN, HEAD_DIM)
        l_base = _lse_row(b, h, start, H, T_Q, VARLEN)
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q_mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
            q = tl.load(Q + q_base + offs_m[:, None] * q_st + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + q_base + offs_m[:, None] * q_st + offs_d[None, :], mask=q_mask, other=0.0)
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            lse2 = tl.load(LSE + l_base + offs_m, mask=offs_m < Tq, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + l_base + offs_m, mask=offs_m < Tq, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M) = (S^T), log2
            keep = (offs_n[:, None] < Tk) & (offs_m[None, :] < Tq)
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + off)
            p_t = tl.where(keep, tl.exp2(s_t - lse2[None, :]), 0.0)  # P^T, recomputed; where, not *: no inf*0
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)  # dV += P^T dO
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)  # (dO V^T)^T
            ds_t = p_t * (dp_t - delta[None, :])  # dS^T
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)  # dK += dS^T Q (times scale below)
    tl.store(DK + kv_base + offs_n[:, None] * kv_st + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + kv_base + offs_n[:, None] * kv_st + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_block(q, do, K, V, kv_base, kv_st, n0, offs_m, offs_n, offs_d, Tq, Tk, D, off, qk_scale, lse2, delta, dq,
              diag, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    # One key block of dQ; `diag` as in _fwd_block. A masked entry has P = 0, and dS = P (dP - Delta) is NaN when
    # v_j is not finite (dP = dO V^T), dS K forms 0 * NaN when k_j is not: dS is masked with where, k_j zeroed on
    # the diagonal, and a row that sees a bad k_j still gets NaN: through dP (tensor cores) or S (fp32), as above.
    cols = n0 + offs_n
    kv_mask = (cols[:, None] < Tk) & (offs_d[None, :] < D)
    k = tl.load(K + kv_base + cols[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_base + cols[:, None] * kv_st + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    if CAUSAL and PREC != "ieee":
        if diag:
            bad = k - k  # 0 where k is finite, NaN where not
            v = v + bad  # dP_ij NaN for every i: kept by the rows that see key j (dS NaN), masked in the others
            k = tl.where(bad == 0.0, k, tl.zeros_like(k))
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    keep = (cols[None, :] < Tk) & (offs_m[:, None] < Tq)
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None] + off)
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # dP = dO V^T
    ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)  # where, not P = 0: 0 * NaN would be NaN
    if CAUSAL and PREC == "ieee":
        if diag:
            k = tl.where(k - k == 0.0, k, tl.zeros_like(k))
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)  # dQ += dS K (times scale below)


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, T_Q, T_K, H, KVH, D, qk_scale, scale,
                        GROUP: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                        PREC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid as the forward: program owns BLOCK_M query rows of head h and loops over the keys they see.
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # fp64 under Inductor
    pid_m = tl.program_id(0).to(tl.int64)
    b, h = tl.program_id(1).to(tl.int64) // H, tl.program_id(1).to(tl.int64) % H
    start, Tq, Tk = _seq(CU, b, T_Q, T_K, VARLEN)
    q_base, q_st = _rows(b, h, start, H, T_Q, VARLEN, HEAD_DIM)
    kv_base, kv_st = _rows(b, h // GROUP, start, KVH, T_K, VARLEN, HEAD_DIM)
    l_base = _lse_row(b, h, start, H, T_Q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    q = tl.load(Q + q_base + offs_m[:, None] * q_st + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + q_base + offs_m[:, None] * q_st + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse2 = tl.load(LSE + l_base + offs_m, mask=offs_m < Tq, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + l_base + offs_m, mask=offs_m < Tq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    off = Tk - Tq
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, tl.maximum(pid_m * BLOCK_M + BLOCK_M + off, 0))
    hi = tl.where(pid_m * BLOCK_M < Tq, hi, 0)
    diag0 = hi
    if CAUSAL:
        diag0 = tl.maximum(pid_m * BLOCK_M + off + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, hi, BLOCK_N):
        dq = _dq_block(q, do, K, V, kv_base, kv_st, n0, offs_m, offs_n, offs_d, Tq, Tk, D, off, qk_scale, lse2,
                       delta, dq, n0 >= diag0, CAUSAL, UPCAST, PREC)
    tl.store(DQ + q_base + offs_m[:, None] * q_st + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)


# ------------------------------------------------------------------------------------------ 3. launchers
def _blocks(T_q: int, T_k: int, D: int, bwd: bool = False, fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): GPU-legal tiles (every tl.dot dim >= 16) used on the CPU too, so the
    interpreter tests run the configuration an H100 compiles. 128x64 forward tiles as in the Triton tutorial;
    the backward holds two (BLOCK, D) fp32 accumulators, so it takes 64x64 (32 rows at D = 128). fp32 at D > 64
    halves them (the sm_80 gate: 128x64 took 225 KiB of shared memory, 64x64 176 KiB, over an A100's 163 KiB)."""
    wide32 = fp32 and D > 64
    bm, bn = (32 if bwd and D > 64 else 64 if bwd or wide32 else 128), (32 if wide32 else 64)
    bm = min(bm, max(16, triton.next_power_of_2(T_q)))  # short sequences (decode, T = 1): one small tile
    bn = min(bn, max(16, triton.next_power_of_2(T_k)))
    return bm, bn, 8 if D > 64 else 4  # D = 128: two (BLOCK, 128) fp32 accumulators need 8 warps of registers


def _meta(q: torch.Tensor, k: torch.Tensor, causal: bool, varlen: bool) -> dict:
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


@C.register_op("attention_fwd")  # torch.ops.minite.attention_fwd, for torch.compile (section 4)
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
                  cu_seqlens: Tensor | None = None, max_seqlen: int = 0) -> tuple[Tensor, Tensor]:
    """Launch the forward. bhsd: q (B, H, T_q, D), k/v (B, KVH, T_k, D) -> o like q, lse (B, H, T_q) fp32.
    thd (cu_seqlens given): q (total, H, D), k/v (total, KVH, D) -> o like q, lse (H, total) fp32."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, KVH, Tq, Tk, Mq, Mk = _dims(q, k, cu_seqlens, max_seqlen)
    D, o = q.shape[-1], torch.empty_like(q)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lse = torch.empty((H, Tq) if cu_seqlens is not None else (B, H, Tq), dtype=torch.float32, device=q.device)
    bm, bn, nw = _blocks(Mq, Mk, D, fp32=q.dtype == torch.float32)
    if o.numel():
        C.launchable(_attn_fwd_kernel)[(triton.cdiv(Mq, bm), B * H)](
            q, k, v, o, lse, cu_seqlens if cu_seqlens is not None else q, Tq, Tk, H, KVH, D, scale * LOG2E,
            **_meta(q, k, causal, cu_seqlens is not None), BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
    return o, lse


@C.register_op("attention_bwd")
def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True,
                  scale: float | None = None, cu_seqlens: Tensor | None = None,
                  max_seqlen: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward: Delta, then dK/dV (one program per key block and kv head), then dQ. -> dq, dk, dv."""
    do, q, k, v, o, lse = (t.contiguous() for t in (do, q, k, v, o, lse))  # kernels assume dense strides
    (B, H, KVH, Tq, Tk, Mq, Mk), D = _dims(q, k, cu_seqlens, max_seqlen), q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if not (q.numel() and k.numel()):
        return dq.zero_(), dk.zero_(), dv.zero_()
    cu = cu_seqlens if cu_seqlens is not None else q
    meta = _meta(q, k, causal, cu_seqlens is not None)
    delta = torch.empty_like(lse)
    bm, bn, nw = _blocks(Mq, Mk, D, bwd=True, fp32=q.dtype == torch.float32)
    grid_q, grid_k = (triton.cdiv(Mq, bm), B * H), (triton.cdiv(Mk, bn), B * KVH)
    C.launchable(_attn_bwd_pre_kernel)[grid_q](o, do, delta, cu, Tq, H, D, VARLEN=meta["VARLEN"], HEAD_DIM=D,
                                               BLOCK_D=meta["BLOCK_D"], BLOCK_M=bm)
    args = (cu, Tq, Tk, H, KVH, D, scale * LOG2E, scale)
    C.launchable(_attn_bwd_dkdv_kernel)[grid_k](q, k, v, do, lse, delta, dk, dv, *args, **meta, BLOCK_M=bm,
                                                BLOCK_N=bn, num_warps=nw)
    C.launchable(_attn_bwd_dq_kernel)[grid_q](q, k, v, do, lse, delta, dq, *args, **meta, BLOCK_M=bm, BLOCK_N=bn,
                                              num_warps=nw)
    return dq, dk, dv


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
        dq, dk, dv = C.op("attention_bwd", attention_bwd)(do.contiguous(), q, k, v, o, lse, causal, scale, cu_seqlens,
                                                          max_seqlen)
        return dq, dk, dv, None, None, None, None


C.register_autograd("attention_fwd", AttentionFunction.backward, setup_context=AttentionFunction.setup_ctx)


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
    (B, H, T_q) fp32 log-sum-exp in natural-log units (-inf for rows that see no key)."""
    _check(q, k, v)
    scale = _v.scale("attention", scale)  # None, or finite and > 0
    if resolve_backend(q, backend) == "triton":
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
