"""CPU copies of minite's custom ops, for the torch.compile tests (test_compile_fused.py, test_compile_attention.py).

On a CUDA machine the launchers are the ops ``torch.ops.minite.*`` (``torch.library.triton_op``, declared by
``@register_op`` in each concept file). Under the CPU interpreter nothing is registered: wrap_triton refuses
interpreted kernels. ``register_reference_ops`` registers the same op bodies and the same autograd formulas
(``_common.OPS`` and ``_common.FORMULAS``, recorded by ``register_op`` / ``register_autograd`` wherever they run) as
CPU custom ops in namespace ``minite_ref``, with explicit fake impls. There opcheck and
torch.compile(fullgraph=True, backend="aot_eager") check the schemas, the in-place state updates and the autograd
wiring, running the interpreted kernels. Nothing here touches torch.ops.minite.
"""
import pytest
import torch

import minite
import minite.ops  # noqa: F401  (imports every concept module, so every op is declared)
from minite.kernels._common import FORMULAS, OPS, calling_ops
from minite.kernels.attention import _like as _attn_like  # o and the gradients are stored in their input's order


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# The ops checked on the CPU, and what each returns (shapes and dtypes): a plain custom op needs a fake impl, a
# triton_op derives its own by tracing the launcher.
FAKES = {
    "linear_cross_entropy": lambda x, w, t, ii, red, ls, cs, ndx, ndw: (
        x.new_empty((), dtype=_acc(x)),
        torch.empty_like(x) if ndx else x.new_empty(0),
        w.new_empty(w.shape, dtype=_acc(x)) if ndw else x.new_empty(0)),
    "fp8_quantize_update": lambda x, h, s, dt, m, a: (x.new_empty(x.shape, dtype=dt), s.new_empty(s.shape)),
    "fp8_linear_mm": lambda x, w, qx, sx, qw, *_: x.new_empty((qx.shape[0], qw.shape[0])),
    "fp8_gemm": lambda a, b, sa, sb, dt, split: a.new_empty((a.shape[0], b.shape[1]), dtype=dt),
    "attention_fwd": lambda q, k, v, c, s, cu, m: (_attn_like(q), q.new_empty(
        (q.shape[0], q.shape[1], q.shape[2]) if cu is None else (q.shape[1], q.shape[0]), dtype=torch.float32)),
    "attention_bwd": lambda do, q, k, v, *_: (_attn_like(q), _attn_like(k), _attn_like(v)),
    "attention_qkv_fwd": lambda qkv, cos, sin, h, kvh, c, s: (
        qkv.new_empty((*qkv.shape[:2], h, 2 * cos.shape[1])), qkv.new_empty((qkv.shape[0], h, qkv.shape[1]),
                                                                            dtype=torch.float32),
        qkv.new_empty((*qkv.shape[:2], h + kvh, 2 * cos.shape[1]))),
    "attention_qkv_bwd": lambda do, qkv, *_: qkv.new_empty(qkv.shape),
    "decode_attention": lambda q, *_: torch.empty_like(q),
    "lora_fwd": lambda x2, w, a, b, s: (x2.new_empty((x2.shape[0], w.shape[0])),
                                        x2.new_empty((x2.shape[0], a.shape[0]), dtype=torch.float32)),
    "lora_bwd": lambda dy, x2, w, a, b, g, s: (torch.empty_like(x2), torch.empty_like(a), torch.empty_like(b)),
    "grouped_gemm_fwd": lambda x, w, o: x.new_empty((x.shape[0], w.shape[2])),
    "grouped_gemm_dw": lambda x, dy, o, dt: x.new_empty((o.shape[0] - 1, x.shape[1], dy.shape[1]), dtype=dt),
    "block_quantize": lambda x, br, bc, mx, dt, p2: (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(
        ((x.shape[0] + br - 1) // br, (x.shape[1] + bc - 1) // bc), dtype=torch.uint8 if mx else torch.float32)),
    "block_scaled_mm": lambda a, b, sa, sb, sk, sn, mx, dt: a.new_empty((a.shape[0], b.shape[1]), dtype=dt),
}


def register_reference_ops(ns: str = "minite_ref") -> str:
    """The ops of FAKES as CPU custom ops in namespace `ns`, with their registered gradients (the backward calls
    ``torch.ops.<ns>.*``). Idempotent; returns `ns`."""
    if hasattr(getattr(torch.ops, ns), "lora_fwd"):
        return ns
    for name, fake in FAKES.items():
        body, mutates_args = OPS[name]
        custom = torch.library.custom_op(f"{ns}::{name}", body, mutates_args=mutates_args, device_types="cpu")
        custom.register_fake(fake)
    for name in sorted(FAKES.keys() & FORMULAS.keys()):  # the ops with a gradient (FORMULAS)
        backward, setup_context = FORMULAS[name]
        torch.library.register_autograd(f"{ns}::{name}", calling_ops(ns, backward), setup_context=setup_context)
    return ns


@pytest.fixture
def reference_ops():
    """A function that registers (once) and returns the CPU reference ops, ``torch.ops.minite_ref``."""
    return lambda: getattr(torch.ops, register_reference_ops())


@pytest.fixture
def ref_ops(device, reference_ops):
    """The CPU reference ops, only where the suite runs on the interpreter: a CUDA machine checks the minite::
    triton_ops instead (the CUDA tests), and a CPU without the interpreter cannot run the kernels."""
    if device.type != "cpu" or not minite.interpreting():
        pytest.skip("the CPU reference ops run the kernels under the interpreter; CUDA checks the minite:: ops")
    return reference_ops()
