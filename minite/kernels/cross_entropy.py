"""Cross-entropy over a large vocabulary (chapter 06), and the fused linear + cross-entropy.

    loss_i = logsumexp(x_i) - x_i[t_i]                      x: (N, V) logits, t: (N,) targets
    dloss_i / dx_i = softmax(x_i) - one_hot(t_i)            (times 1 / #non-ignored rows for reduction="mean")

One program per row loops over V in blocks with an *online* logsumexp (running max m, running sum of exp(x - m)),
so V = 50304 never needs a 50304-wide tile. The loss is fp32 whatever the logits dtype. ``linear_cross_entropy``
takes ``chunk_size`` rows at a time: logits chunk = x_chunk @ W^T, overwritten in place with dlogits, folded into
dx and dW at once: one (chunk_size, V) tile is alive instead of several (N, V) tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from minite import _validate as _v
from minite._triton import interpreting, tl, triton
from minite.backend import resolve_backend
from minite.kernels._common import (
    _acc,
    compute_dtype,
    launchable,
    op,
    register_autograd,
    register_op,
    row_launch,
    use_op,
)

__all__ = ["cross_entropy_ref", "cross_entropy", "CrossEntropyFunction", "linear_cross_entropy_ref",
           "linear_cross_entropy", "LinearCrossEntropyFunction", "LinearCrossEntropy"]

MAX_VOCAB = 2**31 - 1  # column offsets inside a row are int32 in the kernels


# ----------------------------------------------------------------------------------------- 1. reference
def cross_entropy_ref(logits, target, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.):
    """The spec, from the formula (tested against F.cross_entropy). logits (N, V), target (N,) -> fp32 loss."""
    x = logits.double() if logits.dtype == torch.float64 else logits.float()  # (N, V)
    valid = target != ignore_index  # (N,)
    lse = torch.logsumexp(x, dim=-1)  # (N,)
    # torch.logsumexp returns +inf for a row holding +inf, where F.cross_entropy and the kernel give NaN (x - max =
    # inf - inf), value and gradient. Those rows take the shifted formula, which says NaN; the others keep
    # logsumexp bit for bit (the unused branch adds an exact 0 to their gradient). No host check: no sync.
    m = x.amax(-1, keepdim=True).detach()  # (N, 1)
    shifted = (m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))).squeeze(-1)  # (N,): NaN where a +inf is
    lse = torch.where(torch.isposinf(x).any(-1), shifted, lse)
    x_t = x.gather(1, torch.where(valid, target, 0)[:, None]).squeeze(1)  # (N,) logit of the target
    loss = lse - x_t
    if label_smoothing:  # (1 - eps) * (lse - x_t) + eps * (lse - mean(x)): eps/V of the target mass on every class
        loss = lse - (1.0 - label_smoothing) * x_t - label_smoothing * x.mean(-1)
    loss = torch.where(valid, loss, 0.0)
    return loss if reduction == "none" else loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def linear_cross_entropy_ref(x, weight, target, ignore_index: int = -100, reduction: str = "mean",
                             label_smoothing: float = 0.0):
    """Naive: materialise the (N, V) logits, then cross-entropy. x (N, C), weight (V, C)."""
    return cross_entropy_ref(x @ weight.t(), target, ignore_index, reduction, label_smoothing)


# -------------------------------------------------------------------------------------------- 2. kernels
@triton.jit
def _ce_fwd_kernel(X_ptr, X_row_stride, T_ptr, Loss_ptr, LSE_ptr, V, ignore_index, smoothing,
                   BLOCK_SIZE: tl.constexpr, FP64: tl.constexpr):
    smoothing = _acc(smoothing, FP64)  # a float is fp64 under Inductor: compute in fp32 (fp64 for gradcheck)
    row = tl.program_id(0).to(tl.int64)  # one program per row of the (N, V) logits
    X_ptr += row * X_row_stride  # int64: N * V overflows int32 at N*V > 2**31 (8192 x 50304 does)
    t = tl.load(T_ptr + row)
    cols = tl.arange(0, BLOCK_SIZE)
    m = _acc(tl.full((), float("-inf"), tl.float32), FP64)  # running max
    s = _acc(tl.full((), 0.0, tl.float32), FP64)  # running sum of exp(x - m)
    sum_x = _acc(tl.full((), 0.0, tl.float32), FP64)  # sum of x, for label smoothing
    # Online logsumexp: one pass over V in blocks; when the max grows, rescale the old sum by exp(m_old - m_new).
    for start in range(0, V, BLOCK_SIZE):
        mask = start + cols < V
        x = _acc(tl.load(X_ptr + start + cols, mask=mask, other=float("-inf")), FP64)  # (BLOCK_SIZE,)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # All -inf so far (a masked block): x - m_new = -inf - -inf = NaN; shift by 0 instead (softmax's guard)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)  # masked lanes: exp(-inf) = 0
        m = m_new
        sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    valid = t != ignore_index
    # The target logit is one scalar load; out-of-range targets are masked so the kernel never reads past the row
    # (they are rejected before launch on the CPU; on CUDA checking would cost a host sync, see _check_ce).
    ok = valid & (t >= 0) & (t < V)
    x_t = _acc(tl.load(X_ptr + tl.where(ok, t, 0), mask=ok, other=0.0), FP64)
    # (1 - eps) * (lse - x_t) + eps * (lse - mean(x)); the smoothing term only when eps > 0: a masked (-inf)
    # logit makes sum_x = -inf, and 0 * -inf would be NaN
    smooth = tl.where(smoothing > 0, smoothing * sum_x / V, 0.0)
    loss = lse - (1.0 - smoothing) * x_t - smooth
    tl.store(Loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(LSE_ptr + row, lse)  # saved for the backward: softmax = exp(x - lse) without another reduction


# Backward of row i with upstream gradient g_i (g / #valid for "mean"), derived in the notebook:
#   dloss_i/dx_ij = softmax(x_i)_j - (1 - eps) * [j == t_i] - eps / V      (0 for an ignored row)
# softmax is recomputed from the saved lse: exp(x - lse). DX may alias X (the fused linear-CE writes in place:
# each element is read, then overwritten, by the same program).
@triton.jit
def _ce_bwd_kernel(X_ptr, X_row_stride, T_ptr, LSE_ptr, DL_ptr, DL_stride, DX_ptr, DX_row_stride, V,
                   ignore_index, smoothing, BLOCK_SIZE: tl.constexpr, FP64: tl.constexpr):
    smoothing = _acc(smoothing, FP64)  # a float is fp64 under Inductor: compute in fp32 (fp64 for gradcheck)
    row = tl.program_id(0).to(tl.int64)
    X_ptr += row * X_row_stride
    DX_ptr += row * DX_row_stride
    t = tl.load(T_ptr + row)
    lse = tl.load(LSE_ptr + row)
    g = _acc(tl.load(DL_ptr + row * DL_stride), FP64)  # DL_stride = 0: one scalar for mean / sum
    g = tl.where(t != ignore_index, g, 0.0)  # ignored rows get a zero gradient
    cols = tl.arange(0, BLOCK_SIZE)
    for start in range(0, V, BLOCK_SIZE):
        mask = start + cols < V
        x = _acc(tl.load(X_ptr + start + cols, mask=mask, other=0.0), FP64)  # (BLOCK_SIZE,)
        p = tl.exp(x - lse)  # softmax, recomputed
        dx = p - smoothing / V - tl.where(start + cols == t, 1.0 - smoothing, 0.0)  # softmax - one_hot
        tl.store(DX_ptr + start + cols, (g * dx).to(DX_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------ 3. launchers
def _block_size(V: int) -> tuple[int, int]:
    # (BLOCK_SIZE, num_warps): blocks of up to 4096 columns walk the row (8 warps: 16 fp32 per thread).
    # Under the interpreter a bigger block means fewer Python-level loop iterations.
    return row_launch(V, 8192 if interpreting() else 4096)


@register_op("cross_entropy_fwd")  # torch.ops.minite.cross_entropy_fwd, for torch.compile (section 4)
def cross_entropy_fwd(logits: Tensor, target: Tensor, ignore_index: int,
                      label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Per-row loss and logsumexp, both (N,) fp32 (fp64 for fp64 logits). logits (N, V) with unit column stride."""
    N, V = logits.shape
    acc = compute_dtype(logits.dtype)
    loss, lse = (torch.empty(N, device=logits.device, dtype=acc) for _ in range(2))
    if N:
        block, warps = _block_size(V)
        launchable(_ce_fwd_kernel)[(N,)](logits, logits.stride(0), target, loss, lse, V, ignore_index,
                                         float(label_smoothing), BLOCK_SIZE=block, FP64=acc == torch.float64,
                                         num_warps=warps)
    return loss, lse


