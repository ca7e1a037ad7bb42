"""Flash attention (chapter 07): the Triton kernels against naive attention in fp64, with FlagAttention's
tolerance rule; the reference against an explicit formula; LSE, GQA/MQA, T_q != T_k, empty rows, packed
sequences, GPU-legal tiles, input errors, and a 3-step training run on the Triton path."""
import math

import pytest
import torch

from minite.kernels import _common as C
from minite.kernels.attention import _tiles, attention, attention_ref, attention_varlen
from minite.testing import assert_close, dtype_tols

pytestmark = pytest.mark.usefixtures("one_thread")


def _rand(*shape, seed, dtype=torch.float32, device="cpu"):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    return t.requires_grad_()


def _naive(q, k, v, causal, scale=None):
    """softmax(q k^T scale + bottom-right causal mask) v, computed in q's dtype (fp64 for the reference)."""
    B, H, Tq, D = q.shape
    Tk, g = k.shape[2], H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, T_k, D): head h uses kv head h // g
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D) if scale is None else scale)  # (B, H, T_q, T_k)
    if causal:
        s = s.masked_fill(~torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq), float("-inf"))
    p = s.float().softmax(-1).to(q.dtype) if q.dtype == torch.float16 and q.device.type == "cpu" else s.softmax(-1)
    return torch.nan_to_num(p) @ v, s  # rows with no key: 0


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def _check_flag_rule(q, k, v, causal, name, scale=None):
    """FlagAttention's rule: |kernel - fp64| <= 2 |torch at input precision - fp64| (+ the dtype's atol as a floor:
    in fp32 both errors are a few ulp and the factor alone would compare rounding noise with rounding noise)."""
    do = _rand(*q.shape, seed=99, dtype=q.dtype, device=q.device).detach()
    o = attention(q, k, v, causal=causal, scale=scale, backend="triton")
    got = (o, *_grads(o, (q, k, v), do))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = _naive(q64, k64, v64, causal, scale)[0]
    ref = (o64, *_grads(o64, (q64, k64, v64), do.double()))
    ot = _naive(q, k, v, causal, scale)[0]  # PyTorch, same math, input precision
    low = (ot, *_grads(ot, (q, k, v), do))
    floor = dtype_tols(q.dtype)["atol"]
    for what, a, r, t in zip(("out", "dq", "dk", "dv"), got, ref, low):
        assert not torch.isnan(a).any(), f"{name}: NaN in {what}"
        err, err_torch = (a.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert err <= 2 * err_torch + floor, f"{name} {what}: kernel err {err:.3g} > 2 x torch err {err_torch:.3g}"


# (B, H, KVH, T_q, T_k, D, causal, dtype): every T in {1, 7, 33, 200}, D in {16, 32, 64, 128}, GQA 1/2/4 + MQA
CASES = [
    (1, 2, 2, 1, 1, 16, True, torch.float32),
    (2, 2, 2, 7, 7, 32, False, torch.float32),
    (1, 4, 2, 33, 33, 64, True, torch.float16),
    (1, 4, 1, 33, 33, 16, False, torch.float16),     # MQA
    (1, 4, 1, 200, 200, 32, True, torch.float32),     # MQA, several key blocks, block skipping
    (1, 2, 2, 200, 200, 16, False, torch.float16),
    (1, 8, 2, 7, 7, 128, True, torch.float16),        # GQA 4, the D = 128 tiles
    (1, 2, 1, 33, 33, 128, False, torch.float32),
    (2, 4, 4, 7, 33, 64, True, torch.float32),        # T_q < T_k: the KV-cache prefill shape
    (1, 4, 2, 33, 7, 32, True, torch.float16),        # T_q > T_k: the first rows see no key
    (1, 2, 2, 1, 200, 64, True, torch.float16),       # decode: one query, many keys
    (1, 4, 2, 40, 5, 16, False, torch.float32),
]


@pytest.mark.triton
@pytest.mark.parametrize("B,H,KVH,Tq,Tk,D,causal,dtype", CASES)
def test_kernel_matches_fp64_under_flag_attention_rule(device, B, H, KVH, Tq, Tk, D, causal, dtype):
    q = _rand(B, H, Tq, D, seed=1, dtype=dtype, device=device)
    k, v = _rand(B, KVH, Tk, D, seed=2, dtype=dtype, device=device), _rand(B, KVH, Tk, D, seed=3, dtype=dtype,
                                                                            device=device)
    _check_flag_rule(q, k, v, causal, f"B{B} H{H}/{KVH} T{Tq}x{Tk} D{D} causal={causal} {dtype}")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_views_read_in_place(device, dtype):
    # q, k, v as (B, H, T, D) views of (B, T, heads, D) memory with room between tokens (a qkv projection's
    # layout), do a transposed view too: the kernels take each tensor's strides. Same o, dq, dk, dv as dense
    # inputs, o stored in q's (B, T, H, D) order, and no copy of q, k, v (the launcher reads them in place).
    B, T, H, KVH, D = 2, 37, 4, 2, 16
    base = _rand(B, T, H + 2 * KVH + 1, D, seed=5, dtype=dtype, device=device).detach()  # one spare head
    q, k, v = (base[:, :, a:b].transpose(1, 2).requires_grad_() for a, b in ((0, H), (H, H + KVH),
                                                                              (H + KVH, H + 2 * KVH)))
    assert not q.is_contiguous() and q.stride(2) == (H + 2 * KVH + 1) * D
    do = _rand(B, T, H, D, seed=6, dtype=dtype, device=device).detach().transpose(1, 2)
    o = attention(q, k, v, backend="triton")
    assert o.shape == (B, H, T, D) and o.transpose(1, 2).is_contiguous()  # (B, T, H, D) memory
    got = (o, *_grads(o, (q, k, v), do))
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    od = attention(*dense, backend="triton")
    want = (od, *_grads(od, dense, do.contiguous()))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.triton
@pytest.mark.parametrize("dtype,causal", [(torch.float32, True), (torch.float16, True), (torch.float32, False)])
def test_attention_qkv_matches_rope_and_reference(device, dtype, causal):
    # The GPT's path: RoPE + attention on the fused qkv, d(qkv) in one buffer, against RoPE + the fp64 naive
    # attention under FlagAttention's rule (through _check_flag_rule on the rotated q, k) and the torch path.
    from minite.kernels.attention import attention_qkv
    from minite.kernels.rope import rope_cos_sin, rope_ref
    B, T, H, KVH, D = 2, 41, 4, 2, 32
    qkv = _rand(B, T, (H + 2 * KVH) * D, seed=7, dtype=dtype, device=device)
    cos, sin = (c.to(device) for c in rope_cos_sin(T, D))
    do = _rand(B, T, H, D, seed=8, dtype=dtype, device=device).detach()
    o = attention_qkv(qkv, cos, sin, H, KVH, causal=causal, backend="triton")
    assert o.shape == (B, T, H, D) and o.is_contiguous()
    (dqkv,) = _grads(o, (qkv,), do)

    def ref(x, dt):  # rope_ref + naive attention in dtype dt
        x4 = x.view(B, T, H + 2 * KVH, D)
        q, k = (rope_ref(x4[:, :, a:b], cos, sin, layout="bthd") for a, b in ((0, H), (H, H + KVH)))
        return _naive(*(t.transpose(1, 2).to(dt) for t in (q, k, x4[:, :, H + KVH:])), causal)[0].transpose(1, 2)
    x64 = qkv.detach().double().requires_grad_()
    o64 = ref(x64, torch.float64)
    (d64,) = _grads(o64, (x64,), do.double())
    xt = qkv.detach().clone().requires_grad_()
    ot = ref(xt, dtype)
    (dt,) = _grads(ot, (xt,), do)
    floor = dtype_tols(dtype)["atol"]
    for what, a, r, t in (("o", o, o64, ot), ("dqkv", dqkv, d64, dt)):
        err, err_t = (a.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert err <= 2 * err_t + floor, f"{what}: kernel err {err:.3g} > 2 x torch err {err_t:.3g}"
    assert_close(o, attention_qkv(qkv, cos, sin, H, KVH, causal=causal, backend="torch"), dtype=dtype, name="torch")


@pytest.mark.triton
def test_scale_and_odd_head_dim(device):
    # A scale that is not 1/sqrt(D), and D = 24 (padded to 32 inside the kernel with masked loads).
    q, k, v = (_rand(1, 2, 9, 24, seed=s, device=device) for s in (4, 5, 6))
    _check_flag_rule(q, k, v, True, "scale=0.3 D=24", scale=0.3)


@pytest.mark.triton
def test_bf16_upcast_path(device):
    # bf16 runs upcast to fp32 under the interpreter and as a bf16 tl.dot on the GPU: compare with fp32 kernel.
    q, k, v = (_rand(1, 4, 33, 32, seed=s, device=device) for s in (7, 8, 9))
    ref = attention(q, k[:, :2], v[:, :2], backend="triton")
    got = attention(*(t.to(torch.bfloat16) for t in (q, k[:, :2], v[:, :2])), backend="triton")
    assert got.dtype == torch.bfloat16
    assert_close(got, ref.to(torch.bfloat16), dtype=torch.bfloat16, name="bf16 vs fp32 kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_flag_rule_on_gpu(device, causal):
    q = _rand(2, 8, 256, 128, seed=1, dtype=torch.bfloat16, device=device)
    k, v = (_rand(2, 2, 256, 128, seed=s, dtype=torch.bfloat16, device=device) for s in (2, 3))
    _check_flag_rule(q, k, v, causal, f"bf16 gpu causal={causal}")


@pytest.mark.triton
@pytest.mark.parametrize("Tq,Tk,causal", [(33, 33, True), (7, 40, True), (40, 7, True), (33, 20, False)])
def test_lse_is_logsumexp_of_naive_scores(device, Tq, Tk, causal):
    q = _rand(2, 4, Tq, 32, seed=10, device=device)
    k, v = _rand(2, 2, Tk, 32, seed=11, device=device), _rand(2, 2, Tk, 32, seed=12, device=device)
    o, lse = attention(q, k, v, causal=causal, return_lse=True, backend="triton")
    s = _naive(q.detach().double(), k.detach().double(), v.detach().double(), causal)[1]  # (B, H, T_q, T_k)
    want = torch.logsumexp(s, -1)
    assert lse.shape == (2, 4, Tq) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want))  # -inf exactly where a row sees no key
    fin = torch.isfinite(want)
    assert_close(lse[fin].double(), want[fin], dtype=torch.float32, name="lse")
    o_ref, lse_ref = attention_ref(q, k, v, causal, None, return_lse=True)
    assert_close(lse, lse_ref, name="lse vs attention_ref")


@pytest.mark.triton
def test_rows_that_see_no_key_give_zero_and_finite_grads(device):
    # T_q > T_k, causal bottom-right: query rows 0..T_q-T_k-1 see no key. Output 0, LSE -inf, no NaN anywhere.
    q, k, v = _rand(1, 2, 20, 16, seed=1, device=device), *(_rand(1, 2, 4, 16, seed=s, device=device) for s in (2, 3))
    o, lse = attention(q, k, v, return_lse=True, backend="triton")
    assert torch.all(o[:, :, :16] == 0) and torch.all(lse[:, :, :16] == float("-inf"))
    assert torch.isfinite(lse[:, :, 16:]).all()
    dq, dk, dv = _grads(o, (q, k, v), torch.ones_like(o))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv)) and torch.all(dq[:, :, :16] == 0)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_pack_equals_per_sequence_runs(device, dtype):
    lens = [5, 0, 33, 1, 17]  # an empty sequence and a single token included
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = cu[-1].item()
    q, k, v = _rand(N, 4, 32, seed=1, dtype=dtype, device=device), *(
        _rand(N, 2, 32, seed=s, dtype=dtype, device=device) for s in (2, 3))
    do = _rand(N, 4, 32, seed=4, dtype=dtype, device=device).detach()
    o, lse = attention_varlen(q, k, v, cu.to(device), max(lens), return_lse=True, backend="triton")
    assert o.shape == (N, 4, 32) and lse.shape == (4, N)
    grads = _grads(o, (q, k, v), do)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == e:
            continue
        seq = [t[a:e].detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v)]  # (1, H, T_b, D)
        ob, lb = attention(*seq, return_lse=True, backend="triton")
        gb = _grads(ob, seq, do[a:e].transpose(0, 1)[None])
        tol = dtype_tols(dtype)
        assert_close(o[a:e], ob[0].transpose(0, 1), name=f"out of sequence {b}", **tol)
        assert_close(lse[:, a:e], lb[0], name=f"lse of sequence {b}")
        for n, g, gs in zip(("dq", "dk", "dv"), grads, gb):
            assert_close(g[a:e], gs[0].transpose(0, 1), name=f"{n} of sequence {b}", **tol)
    # The torch path of the varlen entry point is the per-sequence reference too.
    assert_close(attention_varlen(q, k, v, cu, max(lens), backend="torch"), o, dtype=dtype, name="varlen torch")


