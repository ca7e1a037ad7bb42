"""Grouped GEMM (chapter 16): the Triton kernel (forward, dx, dw) vs the loop reference on uneven and empty groups,
the tile table, the GPU tile shapes run under the interpreter, the reference vs a per-row formula, bad input."""
import re

import pytest
import torch

from minite.kernels import grouped_gemm as gg
from minite.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref, tile_table
from minite.testing import check_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# rows per expert (odd, empty experts, one big group), then rows past the last expert (dropped tokens)
GROUPS = [([5, 0, 17, 3], 2), ([0, 0, 0], 4), ([33], 0), ([1, 2, 0, 40, 0], 3)]


def _problem(counts, extra, K, N, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = sum(counts) + extra
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(len(counts), K, N, generator=g) / K ** 0.5).to(dtype).to(device)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist()).to(device)
    return x, w, offsets


def _triton(x, w, offsets):
    return grouped_gemm(x, w, offsets, backend="triton")


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty filled with NaN: the kernels store every element of y, dx and dw (no zero-fill); one they miss
    (a dropped row, an empty expert's dw) would show as NaN instead of an accidental 0."""
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", GROUPS)
def test_kernel_matches_reference(groups, dtype, device, nan_empty):
    x, w, offsets = _problem(*groups, K=19, N=37, dtype=dtype, device=device)
    assert check_op("grouped_gemm", _triton, grouped_gemm_ref, x, w, offsets)  # y, dx, dw


@pytest.mark.triton
def test_rows_past_the_last_expert_are_zero_with_zero_grad(device, nan_empty):
    x, w, offsets = _problem([4, 6], 5, K=16, N=16, dtype=torch.float32, device=device)
    x.requires_grad_()
    y = _triton(x, w, offsets)
    assert y[10:].abs().max().item() == 0.0 and y[:10].abs().min().item() > 0  # the last row of expert 1 is kept
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx[10:].abs().max().item() == 0.0 and dx[:10].abs().sum().item() > 0


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_tiles_under_the_interpreter(device, monkeypatch, nan_empty, dtype):
    # The GPU's own tiles (what _tiles picks on CUDA: 128 x 256 x 64 in grouped order for fp16) must be correct
    # too, not only the small CPU tiles: an expert over two row tiles, an empty one, dropped rows, a K loop.
    from minite.kernels import _common
    monkeypatch.setattr(_common.CAPTURE_GPU, "on", True, raising=False)
    x, w, offsets = _problem([130, 0, 7, 1], 3, K=70, N=20, dtype=dtype, device=device)
    assert gg._tiles(141, 20, 70, x) == (gg.GPU_TILES if dtype == torch.float16 else gg.GPU_TILES_F32)
    assert check_op("grouped_gemm GPU tiles", _triton, grouped_gemm_ref, x, w, offsets)


@pytest.mark.triton
def test_grouped_order_with_several_groups(device, monkeypatch, nan_empty):
    # 16-row tiles in groups of 2 over 3 column tiles, dw in groups over 3 k-tiles: the swizzle's partial last
    # group, spare slots between real ones in program order, and an expert whose tiles straddle two groups.
    monkeypatch.setattr(gg, "_tiles", lambda *a: (16, 16, 16, 2, 4, 1))
    x, w, offsets = _problem([5, 0, 40, 3, 0, 18], 21, K=40, N=37, dtype=torch.float32, device=device)
    assert check_op("grouped_gemm grouped order", _triton, grouped_gemm_ref, x, w, offsets)


@pytest.mark.parametrize("counts, M, bm", [([5, 0, 17, 3], 27, 4), ([0, 0], 9, 4), ([4, 4], 8, 4),
                                           ([1, 1, 1], 40, 16), ([16, 1], 17, 16)])
def test_tile_table_covers_every_row_once(counts, M, bm):
    # Every row of expert e in exactly one tile of e; every row past o[E] (dropped) in exactly one zero tile
    # (expert E), which the spare slots always suffice for.
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    E = len(counts)
    expert, first = tile_table(offsets, M, bm)
    assert expert.numel() == -(-M // bm) + E  # cdiv(M, BLOCK_M) + E slots
    seen = []
    for e, r in zip(expert.tolist(), first.tolist()):
        end = int(offsets[e + 1]) if e < E else M
        seen += [(row, e) for row in range(r, min(r + bm, end))]
    want = [(row, e) for e in range(E) for row in range(int(offsets[e]), int(offsets[e + 1]))]
    want += [(row, E) for row in range(int(offsets[E]), M)]
    assert sorted(seen) == sorted(want)


def test_reference_matches_per_row_matmul():
    x, w, offsets = _problem([3, 0, 6], 2, K=8, N=5, dtype=torch.float32, device="cpu")
    row_expert = torch.repeat_interleave(torch.arange(3), offsets.diff())  # (9,)
    want = torch.bmm(x[:9, None, :], w[row_expert]).squeeze(1)  # y[i] = x[i] @ w[e(i)]
    y = grouped_gemm_ref(x, w, offsets)
    torch.testing.assert_close(y[:9], want)
    assert y[9:].abs().max().item() == 0.0


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_no_rows_still_in_the_graph(backend, device):
    # An expert-parallel rank that receives no token must still run its backward all-to-alls: the output of an
    # empty grouped GEMM has to depend on x and w, and give them zero gradients.
    x, w, offsets = _problem([0, 0], 0, K=16, N=16, dtype=torch.float32, device=device)
    x.requires_grad_()
    w.requires_grad_()
    y = grouped_gemm(x, w, offsets, backend=backend)
    assert y.shape == (0, 16) and y.requires_grad
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.shape == (0, 16) and dw.abs().max().item() == 0.0


def test_bad_input():
    x, w, offsets = _problem([2, 2], 0, K=8, N=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="w \\(E, K, N\\)"):
        grouped_gemm(x, w.transpose(1, 2), offsets)
    with pytest.raises(ValueError, match="offsets must be an integer \\(E \\+ 1,\\) = \\(3,\\)"):
        grouped_gemm(x, w, offsets[:2])
    with pytest.raises(ValueError, match="x is torch.float32 but w is torch.float16"):
        grouped_gemm(x, w.half(), offsets)
    for bad in ([1, 2, 4], [0, 3, 2], [0, 2, 5]):  # not from 0, decreasing, past M = 4: would read out of bounds
        with pytest.raises(ValueError, match="offsets must start at 0.*got " + re.escape(str(bad))):
            grouped_gemm(x, w, torch.tensor(bad), backend="triton")


# ------------------------------------------------------------- the custom ops (torch.compile keeps the kernels)
def _ops(device, reference_ops):
    # CUDA: the minite:: triton_ops themselves; the CPU: the same bodies and formula as CPU ops (conftest.py)
    return torch.ops.minite if device.type == "cuda" else reference_ops()


@pytest.mark.triton
@pytest.mark.parametrize("case", ["fwd", "fwd_transposed_w", "dw"])
def test_opcheck(case, device, reference_ops):
    # Schema, fake impl vs the kernels, the registered gradient, AOT dispatch with dynamic shapes; uneven groups, an
    # empty expert and dropped rows.
    ops = _ops(device, reference_ops)
    x, w, offsets = _problem([5, 0, 9], 3, K=24, N=20, dtype=torch.float32, device=device)
    if case == "dw":
        dy = torch.randn(x.shape[0], 20, generator=torch.Generator().manual_seed(3)).to(device)
        torch.library.opcheck(ops.grouped_gemm_dw, (x, dy, offsets, torch.float32))
        return
    if case == "fwd_transposed_w":  # what the backward passes for dx: w[e]^T as a strided view
        x, w = torch.randn(x.shape[0], 20, generator=torch.Generator().manual_seed(4)).to(device), w.transpose(1, 2)
    torch.library.opcheck(ops.grouped_gemm_fwd, (x.requires_grad_(), w.requires_grad_(), offsets))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_op_fullgraph_matches_reference(ref_ops, dtype, device):
    # The registered formula under torch.compile(fullgraph=True): y, dx and dw against the loop of matmuls.
    from torch._dynamo.testing import CompileCounterWithBackend

    x, w, offsets = _problem([7, 0, 12, 1], 2, K=19, N=33, dtype=dtype, device=device)
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: ref_ops.grouped_gemm_fwd(x, w, offsets), fullgraph=True, backend=cnt)
    assert check_op("grouped_gemm op, fullgraph", f, lambda x, w: grouped_gemm_ref(x, w, offsets), x, w)
    assert cnt.frame_count == 1


@pytest.mark.triton
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_moe_layer_compiles_as_one_graph(ref_ops, monkeypatch, capacity_factor, device):
    # What torch.compile sees of a MoE layer on a GPU: routing, the load, capacity, permute, the grouped-GEMM ops,
    # unpermute, in ONE graph (it broke at the grouped GEMM, and at the CPU check's host read of the offsets); the
    # output and every gradient equal eager's. The grouped GEMM is the CPU op (conftest.py), SwiGLU the reference.
    from torch._dynamo.testing import CompileCounterWithBackend

    from minite.kernels.swiglu import swiglu_ref
    from minite.layers import moe as M

    monkeypatch.setattr(gg, "op", lambda name, fn: getattr(ref_ops, name) if torch.compiler.is_compiling() else fn)
    monkeypatch.setattr(M, "swiglu", lambda g, u, backend=None: swiglu_ref(g, u))
    torch.manual_seed(0)
    layer = M.MoE(32, 48, 4, 2, capacity_factor=capacity_factor, backend="triton")  # (the shared expert: mlp.py)
    with torch.no_grad():
        layer.router.weight.mul_(40)  # a skewed load: the capacity case drops assignments
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1)).to(device)
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=cnt)
    outs = []
    for f in (layer, compiled):
        xx = x.clone().requires_grad_()
        y = f(xx)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append([y.detach(), xx.grad, layer.aux_loss.detach(), layer.dropped] +
                    [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    assert cnt.frame_count == 1
    assert (int(outs[0][3]) > 0) == (capacity_factor > 0)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, **(dict(rtol=1e-5, atol=1e-6)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_layer_compiled_on_cuda_matches_eager():
    # The same on a GPU with the real minite:: triton_ops and Inductor: one graph, bf16, output and every gradient
    # as eager's within bf16's tolerance (Inductor fuses the routing's elementwise ops differently).
    from torch._dynamo.testing import CompileCounterWithBackend

    from minite.layers.moe import MoE
    from minite.testing import dtype_tols

    torch.manual_seed(0)
    layer = MoE(256, 512, 8, 2, capacity_factor=1.25, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 100, 256, device="cuda", dtype=torch.bfloat16)
    cnt = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    outs = []
    for f in (layer, torch.compile(layer, fullgraph=True, backend=cnt)):
        xx = x.clone().requires_grad_()
        y = f(xx)
        y.float().square().sum().backward()
        outs.append([y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    assert cnt.frame_count == 1
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, **dtype_tols(torch.bfloat16))