@register_op("cross_entropy_bwd", eager_only=("out",))
def cross_entropy_bwd(dl: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
                      label_smoothing: float, out: Tensor | None = None) -> Tensor:
    """dlogits (N, V) for per-row upstream grads `dl` ((N,), or (1,) broadcast). `out=logits` works in place."""
    N, V = logits.shape
    dx = torch.empty_like(logits) if out is None else out
    dl = dl.to(lse.dtype).contiguous()
    if N:
        block, warps = _block_size(V)
        launchable(_ce_bwd_kernel)[(N,)](logits, logits.stride(0), target, lse, dl, 1 if dl.numel() > 1 else 0, dx,
                                         dx.stride(0), V, ignore_index, float(label_smoothing), BLOCK_SIZE=block,
                                         FP64=lse.dtype == torch.float64, num_warps=warps)
    return dx


def _ce_chunk_torch(logits, target, dl, ignore_index, label_smoothing):
    """The reference step of the chunked linear-CE: per-row loss, and logits <- dlogits in place."""
    with torch.enable_grad():
        z = logits.detach().requires_grad_()
        rows = cross_entropy_ref(z, target, ignore_index, "none", label_smoothing)
        (dz,) = torch.autograd.grad(rows, z, dl.to(rows.dtype).expand_as(rows))
    logits.copy_(dz)
    return rows.detach()


