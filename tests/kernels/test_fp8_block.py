"""The block-scaled FP8 GEMM (chapter 15): blockwise (1x128 x 128x128, and 128x1 columns) and MX (1x32 x 32x1),
against an fp64 reference on ragged shapes, at the interpreter's tiles and at the GPU's; and the linear layer's three
GEMMs under BlockwiseScaling / MXFP8Scaling (Triton == torch reference, and close to the exact product)."""
import pytest
import torch

from minite.formats import BlockwiseScaling, MXFP8Scaling
from minite.kernels import fp8_block as FB
from minite.kernels.fp8_block import block_scaled_gemm, block_scaled_gemm_ref, quantize_blockwise, quantize_mx
from minite.layers.linear import fp8_linear
from minite.testing import assert_close, fp8_dot_tolerance


def _x(shape, seed, device, spread=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10 ** (spread * (torch.rand(shape[-1], generator=g) - 0.5))
    return x.to(device)


def _operands(kind, M, K, N, device, b_cols=False):
    a, w = _x((M, K), 0, device), _x((N, K), 1, device)
    if kind == "mx":
        return quantize_mx(a), quantize_mx(w).t()                                  # B (K, N): 32 x 1 blocks
    qa = quantize_blockwise(a, (1, 128))
    if b_cols:  # B scaled per 128 x 1 column slice (the wgrad's x)
        return qa, quantize_blockwise(w, (1, 128)).t()
    return qa, quantize_blockwise(w, (128, 128)).t()                               # B (K, N): 128 x 128 tiles


def _errors(got, a, b):
    exact = block_scaled_gemm_ref(a, b, torch.float64)                             # fp64 of the dequantized values
    torch32 = block_scaled_gemm_ref(a, b, torch.float32)                           # the same math in fp32 torch
    return (got.double() - exact).abs().max().item(), (torch32.double() - exact).abs().max().item(), exact


@pytest.mark.triton
@pytest.mark.parametrize("kind, b_cols", [("blockwise", False), ("blockwise", True), ("mx", False)])
def test_block_scaled_gemm_matches_fp64(device, kind, b_cols):
    a, b = _operands(kind, 33, 200, 45, device, b_cols)                              # odd M, N; K = 128 + 72
    got = block_scaled_gemm(a, b, out_dtype=torch.float32)
    err, err32, exact = _errors(got, a, b)
    # DESIGN §7: within 2x the error of the same computation in fp32 PyTorch (+ an ulp of the output's size)
    assert err <= 2 * err32 + 1e-6 * exact.abs().max().item(), (err, err32)
    sk = a.block[1]
    tol = fp8_dot_tolerance(a.dequantize(torch.float32), b.dequantize(torch.float32), device=device, atol=1e-4,
                            rtol=1e-5, promote_every=sk)
    assert_close(got, exact.float(), name=f"{kind} gemm vs fp64", **tol)
    bf = block_scaled_gemm(a, b, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.float(), got, rtol=2 ** -7, atol=1e-3)


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["blockwise", "mx"])
def test_gpu_tiles_run_under_the_interpreter(device, kind):
    # The H100 configuration (128 x 128 tiles, BLOCK_K = the scale block) on a ragged problem: 2 x 1 programs.
    a, b = _operands(kind, 130, 160, 20, device)
    tiles = FB.GPU_TILES[a.block[1]]
    got = FB.block_scaled_gemm_fwd(a, b, torch.float32, tiles=tiles)
    err, err32, exact = _errors(got, a, b)
    assert err <= 2 * err32 + 1e-6 * exact.abs().max().item(), (err, err32)


def test_gpu_tiles_are_legal():
    for sk, (bm, bn, warps, stages) in FB.GPU_TILES.items():
        assert bm >= 16 and bn >= 16 and sk >= 32 and sk % 32 == 0    # fp8 tl.dot: K >= 32 (DESIGN §4)


@pytest.mark.triton
def test_mx_nan_scale_poisons_its_rows_only(device):
    x = _x((17, 64), 2, device)
    x[3, 40] = float("nan")
    a, b = quantize_mx(x), quantize_mx(_x((20, 64), 3, device)).t()
    got = block_scaled_gemm(a, b, out_dtype=torch.float32)
    assert torch.isnan(got[3]).all() and not torch.isnan(got[torch.arange(17) != 3]).any()


def test_gemm_refuses_mismatched_operands():
    a = quantize_blockwise(torch.randn(8, 64), (1, 32), backend="torch")
    m = quantize_mx(torch.randn(8, 64), backend="torch")
    with pytest.raises(ValueError, match=r"needs a scaled per \(1, SK\).*got a blockwise \(1, 32\), b mx \(32, 1\)"):
        block_scaled_gemm(a, m.t())
    with pytest.raises(ValueError, match="inner dimensions differ"):
        block_scaled_gemm(a, a)
    with pytest.raises(ValueError, match="must be a BlockScaledTensor"):
        block_scaled_gemm(a, torch.randn(64, 8))


# ------------------------------------------------------------------------------------------- the linear layer
RECIPES = [BlockwiseScaling(), MXFP8Scaling(), BlockwiseScaling(block=32, pow2=True)]