def _o_and_dq(fn, q, k, v, rows):
    """fn's output and dq when the loss sums the output over `rows` (a 0/1 mask broadcast over the output)."""
    q = q.detach().clone().requires_grad_()
    o = fn(q, k, v)
    (o * rows).sum().backward()
    return o.detach(), q.grad


@pytest.mark.triton
@pytest.mark.parametrize("case", ["varlen_gqa", "tq<tk", "tq>tk"])
def test_masked_nonfinite_kv_reach_only_the_rows_that_see_them(device, case):
    # A NaN in a future key or value must not change a row that cannot see it: was NaN there, from 0 * NaN in P V
    # (forward) and in dS = P (dP - Delta), dS K (dQ). Rows that see it are NaN. Packed sequences with GQA (a bad k
    # in one kv head, a bad v in the other) and both bottom-right shapes; clean rows must be bit-identical.
    nan = float("nan")
    if case == "varlen_gqa":  # sequences of 90 and 60 tokens; bad key 40 of the first and 20 of the second
        cu = torch.tensor([0, 90, 150], dtype=torch.int32, device=device)
        q, k, v = _rand(150, 4, 16, seed=1, device=device), *(_rand(150, 2, 16, seed=s, device=device) for s in (2, 3))
        kb, vb = k.detach().clone(), v.detach().clone()
        kb[40, 0, 3], vb[40, 1, 5], vb[110, :, 2] = nan, nan, nan
        t = torch.arange(150, device=device)
        sees = ((t >= 40) & (t < 90)) | (t >= 110)  # (150,) token sees its sequence's bad key

        def fn(q, k, v):
            return attention_varlen(q, k, v, cu, 90, backend="triton")
        sees = sees[:, None, None]
    else:  # bottom-right: query i sees key j <= i + T_k - T_q
        Tq, Tk, p = (30, 100, 85) if case == "tq<tk" else (100, 40, 10)
        dtype = torch.float16 if case == "tq<tk" else torch.float32
        q, k, v = _rand(1, 2, Tq, 16, seed=1, dtype=dtype, device=device), *(
            _rand(1, 2, Tk, 16, seed=s, dtype=dtype, device=device) for s in (2, 3))
        kb, vb = k.detach().clone(), v.detach().clone()
        vb[0, 0, p, 5], kb[0, 1, p, 1] = nan, nan
        sees = (torch.arange(Tq, device=device) + Tk - Tq >= p)[:, None]  # (T_q, 1)

        def fn(q, k, v):
            return attention(q, k, v, backend="triton")
    o_ok, dq_ok = _o_and_dq(fn, q, k.detach(), v.detach(), ~sees)
    o_bad, dq_bad = _o_and_dq(fn, q, kb, vb, ~sees)
    clean = ~sees.expand_as(o_ok)
    assert sees.any() and clean.any()
    assert torch.equal(o_bad[clean], o_ok[clean]) and torch.equal(dq_bad[clean], dq_ok[clean]), case
    assert torch.isnan(o_bad).any(-1)[sees.expand_as(o_ok)[..., 0]].all(), case  # every row that sees one: NaN


