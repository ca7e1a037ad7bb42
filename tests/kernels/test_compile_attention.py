"""Attention (forward, backward, varlen), decode and LoRA as custom ops, so torch.compile(fullgraph=True) keeps
their Triton kernels in the graph (the H100 of 2026-11-25: Dynamo traced into them, and the compiled GPT crashed).

On the CPU the minite:: triton_ops cannot exist (wrap_triton refuses interpreted kernels), so the same op bodies
and autograd formulas are registered as CPU custom ops (``register_reference_ops``, conftest.py) and checked here:
opcheck (schema, fake impl against the interpreted kernels, autograd registration, AOT dispatch), and fullgraph=True
forward + every gradient against the PyTorch reference. On CUDA the real minite:: ops get the same checks.
A static check makes sure every launch inside a registered op goes through ``launchable`` (wrap_triton while
compiling): the fp8 quantize launch did not, and opcheck crashed on the H100 with "Cannot access data pointer of
Tensor (FakeTensor)" and then an illegal memory access.
"""
import re
from pathlib import Path

import pytest
import torch

import minite
from minite.kernels._common import ENABLED, REGISTERED
from minite.kernels.attention import attention_ref
from minite.kernels.lora import lora_linear_ref
from minite.testing import dtype_tols

OPS = ["attention_fwd", "attention_bwd", "attention_qkv_fwd", "attention_qkv_bwd", "decode_attention", "lora_fwd",
       "lora_bwd"]
ROOT = Path(__file__).resolve().parents[2] / "minite"
# Teaching kernels launched only from eager code that no registered op calls (chapter 01's bit encoders).
EAGER_ONLY = {"_encode_kernel", "_decode_kernel"}


