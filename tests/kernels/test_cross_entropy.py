"""Cross-entropy and fused linear-cross-entropy (chapter 06): kernels vs reference, reference vs F.cross_entropy,
gradcheck, counted peak memory, bad input."""
import pytest
import torch
import torch.nn.functional as F

from minite.bytecount import PeakBytes
from minite.kernels.cross_entropy import (
    LinearCrossEntropy,
    cross_entropy,
    cross_entropy_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
from minite.testing import assert_close, check_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _data(N, V, dtype, seed=0, ignore=(1,), ignore_index=-100, scale=3.0, device="cpu"):
    """(logits, target) from a seeded CPU generator (the same numbers on every device), then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(N, V, generator=g)).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    for i in ignore:
        if i < N:
            target[i] = ignore_index
    return logits.to(device), target.to(device)


def _ce_triton(logits, target, **kw):
    return cross_entropy(logits, target, backend="triton", **kw)


# ------------------------------------------------------------------------------------------------ kernel
@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("N, V", [(5, 37), (4, 128), (3, 8195)])  # odd, power of two, several blocks
def test_kernel_matches_reference(N, V, reduction, dtype, device):
    logits, target = _data(N, V, dtype, device=device)
    # output (the fp32 loss) and dlogits in the logits dtype
    assert check_op("cross_entropy", _ce_triton, cross_entropy_ref, logits, target, reduction=reduction)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_gpt2_vocab_and_smoothing(dtype, device):
    # the padded GPT-2 vocabulary: 7 blocks of 8192 per row
    logits, target = _data(2, 50304, dtype, ignore=(), device=device)
    assert check_op("ce V=50304", _ce_triton, cross_entropy_ref, logits, target, label_smoothing=0.1,
                    ignore_index=7)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loss_is_fp32_from_half_logits(dtype, device):
    logits, target = _data(4, 33, dtype, device=device)
    assert _ce_triton(logits, target).dtype == torch.float32
    assert cross_entropy_ref(logits, target).dtype == torch.float32
    assert _ce_triton(logits, target, reduction="none").dtype == torch.float32


@pytest.mark.triton
def test_online_logsumexp_is_stable(device):
    # Huge logits: a naive sum(exp(x)) overflows; the running max keeps it finite.
    logits, target = _data(3, 300, torch.float32, scale=1e4, ignore=(), device=device)
    loss = _ce_triton(logits, target, reduction="none")
    assert torch.isfinite(loss).all()
    assert_close(loss, F.cross_entropy(logits.double(), target, reduction="none").float(), name="loss(1e4 logits)")


@pytest.mark.triton
def test_strided_rows_padded_vocab(device):
    # Logits of a vocabulary padded to 64 (V=100 -> 128): a view of the first 100 columns, row stride 128.
    padded, target = _data(4, 128, torch.float32, ignore=(), device=device)
    target = target % 100
    view = padded[:, :100]
    assert check_op("ce strided", _ce_triton, cross_entropy_ref, view, target)


@pytest.mark.triton
def test_gradcheck_fp64(device):
    # few inputs: every one costs two kernel launches
    logits, target = _data(3, 5, torch.float64, ignore=(1,), device=device)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: _ce_triton(z, target, label_smoothing=0.2), (x,))
    assert torch.autograd.gradcheck(lambda z: _ce_triton(z, target, reduction="none"), (x,))


@pytest.mark.triton
def test_gradient_is_softmax_minus_one_hot(device):
    # Independent check of the kernel's backward: d(sum loss)/dx = softmax(x) - one_hot(t), 0 on ignored rows.
    logits, target = _data(5, 20, torch.float64, ignore=(2,), device=device)
    x = logits.requires_grad_()
    _ce_triton(x, target, reduction="sum").backward()
    expected = torch.softmax(logits.detach(), -1) - F.one_hot(target.clamp(min=0), 20)
    expected[2] = 0.0
    assert_close(x.grad, expected, name="dlogits")


# ---------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_reference_matches_torch(reduction, label_smoothing, ignore_index):
    logits, target = _data(7, 11, torch.float32, ignore=(0, 4), ignore_index=ignore_index)
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, theirs = cross_entropy_ref(x1, target, **kw), F.cross_entropy(x2, target, **kw)
    assert_close(ours, theirs, name="loss")
    up = torch.rand_like(ours)
    ours.backward(up)
    theirs.backward(up)
    assert_close(x1.grad, x2.grad, name="dlogits")


# ----------------------------------------------------------------------------------- fused linear-CE
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_ce_matches_naive(backend, dtype, reduction, device):
    g = torch.Generator().manual_seed(5)
    N, C, V = 13, 16, 37  # 13 rows in chunks of 5: the last chunk is short
    x = torch.randn(N, C, generator=g).to(dtype).to(device)
    w = (0.3 * torch.randn(V, C, generator=g)).to(dtype).to(device)
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    t = t.to(device)

    def fused(x, w, t, **kw):
        return linear_cross_entropy(x, w, t, chunk_size=5, backend=backend, **kw)

    # loss, dx and dW against cross_entropy(x @ W.T); dW is accumulated in fp32 over chunks, so it is at least
    # as accurate as the naive bf16 matmul it is compared with.
    assert check_op("linear_ce", fused, linear_cross_entropy_ref, x, w, t, reduction=reduction, label_smoothing=0.1)


@pytest.mark.triton
def test_linear_ce_gradcheck_fp64(device):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, dtype=torch.float64, generator=g).to(device).requires_grad_()
    w = torch.randn(5, 2, dtype=torch.float64, generator=g).to(device).requires_grad_()
    t = torch.tensor([1, -100, 4], device=device)  # two chunks of 2 and 1 rows, one ignored row
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t, chunk_size=2, backend="triton"),
                                    (x, w))


@pytest.mark.triton
def test_linear_ce_frozen_weight_and_module(device):
    torch.manual_seed(7)
    head = LinearCrossEntropy(8, 21, chunk_size=3, backend="triton").to(device)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 8, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 21, (7,), generator=g).to(device)
    head.weight.requires_grad_(False)
    loss = head(x, t)
    loss.backward()
    assert head.weight.grad is None
    x2 = x.detach().clone().requires_grad_()
    linear_cross_entropy_ref(x2, head.weight, t).backward()
    assert_close(x.grad, x2.grad, name="dx with a frozen head")
    assert "vocab=21" in repr(head)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
def test_linear_ce_under_no_grad_skips_the_gradient_work(backend, monkeypatch, device):
    # ctx.needs_input_grad follows requires_grad, not grad mode: under no_grad (evaluation) the fused head must
    # not compute dlogits, dx or dW. Count the backward work and look at what the forward produced.
    import minite.kernels.cross_entropy as CE
    seen = {"cross_entropy_bwd": 0, "_ce_chunk_torch": 0, "grads": []}

    def counted(name):
        real = getattr(CE, name)

        def wrapper(*a, **k):
            seen[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(CE, name, wrapper)
    counted("cross_entropy_bwd")
    counted("_ce_chunk_torch")
    real_fwd = CE.linear_cross_entropy_fwd

    def fwd(*a, **k):
        out = real_fwd(*a, **k)
        seen["grads"].append(out[1:])  # (dx, dW) as the forward computed them
        return out
    monkeypatch.setattr(CE, "linear_cross_entropy_fwd", fwd)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 8, generator=g).to(device).requires_grad_()
    w = torch.randn(21, 8, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 21, (7,), generator=g)
    t[2] = -100
    t = t.to(device)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, chunk_size=3, label_smoothing=0.1, backend=backend)
    assert seen["cross_entropy_bwd"] == seen["_ce_chunk_torch"] == 0 and seen["grads"] == [(None, None)], seen
    assert not loss.requires_grad
    assert_close(loss, linear_cross_entropy_ref(x.detach(), w.detach(), t, label_smoothing=0.1), name="no_grad loss")
    with_grad = linear_cross_entropy(x, w, t, chunk_size=3, label_smoothing=0.1, backend=backend)
    # grad mode on: one dlogits computation per chunk (3 chunks of 3, 3, 1 rows), dx and dW computed
    assert seen["cross_entropy_bwd"] + seen["_ce_chunk_torch"] == 3 and all(d is not None for d in seen["grads"][1])
    assert_close(loss, with_grad.detach(), name="no_grad vs grad-mode loss")


def _peak(fn, N, C, V, dtype=torch.bfloat16, device="meta"):
    x = torch.randn(N, C, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(V, C, dtype=dtype, device=device, requires_grad=True)
    t = torch.zeros(N, dtype=torch.long, device=device)
    with PeakBytes() as pb:
        fn(x, w, t).backward()
    return pb.peak


def test_peak_bytes_counter_counts():
    with PeakBytes() as pb:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        del a, b
        c = torch.empty(10, dtype=torch.float64)  # 80 bytes, after the 4000 were freed
    assert pb.peak == 4000 and pb.now == 80
    del c


def test_linear_ce_peak_memory_3x_below_naive_gpt2():
    # B*T = 8192 rows, C = 768, V = 50304, bf16, counted on the meta device. The fused path is measured on its
    # reference chunk step (torch ops on a (chunk, V) tile); the Triton step allocates less than that.
    N, C, V = 8192, 768, 50304
    naive = _peak(linear_cross_entropy_ref, N, C, V)
    fused = _peak(lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=1024, backend="torch"), N, C, V)
    assert naive >= N * V * (2 + 4)  # at least the bf16 logits and their fp32 log-softmax
    assert naive >= 3 * fused, f"naive {naive / 2**30:.2f} GiB vs fused {fused / 2**30:.2f} GiB"


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad, match", [
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long)), r"target shape \(3,\) != \(4,\)"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4)), "target dtype torch.float32 must be int64"),
    (lambda: cross_entropy(torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long)), r"must be 2-D.*\(2, 4, 5\)"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 5, 2])), r"target\[2\] = 5 is out of range"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.tensor([0, -1, 0, 2])), r"target\[1\] = -1 is out of range"),
    (lambda: cross_entropy(torch.empty(1, 2**31, device="meta"), torch.zeros(1, dtype=torch.long, device="meta")),
     "V=2147483648 is too large"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), reduction="avg"), "reduction='avg'"),
    (lambda: cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), label_smoothing=1.5),
     r"label_smoothing must be .* <= 1.0, got 1.5"),
    (lambda: cross_entropy(torch.ones(4, 5, dtype=torch.long), torch.zeros(4, dtype=torch.long)), "torch.int64 is not"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long)),
     r"x \(4, 8\) must be \(N, C\) and weight \(10, 7\)"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                  reduction="none"), "reduction='none' is not supported"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                                  chunk_size=0), "chunk_size=0"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8).half(), torch.zeros(4, dtype=torch.long)),
     "weight .torch.float16"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.full((4,), 10)),
     r"target\[0\] = 10 is out of range \[0, 10\)"),
])
def test_bad_input_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


# ----------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_linear_ce_peak_memory():
    N, C, V = 4096, 768, 50304
    x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (N,), device="cuda")
    peaks = []
    for fn in (linear_cross_entropy_ref, lambda a, b, c: linear_cross_entropy(a, b, c, backend="triton")):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, w, t).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        x.grad = w.grad = None
    assert peaks[0] >= 3 * peaks[1], peaks


def test_linear_ce_module_state_dict_keys_and_round_trip():
    # The exact key set (a rename breaks checkpoints): one weight (V, C), the layout of nn.Linear(C, V).weight.
    sd = LinearCrossEntropy(8, 21).state_dict()
    assert list(sd) == ["weight"] and sd["weight"].shape == (21, 8)
    torch.manual_seed(0)
    a = LinearCrossEntropy(8, 21, backend="torch")
    torch.manual_seed(1)
    b = LinearCrossEntropy(8, 21, backend="torch")
    x, t = torch.randn(5, 8), torch.randint(0, 21, (5,))
    assert a(x, t) != b(x, t)  # different init: the round trip below has something to do
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x, t), b(x, t))
