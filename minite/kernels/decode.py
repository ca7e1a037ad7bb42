"""Split-KV decode attention (chapter 08), "flash-decoding": one new query token per sequence against its cache.

    o[b, h] = softmax(q[b, h] . K[b, g, :len_b]^T * scale) V[b, g, :len_b]        g = h // (H / KVH)

At decode time T_q = 1: a FlashAttention grid of (T_q / BLOCK_M) x B x H programs has only B x H programs, far
fewer than an H100's 132 SMs when B is small, and each program streams the whole cache alone. Flash-decoding
splits the keys into S chunks and runs B x KVH x S programs in parallel, each writing a partial output O_s and its
log-sum-exp L_s; a second kernel merges them exactly:

    m = max_s L_s,   L = m + log sum_s exp(L_s - m),   O = sum_s exp(L_s - L) O_s

GQA: the GROUP = H / KVH query heads that share kv head g are packed as rows of one tile (padded to 16 rows, the
GPU's minimum tl.dot size), so each K/V block is loaded once for the whole group: the cache is read once per step.

Short contexts take one pass (S = 1): the partial kernel then writes the final output itself, and no merge kernel
runs. Up to SINGLE_PASS_MAX_LEN keys one program per (b, g) streams the whole context in about the time of the
merge kernel's launch; past it the splits' parallelism pays for the second launch.
"""
from __future__ import annotations

import math

import torch

from minite import _validate as _v
from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import launchable, op, register_op, sm_count

__all__ = ["decode_attention_ref", "decode_attention", "num_splits_heuristic", "lse_merge_ref", "SINGLE_PASS_MAX_LEN"]

# The longest context attended in one pass when the caller leaves num_splits to the launcher (and by
# minite.decoding's CUDA-graph step). Unmeasured estimate for batch 1 on an H100/H200: one program streams a kv
# head's K and V (L * D * 4 bytes in bf16, 128 KB at L = 512, D = 64) at ~30-60 GB/s, 2-4 us, about what the
# merge kernel's launch and the partials' round trip cost; longer contexts are split (flash-decoding).
SINGLE_PASS_MAX_LEN = 512

# The sm_90 gate (minite/gpu_compile.py) asks why a dot is not on wgmma: decoding has one query token per head.
MMA_SYNC_OK = {"_decode_partial_kernel": "M is the GROUP = H / KVH query heads of one kv head (4 in the GPT), "
               "padded to 16 rows: a 64-row wgmma tile would be >= 75 % padding, and the kernel is bound by reading "
               "K and V, not by its dots"}