def test_tiles_are_legal():
    # Every tl.dot dimension >= 16 for every shape the launchers can see, on the GPU and on the interpreter, and on
    # the GPU no dot with fewer than 16 rows per warp along its M (keys for dK/dV, queries otherwise).
    for Tq in (1, 2, 7, 16, 33, 200, 4096):
        for Tk in (1, 5, 64, 1000):
            for D in (8, 16, 24, 64, 128):
                for kind in ("fwd", "dq", "dkdv"):
                    for dtype in (torch.float16, torch.float32):
                        for gpu in (False, True):
                            bm, bn, nw, ns = _tiles(kind, Tq, Tk, D, dtype, gpu)
                            what = (kind, Tq, Tk, D, dtype, gpu, bm, bn, nw)
                            assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0, what
                            assert not gpu or dtype == torch.float32 or \
                                nw * 16 <= max(64, bn if kind == "dkdv" else bm), what  # fp32: FMA dots
    # The sm_90 tiles at long sequences (bf16/fp16), checked against the faithful compile in
    # the gate (minite/gpu_examples.py's attention): the forward at D = 64 and 128, dQ 128 queries, dK/dV 128 keys.
    assert _tiles("fwd", 4096, 4096, 64, torch.bfloat16, True) == (128, 128, 8, 3)
    assert _tiles("fwd", 4096, 4096, 128, torch.bfloat16, True) == (128, 64, 8, 3)
    assert _tiles("dq", 4096, 4096, 128, torch.float16, True) == (128, 32, 8, 3)
    assert _tiles("dkdv", 4096, 4096, 128, torch.bfloat16, True) == _tiles("dkdv", 4096, 4096, 64, torch.bfloat16,
                                                                            True) == (32, 128, 8, 3)


