"""The fused linear-CE and the FP8 Linear inside torch.compile (kernels/cross_entropy.py, kernels/fp8_linear.py).

Both were graph breaks: ``linear_cross_entropy`` (chunked loop of GEMMs + CE kernels) and ``minite.nn.Linear``
under FP8, whose delayed scaling updates amax histories and scales. They are now custom ops:
``linear_cross_entropy`` (functional, autograd registered), ``fp8_quantize_update`` (quantize kernel; the state
update as in-place tensor mutations declared in ``mutates_args``) and ``fp8_linear_mm`` (the fprop GEMM; its
backward quantizes dy and mutates the grad_output state, a forward input AOTAutograd lets the backward mutate).

On the CPU, where the ``minite::`` ops are not registered (the interpreter), the ``ref_ops`` fixture (conftest.py)
registers the same op bodies and autograd formulas as CPU custom ops in ``minite_ref::`` (they run the interpreted
kernels): opcheck and torch.compile(fullgraph=True, backend="aot_eager") run on them here. The CUDA tests check the real
``minite::`` triton_ops the same way, against eager.
"""
import pytest
import torch

import minite
from minite.formats.autocast import fp8_autocast
from minite.formats.recipe import CurrentScaling, DelayedScaling
from minite.kernels import fp8_linear as LIN
from minite.kernels._common import ENABLED, REGISTERED
from minite.testing import dtype_tols

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NEW_OPS = ["linear_cross_entropy", "fp8_quantize_update", "fp8_linear_mm"]
FP8_OPCHECK = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")  # no fp8 arithmetic


