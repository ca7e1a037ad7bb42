"""Tiny Triton helpers shared by several concept files (they stay @triton.jit, inlined into each kernel)."""
from minite._triton import tl, triton


@triton.jit
def _acc(x, FP64: tl.constexpr):
    # Upcast right after a load: accumulate in fp32 (fp64 when given fp64, for gradcheck). Never compute in
    # bf16: its arithmetic is wrong under the CPU interpreter and slow on some GPUs.
    if FP64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)