@pytest.mark.triton
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_tiles_on_the_interpreter(device, causal, monkeypatch):
    # The tiles a GPU runs (128-row dQ and forward, 128-key dK/dV), on T = 300: main blocks, diagonal blocks and a
    # ragged tail in every kernel, GQA 2, D = 64 (no padded columns: the main loops' unmasked loads).
    monkeypatch.setattr(C.CAPTURE_GPU, "on", True, raising=False)
    q = _rand(1, 2, 300, 64, seed=1, dtype=torch.float16, device=device)
    k, v = (_rand(1, 1, 300, 64, seed=s, dtype=torch.float16, device=device) for s in (2, 3))
    _check_flag_rule(q, k, v, causal, f"GPU tiles D=64 T=300 causal={causal}")


# ------------------------------------------------------------------------- reference and input checking
def test_reference_matches_explicit_formula():
    for H, KVH, Tq, Tk, causal in [(4, 4, 7, 7, True), (4, 2, 7, 7, False), (6, 1, 5, 9, True), (2, 2, 9, 5, True)]:
        q = _rand(2, H, Tq, 16, seed=0).detach()
        k, v = _rand(2, KVH, Tk, 16, seed=1).detach(), _rand(2, KVH, Tk, 16, seed=2).detach()
        want = _naive(q.double(), k.double(), v.double(), causal)[0].float()
        assert_close(attention_ref(q, k, v, causal), want, name=f"ref H{H}/{KVH} T{Tq}x{Tk}")
        assert_close(attention(q, k, v, causal=causal, backend="torch"), want, name="torch backend")