def _randn(*shape, seed=0, scale=1.0, dtype=torch.float32, device="cpu", requires_grad=False):
    t = (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def test_ops_registered_exactly_when_enabled():
    assert (set(OPS) <= REGISTERED) if ENABLED else not (set(OPS) & REGISTERED)


def test_every_kernel_launch_can_be_traced():
    # kernel[grid](...) inside a triton_op must be launchable(kernel)[grid](...): a bare launch under
    # torch.compile hands FakeTensors to the kernel. Checked on the source, so the CPU sees it.
    bare = []
    for f in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in re.finditer(r"(?<![\w(\"'])(_\w+_kernel)\[", line):  # not a name in a string (gate budgets)
                if m.group(1) not in EAGER_ONLY:
                    bare.append(f"{f.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not bare, "launch through launchable(kernel)[grid](...):\n" + "\n".join(bare)


def _ops(device, reference_ops):
    return torch.ops.minite if device.type == "cuda" else reference_ops()


def _attn_inputs(device, dtype=torch.float32, varlen=False):
    if varlen:  # thd: 2 sequences of 5 and 11 tokens, 4 query heads on 2 kv heads
        q = _randn(16, 4, 16, seed=1, dtype=dtype, device=device, requires_grad=True)
        k, v = (_randn(16, 2, 16, seed=s, dtype=dtype, device=device, requires_grad=True) for s in (2, 3))
        return q, k, v, torch.tensor([0, 5, 16], dtype=torch.int32, device=device), 11
    q = _randn(2, 4, 13, 16, seed=1, dtype=dtype, device=device, requires_grad=True)  # (B, H, T, D), odd T
    k, v = (_randn(2, 2, 13, 16, seed=s, dtype=dtype, device=device, requires_grad=True) for s in (2, 3))
    return q, k, v, None, 0


def _cases(ops, device):
    q, k, v, _, _ = _attn_inputs(device)
    qv, kv, vv, cu, m = _attn_inputs(device, varlen=True)
    with torch.no_grad():  # the backward ops' saved inputs carry no autograd history
        o, lse = ops.attention_fwd(q, k, v, True, None, None, 0)
        ov, lsev = ops.attention_fwd(qv, kv, vv, True, 0.3, cu, m)
    x2, w = _randn(24, 40, seed=4, device=device), _randn(32, 40, seed=5, scale=0.1, device=device)
    a, b = _randn(8, 40, seed=6, scale=0.1, device=device), _randn(32, 8, seed=7, scale=0.1, device=device)
    with torch.no_grad():
        y, g = ops.lora_fwd(x2, w, a, b, 2.0)
    kc, vc = (_randn(2, 2, 40, 16, seed=s, device=device) for s in (8, 9))
    lens = torch.tensor([17, 40], dtype=torch.int32, device=device)
    qkv = _randn(2, 9, (4 + 2 * 2) * 16, seed=11, device=device)  # (B, T, (H + 2 KVH) D), GQA 2, D = 16
    cos, sin = (f(torch.arange(9.0, device=device)[:, None] * torch.arange(1.0, 9.0, device=device)) for f in (
        torch.cos, torch.sin))  # (T, D/2)
    with torch.no_grad():
        oq, lseq, qk = ops.attention_qkv_fwd(qkv, cos, sin, 4, 2, True, None)
    return {
        "attention_qkv_fwd": (qkv.requires_grad_(), cos, sin, 4, 2, True, None),
        "attention_qkv_bwd": (torch.ones_like(oq), qkv.detach(), qk, oq, lseq, cos, sin, 4, 2, True, None),
        "attention_fwd": (q, k, v, True, None, None, 0),
        "attention_fwd_varlen": (qv, kv, vv, True, 0.3, cu, m),
        "attention_bwd": (torch.ones_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse, True, None, None,
                          0),
        "attention_bwd_varlen": (torch.ones_like(ov), qv.detach(), kv.detach(), vv.detach(), ov.detach(), lsev, True,
                                 0.3, cu, m),
        "decode_attention": (_randn(2, 4, 16, seed=10, device=device), kc, vc, lens, None, 2, 40),
        "lora_fwd": (x2.requires_grad_(), w.requires_grad_(), a.requires_grad_(), b.requires_grad_(), 2.0),
        "lora_bwd": (torch.ones_like(y), x2.detach(), w.detach(), a.detach(), b.detach(), g, 2.0),
    }


@pytest.mark.triton
@pytest.mark.parametrize("case", ["attention_fwd", "attention_fwd_varlen", "attention_bwd", "attention_bwd_varlen",
                                  "attention_qkv_fwd", "attention_qkv_bwd", "decode_attention", "lora_fwd",
                                  "lora_bwd"])
def test_opcheck(case, device, reference_ops):
    if device.type == "cpu" and not minite.interpreting():
        pytest.skip("no Triton here")
    ops = _ops(device, reference_ops)
    torch.library.opcheck(getattr(ops, case.replace("_varlen", "")), _cases(ops, device)[case])


@pytest.mark.triton
@pytest.mark.parametrize("varlen", [False, True], ids=["bhsd", "thd"])
def test_attention_op_fullgraph_matches_reference(ref_ops, varlen, device):
    # The registered autograd formula (_attn_setup/_attn_grad, the varlen cu_seqlens path included) under
    # torch.compile(fullgraph=True): output and dq, dk, dv equal the reference's.
    q, k, v, cu, m = _attn_inputs(device, varlen=varlen)

    def f(q, k, v):
        return ref_ops.attention_fwd(q, k, v, True, 0.3, cu, m)[0]

    def ref(q, k, v):
        if cu is None:
            return attention_ref(q, k, v, True, 0.3)
        return minite.ops.attention_varlen(q, k, v, cu, m, scale=0.3, backend="torch")

    torch._dynamo.reset()
    got = _value_and_grads(torch.compile(f, fullgraph=True, backend="aot_eager"), (q, k, v))
    want = _value_and_grads(ref, (q, k, v))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **dtype_tols(torch.float32), msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.triton
def test_attention_qkv_op_fullgraph_matches_reference(ref_ops, device):
    # The GPT's op pair (RoPE + attention on the fused qkv, one d(qkv) buffer) under torch.compile(fullgraph=True):
    # o and d(qkv) equal the PyTorch path of attention_qkv (rope_ref + SDPA), GQA 2, odd T.
    from minite.kernels.attention import attention_qkv
    qkv = _randn(2, 13, (4 + 2 * 2) * 16, seed=12, device=device, requires_grad=True)
    ang = torch.arange(13.0, device=device)[:, None] * 0.3 ** torch.arange(8.0, device=device)  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    torch._dynamo.reset()
    f = torch.compile(lambda x: ref_ops.attention_qkv_fwd(x, cos, sin, 4, 2, True, 0.3)[0], fullgraph=True,
                      backend="aot_eager")
    got = _value_and_grads(f, (qkv,))
    want = _value_and_grads(lambda x: attention_qkv(x, cos, sin, 4, 2, scale=0.3, backend="torch"), (qkv,))
    for name, a, b in zip(("o", "dqkv"), got, want):
        torch.testing.assert_close(a, b, **dtype_tols(torch.float32), msg=lambda s, n=name: f"{n}: {s}")


@pytest.mark.triton
def test_lora_op_fullgraph_matches_reference(ref_ops, device):
    # dx, dW (base weight unfrozen), dA, dB through the registered formula, against lora_linear_ref.
    x = _randn(24, 40, seed=4, device=device, requires_grad=True)
    w = _randn(32, 40, seed=5, scale=0.1, device=device, requires_grad=True)
    a = _randn(8, 40, seed=6, scale=0.1, device=device, requires_grad=True)
    b = _randn(32, 8, seed=7, scale=0.1, device=device, requires_grad=True)
    torch._dynamo.reset()
    f = torch.compile(lambda x, w, a, b: ref_ops.lora_fwd(x, w, a, b, 2.0)[0], fullgraph=True, backend="aot_eager")
    got = _value_and_grads(f, (x, w, a, b))
    want = _value_and_grads(lambda x, w, a, b: lora_linear_ref(x, w, a, b, 2.0), (x, w, a, b))
    for name, g, r in zip(("y", "dx", "dW", "dA", "dB"), got, want):
        torch.testing.assert_close(g, r, **dtype_tols(torch.float32), msg=lambda s, n=name: f"{n}: {s}")


def _value_and_grads(f, inputs):
    for t in inputs:
        t.grad = None
    y = f(*inputs)
    w = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)  # a non-uniform upstream gradient
    (y.float() * w).sum().backward()
    return [y.detach()] + [t.grad.clone() for t in inputs]


# --------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.gpu
def test_compiled_gpt_keeps_the_kernels_in_the_graph():
    # The H100 crash: the default `python -m minite.train` compiles the GPT. fullgraph=True: one graph, the
    # attention op inside it, loss and grads equal to eager's.
    from torch._dynamo.testing import CompileCounterWithBackend

    from minite.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)).cuda()
    idx = torch.randint(0, 96, (2, 64), device="cuda")
    cnt = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    with torch.autocast("cuda", torch.bfloat16):
        _, loss_c = compiled(idx, idx)
        _, loss_e = model(idx, idx)
    assert cnt.frame_count == 1
    torch.testing.assert_close(loss_c.float(), loss_e.float(), **dtype_tols(torch.bfloat16))