# ------------------------------------------------------------------------------------------ 1. reference
def decode_attention_ref(q, k_cache, v_cache, lengths, scale: float | None = None):
    """q (B, H, D), caches (B, KVH, T_max, D), lengths (B,) valid keys per sequence -> (B, H, D) in q's dtype.
    GQA by a view, not a copy: the G = H / KVH query heads of kv head g are q.view(B, KVH, G, D)[:, g]."""
    B, H, D = q.shape
    KVH = k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k, v = k_cache.float(), v_cache.float()  # (B, KVH, T_max, D)
    s = torch.einsum("bkgd,bktd->bkgt", q.float().view(B, KVH, H // KVH, D), k) * scale  # (B, KVH, G, T_max)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < lengths.to(q.device)[:, None]  # (B, T_max)
    p = torch.nan_to_num(s.masked_fill(~keep[:, None, None], float("-inf")).softmax(-1))  # length 0 -> zeros
    # Past its length a sequence's cache holds anything (a reused cache, NaN included): p = 0 there, but 0 * NaN
    # is NaN in p @ v, so those values are zeroed, not only given zero weight.
    v = v.masked_fill(~keep[:, None, :, None], 0.0)  # (B, KVH, T_max, D)
    return torch.einsum("bkgt,bktd->bkgd", p, v).reshape(B, H, D).to(q.dtype)


def lse_merge_ref(o_parts: torch.Tensor, lse_parts: torch.Tensor):
    """Merge S partial results: o_parts (..., S, D), lse_parts (..., S) natural log -> (o (..., D), lse (...))."""
    m = lse_parts.amax(-1, keepdim=True)  # (..., 1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # every part empty: avoid -inf - -inf
    w = torch.exp(lse_parts - m)  # (..., S), exp(L_s - m) <= 1
    tot = w.sum(-1, keepdim=True)
    o = (w[..., None] * o_parts).sum(-2) / torch.where(tot == 0, 1.0, tot)
    return o, (m + torch.log(tot)).squeeze(-1)


# -------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _decode_partial_kernel(Q, K, V, LEN, O_PART, L_PART, H, KVH, T_MAX, D, CHUNK, qk_scale,
                           GROUP: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr):
    # Grid (B * KVH, S): program (b*KVH + g, s) attends the GROUP query heads of kv head g to keys
    # [s * CHUNK, (s + 1) * CHUNK) of sequence b, and writes normalised partial O (fp32) and its LSE (ln).
    # One pass (S = 1, WRITE_LSE False): O_PART is the output (B, H, D) itself, in its dtype; no LSE, no merge.
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a Python float as fp64: keep m_i fp32
    bg = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    S = tl.num_programs(1)
    b, g = bg // KVH, bg % KVH
    # Clamped to [0, T_max]: a length past the cache must never become a read past it. The functional checks the
    # lengths when they are on the CPU; on CUDA reading them would cost a host sync per step (see _validate.lengths).
    n_keys = tl.minimum(tl.maximum(tl.load(LEN + b).to(tl.int64), 0), T_MAX)
    rows = tl.arange(0, BLOCK_G)  # query heads g*GROUP ... (padded to >= 16 rows for tl.dot)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok, d_ok = rows < GROUP, offs_d < D
    heads = g * GROUP + rows
    q = tl.load(Q + (b * H + heads[:, None]) * D + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_base = (b * KVH + g) * T_MAX * D  # cache (B, KVH, T_max, D), contiguous
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = s * CHUNK
    # The last split runs to the sequence's end: a max_len below a length then costs parallelism, never keys.
    hi = tl.where(s == S - 1, n_keys, tl.minimum(lo + CHUNK, n_keys))
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < hi) & d_ok[None, :]
        k = tl.load(K + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BD)
        v = tl.load(V + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (BLOCK_G, BLOCK_N) group scores, log2
        sc = tl.where(cols[None, :] < hi, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    empty = l_i == 0.0  # this chunk holds no key of sequence b (past its length): LSE -inf, O 0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    part = (b * H + heads) * S + s  # partials (B, H, S, D) and (B, H, S)
    tl.store(O_PART + part[:, None] * D + offs_d[None, :], o.to(O_PART.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(L_PART + part, lse, mask=r_ok)


@triton.jit
def _lse_merge_kernel(O_PART, L_PART, O, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Grid (B * H,): merge the S partials of one (b, h) row: m = max L_s, w_s = exp(L_s - m), O = sum w_s O_s / sum w_s
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(L_PART + row * S + offs_s, mask=offs_s < S, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every chunk empty (length 0): weights all 0, output 0
    w = tl.exp(lse - m)
    tot = tl.sum(w, 0)
    o = tl.load(O_PART + (row * S + offs_s[:, None]) * D + offs_d[None, :],
                mask=(offs_s[:, None] < S) & (offs_d[None, :] < D), other=0.0)  # (BLOCK_S, BLOCK_D)
    out = tl.sum(w[:, None] * o, 0) / tl.where(tot == 0.0, 1.0, tot)
    tl.store(O + row * D + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)


# ------------------------------------------------------------------------------------------ 3. launchers
def num_splits_heuristic(n_programs: int, n_sms: int, n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention's wave-efficiency rule. With n_programs = B * KVH already filling >= 80 % of the SMs, do not
    split. Otherwise try S = 1 .. : a launch of n_programs * S programs runs in ceil(waves) waves, waves =
    n_programs * S / n_sms, and its efficiency is waves / ceil(waves). Take the smallest S within 85 % of the best
    efficiency (fewer splits = less merge work), never more splits than key blocks."""
    if n_programs >= 0.8 * n_sms:
        return 1
    cands = range(1, max(1, min(max_splits, n_sms, n_blocks)) + 1)
    eff = {s: (n_programs * s / n_sms) / math.ceil(n_programs * s / n_sms) for s in cands}
    best = max(eff.values())
    return next(s for s in cands if eff[s] >= 0.85 * best)


# torch.ops.minite.decode_attention (no autograd): CUDA-graph decoding keeps the split-K kernels in its graph.
@register_op("decode_attention")
def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                            scale: float | None = None, num_splits: int | None = None,
                            max_len: int | None = None) -> torch.Tensor:
    """Launch partial + merge, or one pass. q (B, H, D); caches (B, KVH, T_max, D) contiguous; lengths (B,) int on
    q's device (any integer dtype: no cast kernel). max_len: an upper bound of lengths known on the host (the cache
    keeps one), default T_max. num_splits: None chooses one pass up to SINGLE_PASS_MAX_LEN keys, else the wave
    heuristic; 1 is one pass (the output written by the partial kernel, no merge). No argument checks here
    (torch.compile and CUDA graphs call this directly): bad values cost speed, never a read past the cache."""
    B, H, D = q.shape
    KVH, T_max = k_cache.shape[1], k_cache.shape[2]
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    max_len = T_max if max_len is None else max(1, min(max_len, T_max))
    BLOCK_N = 64 if D <= 64 else 32
    n_blocks = triton.cdiv(max_len, BLOCK_N)
    if num_splits:
        S = max(1, num_splits)
    else:
        S = 1 if max_len <= SINGLE_PASS_MAX_LEN else num_splits_heuristic(B * KVH, sm_count(q.device), n_blocks)
    chunk = triton.cdiv(n_blocks, S) * BLOCK_N  # whole key blocks per split
    S = triton.cdiv(max_len, chunk)
    o = torch.empty_like(q)  # (B, H, D)
    # one pass: the partial kernel writes o itself ((B, H, 1, D) is o's layout) and no LSE. l_part is then a dummy
    # of its own, not o: torch.compile's functional form of the launch would clone each written argument apart.
    o_part = o if S == 1 else torch.empty((B, H, S, D), dtype=torch.float32, device=q.device)  # (B, H, S, D)
    l_part = torch.empty((B, H, S) if S > 1 else (1,), dtype=torch.float32, device=q.device)  # (B, H, S)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    launchable(_decode_partial_kernel)[(B * KVH, S)](
        q, k_cache, v_cache, lengths.to(q.device), o_part, l_part, H, KVH, T_max, D, chunk, scale * 1.4426950408889634,
        GROUP=H // KVH, UPCAST=q.dtype == torch.bfloat16 and interpreting(),
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_G=max(16, triton.next_power_of_2(H // KVH)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, WRITE_LSE=S > 1)
    if S == 1:
        return o
    launchable(_lse_merge_kernel)[(B * H,)](o_part, l_part, o, S, D, BLOCK_S=max(2, triton.next_power_of_2(S)),
                                            BLOCK_D=BLOCK_D)
    return o


# -------------------------------------------------------------------------------------------- 5. functional
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *,
                     scale: float | None = None, num_splits: int | None = None, max_len: int | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """One decode step: q (B, H, D) against k/v caches (B, KVH, T_max, D), of which sequence b holds lengths[b]
    valid keys (the new token's included). Returns (B, H, D) in q's dtype. Inference only (no autograd).

    lengths: an integer tensor, each in [0, T_max]; max_len, when given, >= every length. Values are checked when
    lengths is on the CPU (as minite's KVCache passes them); on CUDA the kernel clamps them instead of syncing."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _v.tensor("decode_attention", name, t, floating=True)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: q (B, H, D) and caches (B, KVH, T_max, D) expected, got q "
                         f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    B, H, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D or k_cache.shape[1] == 0 or H % k_cache.shape[1]:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} "
                         "(batch, head dim, or H not a multiple of KVH)")
    if D == 0:
        raise ValueError("decode_attention: head dim D=0: q and the caches hold no features")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"decode_attention: q, k_cache, v_cache must share dtype and device, got "
                         f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype} on {q.device}/{k_cache.device}/{v_cache.device}")
    T_max = k_cache.shape[2]
    max_len = _v.lengths("decode_attention", lengths, B, T_max, max_len)
    scale = _v.scale("decode_attention", scale)
    if num_splits is not None:
        _v.integer("decode_attention", "num_splits", num_splits, lo=1)
    if resolve_backend(q, backend) == "triton" and q.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and D <= 128:
        lens = lengths.to(q.device)  # checked on the CPU (if it was there), then copied: B ints, no sync
        return op("decode_attention", decode_attention_triton)(q, k_cache, v_cache, lens, scale, num_splits, max_len)
    # Read only the filled part of the cache, where max_len was checked against the lengths (CPU lengths).
    n = T_max if max_len is None or lengths.device.type != "cpu" else max_len
    return decode_attention_ref(q, k_cache[:, :, :n], v_cache[:, :, :n], lengths, scale)