def test_bad_inputs_name_the_values():
    q, k = torch.randn(1, 6, 5, 8), torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="H=6 must be a multiple of key/value heads KVH=4"):
        attention(q, k, k)
    with pytest.raises(ValueError, match=r"4-D \(B, H, T, D\)"):
        attention(q[0], k[0], k[0])
    with pytest.raises(ValueError, match="same shape"):
        attention(q, k, k[..., :4])
    with pytest.raises(ValueError, match="dtypes differ"):
        attention(q, q.half(), q)
    with pytest.raises(ValueError, match="unknown backend 'tritn'"):
        attention(q, q, q, backend="tritn")
    with pytest.raises(ValueError, match=r"\(total_tokens, H, D\) thd"):
        attention_varlen(q, q, q, torch.tensor([0, 5], dtype=torch.int32), 5)
    x = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match=r"rise from 0 to total tokens 10, got \[0, 4, 9\]"):
        attention_varlen(x, x, x, torch.tensor([0, 4, 9], dtype=torch.int32), 5)
    with pytest.raises(ValueError, match=r"max_seqlen=5 is shorter than the longest sequence \(6\)"):
        attention_varlen(x, x, x, torch.tensor([0, 4, 10], dtype=torch.int32), 5)


@pytest.mark.triton
def test_triton_rejects_what_it_cannot_run(device):
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64).to(device)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32, got torch.float64"):
        attention(x, x, x, backend="triton")
    y = torch.randn(1, 2, 5, 160).to(device)
    with pytest.raises(ValueError, match="head dim D <= 128, got D=160"):
        attention(y, y, y, backend="triton")
    if device.type == "cuda":
        with pytest.raises(ValueError, match="different devices"):
            attention(y, y.cpu(), y.cpu())


