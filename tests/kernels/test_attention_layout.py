"""No layout copies around the GPT's attention (issue 33): a transformer block's forward and backward, captured
with AOTAutograd (torch.compile, backend aot_eager) on the CPU, hold no clone, cat or copy of a (B, T, ...)
tensor. The GPT-2 step on an H200 paid 2.85 ms of 40.7 for them: q/k/v transposed to (B, H, T, D) and made
contiguous, the output transposed back, and the backward concatenating the transposed dq, dk, dv.

The attention runs as minite's custom ops (the Triton path); under the interpreter they are registered here as
CPU custom ops with the same bodies and autograd formulas (``_common.OPS`` / ``FORMULAS``), as
tests/kernels/conftest.py does, so the capture sees what torch.compile sees on a GPU: the ops as opaque calls
and every tensor op around them. The rest of the block (norms, MLP) runs PyTorch's reference ops.
"""
import pytest
import torch

import minite
import minite.ops  # noqa: F401  (declares every op)
from minite.kernels import _common as C
from minite.models.gpt import Block, GPTConfig

NS = "minite_layout"
COPIES = {"clone", "cat", "copy", "copy_", "contiguous", "_to_copy", "index_put", "scatter", "stack"}


def _fakes():
    # Shapes of each op's outputs, as the op allocates them (strides too: o in q's memory order).
    from minite.kernels import attention as A

    def qkv_fwd(qkv, cos, sin, h, kvh, causal, scale):
        B, T, N = qkv.shape
        D = N // (h + 2 * kvh)
        return (qkv.new_empty((B, T, h, D)), qkv.new_empty((B, h, T), dtype=torch.float32),
                qkv.new_empty((B, T, h + kvh, D)))

    like = getattr(A, "_like", torch.empty_like)
    return {
        "rope": lambda x, *_: x.new_empty(x.shape),
        "attention_fwd": lambda q, k, v, c, s, cu, m: (like(q), q.new_empty(
            (q.shape[0], q.shape[1], q.shape[2]) if cu is None else (q.shape[1], q.shape[0]), dtype=torch.float32)),
        "attention_bwd": lambda do, q, k, v, *_: (like(q), like(k), like(v)),
        "attention_qkv_fwd": qkv_fwd,
        "attention_qkv_bwd": lambda do, qkv, *_: qkv.new_empty(qkv.shape),
    }


def _register() -> None:
    if hasattr(getattr(torch.ops, NS), "rope"):
        return
    fakes = {n: f for n, f in _fakes().items() if n in C.OPS}
    for name, fake in fakes.items():
        body, mutates = C.OPS[name]
        torch.library.custom_op(f"{NS}::{name}", body, mutates_args=mutates, device_types="cpu").register_fake(fake)
    for name in fakes.keys() & C.FORMULAS.keys():
        backward, setup = C.FORMULAS[name]
        torch.library.register_autograd(f"{NS}::{name}", C.calling_ops(NS, backward), setup_context=setup)


def _capture(block, x):
    """(forward graph, backward graph) of block(x).sum() backward, with the minite ops called as NS ops."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    f = torch.compile(block, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), fullgraph=True)
    old, C._CALLING.ns = getattr(C._CALLING, "ns", None), NS  # op(name) -> torch.ops.minite_layout.<name>
    try:
        y = f(x)
        y.sum().backward()
        err = None
    except RuntimeError as e:  # the graphs are captured by now; the copies are the finding, then this
        err = e
    finally:
        C._CALLING.ns = old
    return graphs["fw"], graphs["bw"], y, err


def _around_attention(gm):
    """The nodes of `gm` between the projections and the attention ops: walking back from each minite attention
    op through its inputs, and forward through its users, up to a matmul (the qkv / out projection or their
    gradients), a graph input or the output."""
    mms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def stop(n):
        return n.op in ("placeholder", "output") or n.target in mms
    start = [n for n in gm.graph.nodes if n.op == "call_function" and NS in str(n.target)
             and "attention" in str(n.target)]
    seen = set()
    for step in (lambda n: n.all_input_nodes, lambda n: list(n.users)):
        todo = list(start)
        while todo:
            for m in step(todo.pop()):
                if m not in seen and not stop(m):
                    seen.add(m)
                    todo.append(m)
    return start, seen


def _bt_copies(gm, B, T):
    """(attention op nodes, copy-like nodes around them whose output is a (B, T, ...) or (B, heads, T, ...) tensor)."""
    start, region = _around_attention(gm)
    bad = []
    for n in region:
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        val = n.meta.get("val")
        if name in COPIES and isinstance(val, torch.Tensor) and val.dim() >= 3 and val.shape[0] == B \
                and T in tuple(val.shape[1:3]):
            bad.append(f"{n.target}{tuple(val.shape)}")
    return start, sorted(bad)


@pytest.mark.triton
@pytest.mark.parametrize("n_kv_head", [4, 2], ids=["mha", "gqa"])
def test_block_forward_and_backward_copy_no_bt_tensor(device, n_kv_head):
    if device.type != "cpu" or not minite.interpreting():
        pytest.skip("the CPU custom ops run the kernels under the interpreter")
    _register()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=64,
                    backend="torch")
    block = Block(cfg)
    block.attn.backend = "triton"  # only the attention through minite's ops; norms and MLP in PyTorch
    B, T = 2, 24
    x = torch.randn(B, T, 64, requires_grad=True)
    fw, bw, y, err = _capture(block, x)
    (fw_ops, fw_bad), (bw_ops, bw_bad) = _bt_copies(fw, B, T), _bt_copies(bw, B, T)
    assert fw_ops and bw_ops, "the attention did not run as the custom ops"
    assert not fw_bad, f"forward copies around attention: {fw_bad}"
    assert not bw_bad, f"backward copies around attention: {bw_bad}"
    if err is not None:
        raise err
    # ... and it computes the block: output and input gradient as the PyTorch reference block
    ref = Block(cfg)
    ref.load_state_dict(block.state_dict())
    x2 = x.detach().clone().requires_grad_()
    y2 = ref(x2)
    y2.sum().backward()
    torch.testing.assert_close(y.detach(), y2.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
