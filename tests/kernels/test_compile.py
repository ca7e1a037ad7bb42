"""minite's kernels inside torch.compile: custom-op registration (opcheck) and fullgraph=True per op.

On CUDA every op is registered as ``torch.ops.minite.*`` (``@register_op`` in each concept file, kernels/_common.py)
and the autograd Functions call it while torch.compile traces, so ``fullgraph=True`` compiles with the Triton
kernels in the graph. Under the CPU interpreter nothing is registered (``wrap_triton`` refuses interpreted kernels)
and the eager path runs; there the tests check that backend resolution itself does not break a graph (reference
path, fullgraph=True), and that every declared op has the schema its registration would get.
"""
import pytest
import torch

import minite
from minite.kernels import _common
from minite.kernels._common import ENABLED, REGISTERED, use_op
from minite.testing import dtype_tols

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OPS = ["softmax_fwd", "softmax_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "rope",
       "swiglu_fwd", "swiglu_bwd", "cross_entropy_fwd", "cross_entropy_bwd", "fp8_gemm"]
OTHER_OPS = ["linear_cross_entropy", "fp8_quantize_update", "fp8_linear_mm", "attention_fwd", "attention_bwd",
             "attention_qkv_fwd", "attention_qkv_bwd",
             "decode_attention", "lora_fwd", "lora_bwd",  # test_compile_fused.py, test_compile_attention.py
             "grouped_gemm_fwd", "grouped_gemm_dw",  # test_grouped_gemm.py
             "block_quantize", "block_scaled_mm"]  # test_fp8_block.py
WITH_GRAD = {"softmax_fwd", "rmsnorm_fwd", "layernorm_fwd", "rope", "swiglu_fwd", "cross_entropy_fwd",
             "linear_cross_entropy", "fp8_linear_mm", "attention_fwd", "attention_qkv_fwd", "lora_fwd",
             "grouped_gemm_fwd"}


def _randn(*shape, seed=0, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def test_registration_matches_the_platform():
    # Registered exactly when real (not interpreted) Triton kernels can run; never outside torch.compile.
    assert ENABLED == (minite.HAS_TRITON and not minite.interpreting())
    assert (set(OPS) <= REGISTERED) if ENABLED else not REGISTERED
    assert not use_op("softmax_fwd"), "eager calls must skip the dispatcher"


def test_every_op_is_declared_with_its_schema_and_gradient():
    # What registration gets on CUDA, checked on any machine (the concept modules declare their ops on import):
    # every op, a schema inferred from its launcher (Python-only parameters left out) and one gradient formula
    # per differentiable op, shared with its autograd.Function.
    schemas = {name: torch.library.infer_schema(body, mutates_args=m) for name, (body, m) in _common.OPS.items()}
    assert sorted(schemas) == sorted(OPS + OTHER_OPS)
    assert set(_common.FORMULAS) == WITH_GRAD
    assert schemas["rmsnorm_bwd"] == "(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)"
    assert schemas["lora_fwd"] == "(Tensor x2, Tensor weight, Tensor lora_A, Tensor lora_B, float scaling) -> " \
                                  "(Tensor, Tensor)"  # no `blocks`: a test's tile sizes
    assert schemas["cross_entropy_bwd"].endswith("float label_smoothing) -> Tensor")  # no `out` buffer
    assert "Tensor(a1!) amax_history, Tensor(a2!) scale" in schemas["fp8_quantize_update"]
    assert schemas["grouped_gemm_dw"] == "(Tensor x, Tensor dy, Tensor offsets, ScalarType w_dtype) -> Tensor"
    assert not [s for s in schemas.values() if "=" in s]  # no defaults: compiled callers pass every argument


@pytest.mark.parametrize("how", ["argument", "context"])
def test_backend_resolution_does_not_break_the_graph(how):
    # The reference path under fullgraph=True: resolve_backend (argument, use_backend context) must trace.
    x, w = _randn(4, 32), _randn(32, seed=1)

    def f(x, w):
        kw = {"backend": "torch"} if how == "argument" else {}
        h = minite.ops.rmsnorm(x, w, **kw)
        return minite.ops.softmax(h, **kw).sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    if how == "context":
        with minite.use_backend("torch"):
            got, want = compiled(x, w), f(x, w)
    else:
        got, want = compiled(x, w), f(x, w)
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------------- CUDA only
def _cases(device):
    """name -> (fn(*inputs) -> tensor(s), inputs needing grad); fn calls the public functional (backend auto)."""
    bf = torch.bfloat16
    x = _randn(64, 96, dtype=bf, device=device, requires_grad=True)
    w = (1 + 0.1 * _randn(96, seed=1)).to(device=device, dtype=bf).requires_grad_()
    b = (0.1 * _randn(96, seed=2)).to(device=device, dtype=bf).requires_grad_()
    q = _randn(2, 4, 16, 32, seed=3, dtype=bf, device=device, requires_grad=True)  # (B, H, T, D)
    cos, sin = minite.ops.rope_cos_sin(16, 32, device=device)
    g, u = (_randn(64, 200, seed=s, dtype=bf, device=device, requires_grad=True) for s in (4, 5))
    logits = _randn(64, 1000, seed=6, dtype=bf, device=device, requires_grad=True)
    t = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(7)).to(device)
    ops = minite.ops
    return {
        "softmax": (lambda x: ops.softmax(x), (x,)),
        "rmsnorm": (lambda x, w: ops.rmsnorm(x, w), (x, w)),
        "layernorm": (lambda x, w, b: ops.layernorm(x, w, b), (x, w, b)),
        "rope": (lambda q: ops.rope(q, cos, sin), (q,)),
        "swiglu": (lambda g, u: ops.swiglu(g, u), (g, u)),
        "cross_entropy": (lambda z: ops.cross_entropy(z, t), (logits,)),
    }


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", ["softmax", "rmsnorm", "layernorm", "rope", "swiglu", "cross_entropy"])
def test_fullgraph_compile_matches_eager(name):
    # Forward and every gradient of torch.compile(fullgraph=True) equal eager's: the same kernels, traced.
    fn, inputs = _cases("cuda")[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    outs = []
    for f in (fn, compiled):
        for t in inputs:
            t.grad = None
        y = f(*inputs)
        if y.dim():
            y.float().pow(2).sum().backward()
        else:
            y.backward()
        outs.append((y.detach(), [t.grad.clone() for t in inputs]))
    (y0, g0), (y1, g1) = outs
    tols = dtype_tols(torch.bfloat16)
    torch.testing.assert_close(y1, y0, **tols)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, **tols)