def test_forced_triton_where_triton_cannot_run_raises(monkeypatch):
    import minite.backend
    monkeypatch.setattr(minite.backend, "interpreting", lambda: False)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="backend='triton' was forced but cannot run"):
        attention(q, q, q, backend="triton")
    assert torch.equal(attention(q, q, q), attention_ref(q, q, q))  # "auto" falls back silently


# ---------------------------------------------------------------------------- the GPT trains on the kernel
@pytest.mark.triton
def test_train_cli_with_triton_attention_matches_sdpa(tmp_path, make_corpus, monkeypatch, device):
    # `python -m minite.train --model.backend=triton` on the interpreter: 3 steps, losses equal to the SDPA run.
    from minite import train as mtrain
    from minite.kernels import attention as att
    make_corpus(tmp_path / "corpus.txt", n_chars=4000, marks=".")
    launches = []
    real = att.attention_qkv_fwd  # the GPT's op: RoPE + attention on the fused qkv projection
    monkeypatch.setattr(att, "attention_qkv_fwd", lambda *a, **k: launches.append(1) or real(*a, **k))
    losses, train_fn = {}, mtrain.train
    for be in ("torch", "triton"):
        argv = ["--data", str(tmp_path / "corpus.txt"), f"--out_dir={tmp_path / be}", f"--model.backend={be}",
                "--data.data_dir=" + str(tmp_path / "data"), "--model.n_layer=1", "--model.n_head=2",
                "--model.n_kv_head=1", "--model.n_embd=32", "--model.block_size=16", "--train.batch_size=2",
                "--train.max_iters=3", "--train.eval_interval=100", "--train.eval_iters=1", "--train.log_interval=1",
                "--train.warmup_iters=1", "--train.threads=1", "--train.progress=false", "--train.sample_tokens=0",
                f"--train.device={device.type}", "--train.precision=fp32", "--train.compile=off"]
        losses[be] = []
        monkeypatch.setattr(mtrain, "train", _record(train_fn, losses[be]))
        assert mtrain.main(argv) == 0
    assert launches and len(losses["triton"]) == 3
    # AdamW amplifies per-op fp32 rounding a little over 3 steps (it divides by sqrt(v)): 10x the fp32 tolerance.
    tol = {k: 10 * v for k, v in dtype_tols(torch.float32).items()}
    assert_close(torch.tensor(losses["triton"]), torch.tensor(losses["torch"]), name="losses triton vs SDPA", **tol)


def _record(train_fn, out):
    def wrapped(*a, **k):
        s = train_fn(*a, **k)
        out.extend(s["losses"][i] for i in sorted(s["losses"]))
        return s
    return wrapped


@pytest.mark.triton
def test_bwd_launcher_accepts_strided_o_and_lse(device):
    # Context parallelism hands attention_bwd slices of a bigger o / lse. The kernels index with dense
    # strides, so the launcher must make them contiguous: a strided view gives the same dq, dk, dv.
    from minite.kernels.attention import attention_bwd, attention_fwd
    q = _rand(1, 2, 24, 16, seed=1, device=device).detach()
    k, v = (_rand(1, 2, 24, 16, seed=s, device=device).detach() for s in (2, 3))
    do = _rand(1, 2, 24, 16, seed=4, device=device).detach()
    o, lse = attention_fwd(q, k, v, True, None)
    o_big = torch.zeros(1, 2, 24, 2 * 16, device=device)
    o_big[..., 1::2] = o                                 # o_big[..., 1::2]: last-dim stride 2
    lse_big = torch.full((1, 2, 2 * 24), 123.0, device=device)
    lse_big[..., ::2] = lse                              # lse_big[..., ::2]: stride 2
    o_nc, lse_nc = o_big[..., 1::2], lse_big[..., ::2]
    assert not o_nc.is_contiguous() and not lse_nc.is_contiguous()
    want = attention_bwd(do, q, k, v, o, lse, True)
    got = attention_bwd(do, q, k, v, o_nc, lse_nc, True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), name