def linear_cross_entropy_fwd(x, weight, target, ignore_index, reduction, label_smoothing, chunk_size, use_triton,
                             need_dx=True, need_dw=True):
    """Loss, and dx (N, C) / dW (V, C) for an upstream gradient of 1, never holding more than (chunk_size, V)."""
    N, valid, acc = len(x), (target != ignore_index).sum(), compute_dtype(x.dtype)
    dl = torch.ones(1, dtype=acc, device=x.device) / (valid.clamp(min=1) if reduction == "mean" else 1)  # every row
    rows = torch.empty(N, dtype=acc, device=x.device)  # per-row loss
    dx = torch.empty_like(x) if need_dx else None  # (N, C)
    dw = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_dw else None  # (V, C) fp32
    for s in range(0, N, chunk_size):
        xc, tc = x[s:s + chunk_size], target[s:s + chunk_size]  # (n, C), (n,)
        logits = xc @ weight.t()  # (n, V): the only vocabulary-sized tensor alive
        if not (need_dx or need_dw):  # no_grad / inference: the loss only, no dlogits, dx or dW work
            rows[s:s + chunk_size] = (cross_entropy_fwd(logits, tc, ignore_index, label_smoothing)[0] if use_triton
                                      else cross_entropy_ref(logits, tc, ignore_index, "none", label_smoothing))
        elif use_triton:
            rows[s:s + chunk_size], lse = cross_entropy_fwd(logits, tc, ignore_index, label_smoothing)
            cross_entropy_bwd(dl, logits, tc, lse, ignore_index, label_smoothing, out=logits)  # in place
        else:
            rows[s:s + chunk_size] = _ce_chunk_torch(logits, tc, dl, ignore_index, label_smoothing)
        if dx is not None:
            dx[s:s + chunk_size] = logits @ weight  # (n, V) @ (V, C) -> (n, C)
        if dw is not None:
            dw += (logits.t() @ xc).to(acc)  # (V, n) @ (n, C): one rounding per chunk, summed in fp32
    loss = rows.sum() / valid if reduction == "mean" else rows.sum()
    return loss, dx, dw