def _randn(*shape, seed=0, scale=1.0, dtype=torch.float32, device="cpu", requires_grad=False):
    t = (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _targets(n, v, seed, device):
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    t[3] = -100  # one ignored row
    return t.to(device)


def test_new_ops_registered_exactly_when_enabled():
    assert (set(NEW_OPS) <= REGISTERED) if ENABLED else not (set(NEW_OPS) & REGISTERED)
    assert not LIN._graph_ops("triton"), "eager calls must take FP8LinearFunction"


def test_quantize_update_schema_declares_the_state_mutation(reference_ops):
    ops = torch.ops.minite if ENABLED else reference_ops()
    schema = str(ops.fp8_quantize_update.default._schema)
    assert "Tensor(a1!) amax_history" in schema and "Tensor(a2!) scale" in schema, schema
    assert "(Tensor x," in schema, schema  # x is read only
    for name in ("linear_cross_entropy", "fp8_linear_mm"):  # functional, so autograd can be registered
        assert "!" not in str(getattr(ops, name).default._schema)


# ------------------------------------------------------------------------- opcheck (CPU ref ops, CUDA ops)
def _opcheck_cases(ops, device):
    x, w = _randn(33, 40, device=device, requires_grad=True), _randn(50, 40, seed=1, scale=0.1, device=device,
                                                                      requires_grad=True)
    t = _targets(33, 50, 2, device)
    x8, w8 = _randn(32, 64, seed=3, device=device), _randn(48, 64, seed=4, scale=0.1, device=device)
    h, s = torch.rand(4, generator=torch.Generator().manual_seed(5)).to(device), torch.ones((), device=device)
    e4 = torch.float8_e4m3fn
    st = [(torch.zeros(4, device=device), torch.ones((), device=device)) for _ in range(3)]
    qx = ops.fp8_quantize_update(x8, *st[0], e4, 0, "max")
    qw = ops.fp8_quantize_update(w8, *st[1], e4, 0, "max")
    return {
        "linear_cross_entropy": ((x, w, t, -100, "mean", 0.1, 16, True, True), {}),
        "linear_cross_entropy_sum_no_dw": ((x, w.detach(), t, -100, "sum", 0.0, 32, True, False), {}),
        "fp8_quantize_update": ((x8, h, s, e4, 0, "max"), {}),
        "fp8_quantize_update_current": ((x8, h[:1].clone(), s.clone(), torch.float8_e5m2, 1, "current"), {}),
        "fp8_linear_mm": ((x8.clone().requires_grad_(), w8.clone().requires_grad_(), *qx, *qw, *st[2],
                           torch.float8_e5m2, 0, "max", False, True, True), {"test_utils": FP8_OPCHECK}),
    }


@pytest.mark.triton
@pytest.mark.parametrize("case", ["linear_cross_entropy", "linear_cross_entropy_sum_no_dw", "fp8_quantize_update",
                                  "fp8_quantize_update_current", "fp8_linear_mm"])
def test_opcheck_reference_ops(ref_ops, case, device):
    # Schema (the declared mutations are the only ones), fake impl vs the interpreted kernels, autograd
    # registration, AOT dispatch with dynamic shapes (fwd + bwd, the backward's state mutation included).
    args, kw = _opcheck_cases(ref_ops, device)[case]
    torch.library.opcheck(getattr(ref_ops, case.split("_sum")[0].split("_current")[0]), args, **kw)


@pytest.mark.triton
def test_quantize_update_matches_the_recipes(ref_ops, device):
    # The in-place update gives the bits and the state values of quantize() + recipe.update (eager path).
    for rec in (DelayedScaling(amax_history_len=3, margin=1), DelayedScaling(amax_history_len=3,
                amax_compute_algo="most_recent"), CurrentScaling(margin=1)):
        algo = rec.amax_compute_algo if rec.delayed else "current"
        st_ref, st = LIN.fp8_linear_states(rec)["input"], LIN.fp8_linear_states(rec)["input"]
        for i in range(4):
            x = _randn(17, 40, seed=10 + i, scale=2.0 ** (3 - 2 * i))
            q = LIN._quantize(x, st_ref, rec, "triton")
            data, sinv = ref_ops.fp8_quantize_update(x, st.amax_history, st.scale, st.fp8_dtype, rec.margin, algo)
            assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
            torch.testing.assert_close(sinv, q.scale_inv, rtol=0, atol=0)
            torch.testing.assert_close(st.amax_history, st_ref.amax_history, rtol=0, atol=0)
            torch.testing.assert_close(st.scale, st_ref.scale, rtol=0, atol=0)


# ------------------------------------------------------------------- torch.compile(fullgraph=True), CPU ref ops
def _graph_code(cnt):
    return "\n".join(m.code for g in cnt.graphs for m in g.modules() if hasattr(m, "code"))


@pytest.mark.triton
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_linear_fullgraph_reference_ops(monkeypatch, ref_ops, recipe, device):
    # The in-graph path of fp8_linear, traced with fullgraph=True (AOTAutograd, fwd + bwd) on the CPU ref ops:
    # output, every gradient and all three scaling states equal the eager FP8LinearFunction's, bit for bit, over
    # 3 steps (the states evolve: a wrong or missing in-graph mutation shows up at step 2).
    from torch._dynamo.testing import CompileCounterWithBackend

    rec = DelayedScaling(amax_history_len=4) if recipe == "delayed" else CurrentScaling()
    eager, comp = (minite.nn.Linear(64, 48) for _ in range(2))
    comp.load_state_dict(eager.state_dict())
    comp.fp8_states_for(rec, "cpu")  # states exist before tracing (see Linear.fp8_states_for)
    monkeypatch.setattr(LIN, "_graph_ops", lambda backend: ref_ops if torch.compiler.is_compiling() else None)
    cnt = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: comp(x), fullgraph=True, backend=cnt)
    for step in range(3):
        x = _randn(2, 16, 64, seed=20 + step, scale=1.0 + step)
        outs = []
        for f, m in ((eager, eager), (compiled, comp)):
            xx = x.clone().requires_grad_()
            with fp8_autocast(recipe=rec):
                y = f(xx)
            (y.float() ** 2).sum().backward()
            outs.append((y.detach(), xx.grad, m.weight.grad, m.bias.grad))
            m.zero_grad(set_to_none=True)
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        for r in LIN.ROLES:
            for attr in ("amax_history", "scale"):
                torch.testing.assert_close(getattr(comp.fp8_states[r], attr), getattr(eager.fp8_states[r], attr),
                                           rtol=0, atol=0, msg=f"step {step}: {r}.{attr}")
    assert cnt.frame_count == 1
    code = _graph_code(cnt)
    assert "minite_ref.fp8_quantize_update" in code and "minite_ref.fp8_linear_mm" in code, code


def test_fp8_states_made_while_compiling_is_a_clear_error(monkeypatch):
    lin = minite.nn.Linear(32, 16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="must exist before torch.compile"):
        lin.fp8_states_for(DelayedScaling(), "cpu")