@pytest.mark.triton
@pytest.mark.parametrize("recipe", RECIPES, ids=["blockwise", "mxfp8", "blockwise32-pow2"])
def test_block_fp8_linear_triton_matches_torch_and_the_exact_gradients(device, recipe):
    x = _x((3, 7, 160), 4, device, spread=1).requires_grad_()
    w = (_x((40, 160), 5, device, spread=1) * 0.1).requires_grad_()
    b = _x((40,), 6, device).requires_grad_()
    dy = _x((3, 7, 40), 7, device)
    outs = {}
    for backend in ("triton", "torch"):
        y = fp8_linear(x, w, b, recipe=recipe, backend=backend)
        outs[backend] = (y, *torch.autograd.grad(y, (x, w, b), dy))
    exact = x.double() @ w.double().t() + b.double()
    want = (exact, *torch.autograd.grad(exact, (x, w, b), dy.double()))
    for name, t, r, e in zip(("y", "dx", "dw", "db"), outs["triton"], outs["torch"], want):
        # the same quantization math: the GEMMs differ only in summation order (+ the GPU's MMA accumulator)
        assert_close(t, r, name=f"{name} triton vs torch", atol=2e-3 if device.type == "cuda" else 1e-4, rtol=1e-4)
        rel = ((r.double() - e).norm() / e.norm()).item()        # FP8 E4M3 operands: a few percent of the exact
        assert rel < 0.05, (name, rel)


def test_block_recipes_keep_no_history():
    r = BlockwiseScaling()
    assert (r.kind, r.block, r.amax_history_len, r.delayed) == ("blockwise", 128, 1, False)
    assert (MXFP8Scaling().kind, MXFP8Scaling().block) == ("mx", 32)
    with pytest.raises(TypeError, match="pow2 must be a bool"):
        BlockwiseScaling(pow2="no")
    with pytest.raises(ValueError, match="min_dim"):
        MXFP8Scaling(min_dim=-1)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=["blockwise", "mxfp8"])
def test_block_fp8_linear_saves_x_in_fp8_for_the_wgrad(recipe):
    # the backward needs x only for dW, scaled along N: the forward keeps that FP8 copy, not x itself
    x = _x((4, 32, 128), 8, torch.device("cpu"), spread=1).requires_grad_()
    w = (_x((64, 128), 9, torch.device("cpu"), spread=1) * 0.1).requires_grad_()
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_linear(x, w, None, recipe=recipe, backend="torch")
    assert (x.dtype, x.numel()) not in saved, saved                       # no full-precision copy of x
    fp8 = [n for dt, n in saved if dt.itemsize == 1 and n == x.numel()]
    assert fp8, saved                                                     # its FP8 copy instead
    dy = _x((4, 32, 64), 10, torch.device("cpu"))
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(x.double() @ w.double().t(), (x, w), dy.double())
    for name, got, e in zip(("dx", "dw"), (dx, dw), want):
        assert ((got.double() - e).norm() / e.norm()).item() < 0.05, name
    # a frozen weight: no wgrad, so no copy of x at all; dx unchanged
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y2 = fp8_linear(x, w.detach(), None, recipe=recipe, backend="torch")
    assert not [n for dt, n in saved if n == x.numel()], saved
    (dx2,) = torch.autograd.grad(y2, (x,), dy)
    assert torch.equal(dx2, dx)


# ------------------------------------------------------------- the custom ops (torch.compile keeps the kernels)
def _ops(device, reference_ops):
    return torch.ops.minite if device.type == "cuda" else reference_ops()


@pytest.mark.triton
@pytest.mark.parametrize("case", ["quantize_rows", "quantize_tiles_pow2", "quantize_mx", "mm_blockwise", "mm_mx"])
def test_opcheck(case, device, reference_ops):
    # Schema, fake impl against the kernels, AOT dispatch with dynamic shapes; ragged last blocks, a transposed b.
    ops = _ops(device, reference_ops)
    x = _x((40, 96), 1, device, spread=1)
    if case.startswith("quantize"):
        br, bc, mx, p2 = {"quantize_rows": (1, 32, False, False), "quantize_tiles_pow2": (32, 32, False, True),
                          "quantize_mx": (1, 32, True, False)}[case]
        torch.library.opcheck(ops.block_quantize, (x, br, bc, mx, torch.float8_e4m3fn, p2),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        return
    r = BlockwiseScaling(block=32) if case == "mm_blockwise" else MXFP8Scaling()
    a = (quantize_blockwise(x, (1, 32), backend="triton") if r.kind == "blockwise"
         else quantize_mx(x, backend="triton"))
    w = _x((24, 96), 2, device, spread=1)  # b = w^T (96, 24): a transposed view, as the linear layer passes it
    b = (quantize_blockwise(w, (32, 32), backend="triton") if r.kind == "blockwise"
         else quantize_mx(w, backend="triton")).t()
    args = (a.data, b.data, a.scale, b.scale, a.block[1], b.block[1], r.kind == "mx", torch.float32)
    # no test_schema: it perturbs the inputs with arithmetic that fp8 tensors do not have on the CPU
    torch.library.opcheck(ops.block_scaled_mm, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.triton
@pytest.mark.parametrize("recipe", RECIPES[:2], ids=["blockwise", "mxfp8"])
def test_block_fp8_linear_fullgraph(ref_ops, monkeypatch, recipe, device):
    # minite.nn.Linear under a block recipe, compiled with fullgraph=True: the quantizes and the three GEMMs are
    # ops in one graph (the launchers were traced into before: FakeTensors handed to the kernels); the output and
    # every gradient equal eager's bit for bit.
    from torch._dynamo.testing import CompileCounterWithBackend

    import minite
    from minite.formats import fp8_autocast

    monkeypatch.setattr(FB, "op", lambda name, fn: getattr(ref_ops, name) if torch.compiler.is_compiling() else fn)
    torch.manual_seed(0)
    lin = minite.nn.Linear(96, 40, backend="triton")
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True, backend=cnt)
    x = _x((2, 9, 96), 3, "cpu", spread=1)
    outs = []
    for f in (lin, compiled):
        xx = x.clone().requires_grad_()
        with fp8_autocast(recipe=recipe):
            y = f(xx)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xx.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
        lin.zero_grad(set_to_none=True)
    assert cnt.frame_count == 1
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=0, atol=0)