@pytest.mark.gpu
@cuda
def test_fullgraph_graph_has_the_kernels():
    # The compiled graph calls minite's custom ops (no graph break, no silent fallback to the reference).
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("aot_eager")
    x = _randn(8, 64, device="cuda", requires_grad=True)
    w = torch.ones(64, device="cuda", requires_grad=True)
    torch._dynamo.reset()
    # backend="triton": minite's kernel whatever the recorded benchmark makes auto pick (minite/choices.py)
    torch.compile(lambda x, w: minite.ops.rmsnorm(x, w, backend="triton").sum(), backend=cnt,
                  fullgraph=True)(x, w).backward()
    assert cnt.frame_count == 1
    code = "\n".join(m.code for g in cnt.graphs for m in g.modules() if hasattr(m, "code"))  # + fwd/bwd bodies
    assert "minite.rmsnorm_fwd" in code, code


def _opcheck_args(device):
    bf = torch.bfloat16
    x, w, b = _randn(33, 96, dtype=bf, device=device), _randn(96, seed=1, dtype=bf, device=device), \
        _randn(96, seed=2, dtype=bf, device=device)
    y, rstd = torch.ops.minite.rmsnorm_fwd(x, w, 1e-6)
    _, mean, rstd_ln = torch.ops.minite.layernorm_fwd(x, w, b, 1e-5)
    q = _randn(2, 4, 16, 32, seed=3, dtype=bf, device=device)
    cos, sin = minite.ops.rope_cos_sin(16, 32, device=device)
    logits, t = _randn(33, 500, seed=6, device=device), torch.randint(0, 500, (33,), device=device)
    _, lse = torch.ops.minite.cross_entropy_fwd(logits, t, -100, 0.0)
    a8 = _randn(64, 128, seed=8, device=device).to(torch.float8_e4m3fn)
    b8 = _randn(128, 96, seed=9, device=device).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=device)
    return {
        "softmax_fwd": (x, -1), "softmax_bwd": (y, x, -1),
        "rmsnorm_fwd": (x, w, 1e-6), "rmsnorm_bwd": (x, x, w, rstd),
        "layernorm_fwd": (x, w, b, 1e-5), "layernorm_bwd": (x, x, w, mean, rstd_ln),
        "rope": (q, cos, sin, "bhtd", 1), "swiglu_fwd": (x, y), "swiglu_bwd": (x, y, x),
        "cross_entropy_fwd": (logits, t, -100, 0.0), "cross_entropy_bwd": (lse / 33, logits, t, lse, -100, 0.0),
        "fp8_gemm": (a8, b8, one, one, torch.bfloat16, True),
    }


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    # Schema, fake-tensor (meta) behaviour, autograd registration and AOT dispatch of each custom op.
    # fp8_gemm: opcheck's schema test multiplies the inputs, which torch cannot do on float8 tensors.
    tests = ("test_faketensor", "test_aot_dispatch_dynamic") if name == "fp8_gemm" else None
    kw = {"test_utils": tests} if tests else {}
    torch.library.opcheck(getattr(torch.ops.minite, name), _opcheck_args("cuda")[name], **kw)


def test_train_compile_mode_resolution():
    from minite.compile import resolve_compile

    assert resolve_compile("auto", torch.device("cuda"), 1000, "bf16") == "reduce-overhead"
    assert resolve_compile("auto", torch.device("cuda"), 10, "bf16") == "off"  # too short to pay for compiling
    assert resolve_compile("auto", torch.device("cuda"), 1000, "fp8") == "off"
    assert resolve_compile("auto", torch.device("cpu")) == "off"
    if minite.interpreting():  # interpreted kernels cannot be compiled: any mode resolves to off on the CPU
        assert resolve_compile("default", torch.device("cpu")) == "off"
    with pytest.raises(ValueError, match="train.compile='fastest'"):
        resolve_compile("fastest", torch.device("cpu"))