@pytest.mark.triton
def test_linear_cross_entropy_fullgraph_reference_op(ref_ops, device):
    # The op with its registered autograd under fullgraph=True equals the eager functional (interpreted kernels).
    x, w = _randn(33, 40, requires_grad=True), _randn(50, 40, seed=1, scale=0.1, requires_grad=True)
    t = _targets(33, 50, 2, "cpu")

    def f(x, w):
        return ref_ops.linear_cross_entropy(x, w, t, -100, "mean", 0.1, 16, True, True)[0] * 3.0

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    gx, gw = torch.autograd.grad(got, (x, w))
    want = minite.ops.linear_cross_entropy(x, w, t, label_smoothing=0.1, chunk_size=16) * 3.0
    wx, ww = torch.autograd.grad(want, (x, w))
    for a, b in ((got, want), (gx, wx), (gw, ww)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", ["linear_cross_entropy", "linear_cross_entropy_sum_no_dw", "fp8_quantize_update",
                                  "fp8_quantize_update_current", "fp8_linear_mm"])
def test_opcheck_cuda(case):
    ops = torch.ops.minite
    args, kw = _opcheck_cases(ops, "cuda")[case]
    torch.library.opcheck(getattr(ops, case.split("_sum")[0].split("_current")[0]), args, **kw)


@pytest.mark.gpu
@cuda
def test_linear_cross_entropy_fullgraph_cuda():
    # Public functional (backend auto -> triton) under fullgraph=True: one frame, the op in the graph, the loss
    # and both gradients equal eager's (the same kernels, traced).
    from torch._dynamo.testing import CompileCounterWithBackend

    bf = torch.bfloat16
    x = _randn(300, 96, dtype=bf, device="cuda", requires_grad=True)
    w = _randn(1000, 96, seed=1, scale=0.1, dtype=bf, device="cuda", requires_grad=True)
    t = _targets(300, 1000, 2, "cuda")

    def f(x, w):
        return minite.ops.linear_cross_entropy(x, w, t, label_smoothing=0.1, chunk_size=128)

    outs = []
    cnt = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True, backend=cnt)):
        loss = fn(x, w)
        outs.append((loss.detach(), *torch.autograd.grad(loss, (x, w))))
    assert cnt.frame_count == 1
    assert "minite.linear_cross_entropy" in _graph_code(cnt)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, **dtype_tols(torch.bfloat16))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_linear_fullgraph_cuda(recipe):
    # minite.nn.Linear under fp8_autocast, compiled with fullgraph=True (inductor): output, gradients and the
    # three scaling states match eager over 3 steps; the graph holds the quantize and fp8 GEMM ops.
    from torch._dynamo.testing import CompileCounterWithBackend

    rec = DelayedScaling(amax_history_len=4) if recipe == "delayed" else CurrentScaling()
    bf = torch.bfloat16
    eager = minite.nn.Linear(128, 96, device="cuda", dtype=bf)
    comp = minite.nn.Linear(128, 96, device="cuda", dtype=bf)
    comp.load_state_dict(eager.state_dict())
    comp.fp8_states_for(rec, "cuda")
    cnt = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: comp(x), fullgraph=True, backend=cnt)
    tols = dtype_tols(bf)
    for step in range(3):
        x = _randn(4, 64, 128, seed=20 + step, scale=1.0 + step, dtype=bf, device="cuda")
        outs = []
        for f, m in ((eager, eager), (compiled, comp)):
            xx = x.clone().requires_grad_()
            with fp8_autocast(recipe=rec):
                y = f(xx)
            (y.float() ** 2).sum().backward()
            outs.append((y.detach(), xx.grad, m.weight.grad, m.bias.grad))
            m.zero_grad(set_to_none=True)
        for a, b in zip(*outs):
            torch.testing.assert_close(b.float(), a.float(), **tols)
        for r in LIN.ROLES:
            for attr in ("amax_history", "scale"):
                torch.testing.assert_close(getattr(comp.fp8_states[r], attr), getattr(eager.fp8_states[r], attr),
                                           rtol=1e-2, atol=0, msg=f"step {step}: {r}.{attr}")
    assert cnt.frame_count == 1
    code = _graph_code(cnt)
    assert "minite.fp8_quantize_update" in code and "minite.fp8_linear_mm" in code, code