@register_op("linear_cross_entropy")  # torch.ops.minite.linear_cross_entropy (section 4)
def _linear_cross_entropy_op(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str,
                             label_smoothing: float, chunk_size: int, need_dx: bool,
                             need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dx, dW) of the chunked Triton path; a gradient not asked for is a (0,) tensor (an op returns no None)."""
    loss, dx, dw = linear_cross_entropy_fwd(x, weight, target, ignore_index, reduction, label_smoothing, chunk_size,
                                            True, need_dx, need_dw)
    return loss, x.new_empty(0) if dx is None else dx, x.new_empty(0) if dw is None else dw


# ------------------------------------------------------------------------------------ 4. autograd.Function
# Each Function's setup_ctx and backward (rows_backward for cross-entropy, whose op returns per-row losses) are
# also the gradient of its torch.ops.minite.* op: one formula.
class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing):
        rows, lse = op("cross_entropy_fwd", cross_entropy_fwd)(logits, target, ignore_index, label_smoothing)
        valid = (target != ignore_index).sum()
        CrossEntropyFunction.setup_ctx(ctx, (logits, target, ignore_index, label_smoothing), (rows, lse), valid)
        ctx.reduction = reduction
        return rows if reduction == "none" else rows.sum() / valid if reduction == "mean" else rows.sum()

    @staticmethod
    def setup_ctx(ctx, inputs, output, *valid):
        logits, target, ignore_index, label_smoothing = inputs
        ctx.save_for_backward(logits, target, output[1], *valid)  # logits are alive anyway; lse is (N,)
        ctx.args = (ignore_index, label_smoothing)

    @staticmethod
    def rows_backward(ctx, drows, _dlse=None):
        """dlogits from the gradient of the per-row losses, (N,) or one (1,) value for every row."""
        logits, target, lse = ctx.saved_tensors[:3]
        return op("cross_entropy_bwd", cross_entropy_bwd)(drows, logits, target, lse, *ctx.args), None, None, None

    @staticmethod
    def backward(ctx, dloss):
        valid = ctx.saved_tensors[3]
        dl = dloss.reshape(-1) / (valid.clamp(min=1) if ctx.reduction == "mean" else 1)  # (N,) for "none", else (1,)
        dx = CrossEntropyFunction.rows_backward(ctx, dl)[0]
        return dx, None, None, None, None


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, ignore_index, reduction, label_smoothing, chunk_size, use_triton, needs):
        # needs = (dx, dW) wanted, from the caller: ctx.needs_input_grad ignores torch.no_grad() (grad mode)
        if use_triton and use_op("linear_cross_entropy"):  # torch.compile: one custom op, kernels in the graph
            out = torch.ops.minite.linear_cross_entropy(x, weight, target, ignore_index, reduction, label_smoothing,
                                                        chunk_size, *needs)
        else:
            out = linear_cross_entropy_fwd(x, weight, target, ignore_index, reduction, label_smoothing, chunk_size,
                                           use_triton, *needs)
        LinearCrossEntropyFunction.setup_ctx(ctx, (x, weight, target, ignore_index, reduction, label_smoothing,
                                                   chunk_size, *needs), out)
        return out[0]

    @staticmethod
    def setup_ctx(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])  # dx, dW: computed in the forward while each chunk was at hand
        ctx.weight_dtype = inputs[1].dtype
        ctx.needs = inputs[7:9]  # a gradient not asked for is None (eager) or a (0,) tensor (the op)

    @staticmethod
    def backward(ctx, dloss, _ddx=None, _ddw=None):
        dx, dw = ctx.saved_tensors
        dx = dx * dloss.to(dx.dtype) if ctx.needs[0] else None  # chain rule with the scalar upstream gradient
        dw = (dw * dloss).to(ctx.weight_dtype) if ctx.needs[1] else None
        return dx, dw, None, None, None, None, None, None, None


register_autograd("cross_entropy_fwd", CrossEntropyFunction.rows_backward, setup_context=CrossEntropyFunction.setup_ctx)
register_autograd("linear_cross_entropy", LinearCrossEntropyFunction.backward,
                  setup_context=LinearCrossEntropyFunction.setup_ctx)


# -------------------------------------------------------------------------------------------- 5. functional
def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, backend: str | None = None) -> Tensor:
    """Cross-entropy of logits (N, V) against class indices target (N,). Returns an fp32 loss (fp64 for fp64):
    a scalar for reduction "mean" (over non-ignored rows) / "sum", or (N,) for "none".

    Out-of-range targets (not ignore_index, outside [0, V)): the CPU path raises a ValueError naming the row; on
    CUDA they are masked, not checked (a check costs a host sync): that row's loss is its logsumexp, no error."""
    _v.ce_args(logits, target, reduction, label_smoothing)
    _v.ce_targets(target, logits.shape[1], ignore_index, MAX_VOCAB)
    if logits.shape[1] == 0:  # no classes, so every row is ignored (checked above): torch's answers, no crash
        rows = logits.to(torch.promote_types(logits.dtype, torch.float32)).sum(-1)  # (N,) zeros, in the graph
        return rows if reduction == "none" else rows.sum() if reduction == "sum" else rows.sum() / 0.0
    if resolve_backend(logits, backend, op="cross_entropy") == "triton":
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()  # rows may be strided, columns not
        return CrossEntropyFunction.apply(logits, target.long().contiguous(), int(ignore_index), reduction,
                                          float(label_smoothing))
    return cross_entropy_ref(logits, target.long(), ignore_index, reduction, label_smoothing)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, chunk_size: int = 1024,
                         backend: str | None = None) -> Tensor:
    """cross_entropy(x @ weight.T, target) without materialising the (N, V) logits. x (N, C), weight (V, C),
    target (N,). Rows are processed `chunk_size` at a time; the gradients are computed during the forward."""
    for name, t in (("x", x), ("weight", weight), ("target", target)):
        _v.tensor("linear_cross_entropy", name, t)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x {tuple(getattr(x, 'shape', ()))} must be (N, C) and weight "
                         f"{tuple(getattr(weight, 'shape', ()))} (V, C) with the same C")
    _v.ce_args(x, target, reduction, label_smoothing, name="x")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"linear_cross_entropy: weight ({weight.dtype}, {weight.device}) must match "
                         f"x ({x.dtype}, {x.device})")
    if reduction == "none":
        raise ValueError("linear_cross_entropy: reduction='none' is not supported (the gradients are computed "
                         "in the forward for a scalar loss); use 'mean' or 'sum'")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size!r} must be a positive int")
    _v.ce_targets(target, weight.shape[0], ignore_index, MAX_VOCAB)
    use_triton, grad = resolve_backend(x, backend) == "triton", torch.is_grad_enabled()
    return LinearCrossEntropyFunction.apply(x.contiguous(), weight.contiguous(), target.long().contiguous(),
                                            int(ignore_index), reduction, float(label_smoothing), chunk_size,
                                            use_triton, (grad and x.requires_grad, grad and weight.requires_grad))


# ------------------------------------------------------------------------------------------------ 6. Module
class LinearCrossEntropy(nn.Module):
    """The LM head and its loss in one: holds weight (V, C); forward(x (N, C), target (N,)) -> fp32 loss."""

    def __init__(self, dim: int, vocab: int, ignore_index: int = -100, chunk_size: int = 1024,
                 backend: str | None = None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim, device=device, dtype=dtype))  # (V, C)
        nn.init.normal_(self.weight, std=0.02)
        self.ignore_index, self.chunk_size, self.backend = ignore_index, chunk_size, backend

    def forward(self, x: Tensor, target: Tensor) -> Tensor:  # x (N, C), target (N,)
        return linear_cross_entropy(x, self.weight, target, ignore_index=self.ignore_index,
                                    chunk_size=self.chunk_size, backend=self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[1]}, vocab={self.weight.shape[0]}, chunk_size={self.chunk_size}"
