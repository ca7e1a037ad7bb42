"""Comparing an implementation against its reference: one tolerance table, one checker.

``check_op`` is what the test suite *and* the exercise check cells call, so a learner sees the same
PASS/FAIL lines the instructor's tests produce::

    >>> assert check_op("softmax fwd+bwd", my_softmax, softmax_ref, torch.randn(7, 4097))
    PASS: softmax fwd+bwd [float32 (7, 4097)]: output, grad[0]

PASS lines carry no numbers (they are compared by nbval); FAIL lines carry the worst error and where it is.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["dtype_tols", "assert_close", "check_op", "fp8_dot_tolerance", "TOLS"]

# (atol, rtol) per dtype for an op that computes in fp32 and rounds once to the output dtype.
#   fp16: 10 mantissa bits -> 1 ulp relative = 2**-10 ~ 1e-3; allow ~2 ulp.
#   bf16: 7 mantissa bits -> 2**-7 ~ 7.8e-3; the CPU interpreter truncates fp32 -> bf16 on store instead of
#         rounding to nearest even (TRITON_ON_CPU.md), so allow 2 ulp.
#   fp32: the kernel and the reference sum in different orders; a few ulp of 1.2e-7 on sums of ~1e3 terms.
#   fp64: only gradcheck-style comparisons.
TOLS: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def dtype_tols(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for comparing a result of `dtype` against the reference: ``dict(atol=..., rtol=...)``."""
    if dtype not in TOLS:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLS]}")
    atol, rtol = TOLS[dtype]
    return {"atol": atol, "rtol": rtol}


# FP8 tensor cores (Hopper wgmma) do not accumulate in full fp32: each MMA instruction (k = 32 fp8 products) adds
# its products into an accumulator that keeps only ~14 significant bits, the smaller addends truncated (DeepSeek-V3
# §3.3.2). One such step errs by at most 2^-13 of the magnitude it handles, which is <= sum_k |a_ik b_kj|, so a chain
# of s steps errs by <= s * 2^-13 * (|A| @ |B|)_ij. "split" accumulation (minite.kernels.fp8_gemm) promotes the
# partial sum to fp32 every `promote_every` = 128 elements of K, so the chain is ceil(128 / 32) = 4 steps long and
# the per-interval errors add up to <= 4 * 2^-13 * (|A| @ |B|)_ij over the whole K; "fast" never promotes (a chain
# of ceil(K / 32) steps). The CPU interpreter multiplies in numpy fp32: no extra term there.
FP8_MMA_K = 32               # fp8 products per tensor-core instruction (wgmma k = 32 for 8-bit operands)
FP8_ACC_UNIT = 2.0 ** -13    # ~14-bit accumulator significand, truncating


def fp8_dot_tolerance(a: torch.Tensor, b: torch.Tensor, *, device: torch.device | str, atol: float, rtol: float,
                      promote_every: int | None = 128) -> dict:
    """``dict(atol=..., rtol=...)`` for comparing an FP8 GEMM ``a @ b`` (on `device`) against an fp32 reference.

    `a` (M, K) and `b` (K, N) are the operands' dequantized values (Float8Tensor is dequantized here);
    `atol`/`rtol` are what the test allows on the CPU (summation order, output rounding). On CUDA the tensor
    core's accumulator error is added element-wise: ``steps * 2^-13 * (|a| @ |b|)`` with
    ``steps = ceil(min(K, promote_every) / 32)`` (`promote_every=None`: never promoted, the "fast" mode).
    The result's atol is then a tensor (M, N); ``assert_close`` accepts it.
    """
    if torch.device(device).type != "cuda":
        return {"atol": atol, "rtol": rtol}
    from minite.formats.fp8 import Float8Tensor

    a, b = (t.dequantize(torch.float32) if isinstance(t, Float8Tensor) else t for t in (a, b))
    K = a.shape[-1]
    steps = -(-min(K, promote_every or K) // FP8_MMA_K)
    mag = a.detach().abs().float() @ b.detach().abs().float()  # (|A| @ |B|)_ij: sum of absolute products
    return {"atol": atol + steps * FP8_ACC_UNIT * mag, "rtol": rtol}


def _bad(a: torch.Tensor, e: torch.Tensor, atol, rtol: float) -> torch.Tensor:
    bad = ~((a - e).abs() <= atol + rtol * e.abs())  # NaN-aware: NaN counts as bad; atol may be a tensor
    bad &= ~(torch.isnan(a) & torch.isnan(e))      # equal_nan
    bad |= torch.isnan(a) != torch.isnan(e)
    bad &= ~((a == e) & torch.isinf(a))            # equal infinities
    return bad


def _describe_mismatch(actual: torch.Tensor, expected: torch.Tensor, atol, rtol: float) -> str:
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs()
    bad = _bad(a, e, atol, rtol)
    n_bad = int(bad.sum())
    finite_err = torch.where(torch.isfinite(err), err, torch.zeros_like(err))
    idx = tuple(int(i) for i in torch.unravel_index(finite_err.argmax(), err.shape)) if err.numel() else ()
    where = ""
    if idx:
        where = f" at {idx}: got {a[idx].item():.6g}, expected {e[idx].item():.6g}"
    if isinstance(atol, torch.Tensor):  # element-wise atol (fp8_dot_tolerance): name the one at the worst element
        atol = f"{torch.broadcast_to(atol, err.shape)[idx].item():.3g} here" if idx else "[]"
    else:
        atol = f"{atol:g}"
    return (f"{n_bad}/{err.numel()} elements differ; max abs err {finite_err.max().item():.3g}{where} "
            f"(atol={atol}, rtol={rtol:g})")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 name: str = "tensor", atol: float | torch.Tensor | None = None, rtol: float | None = None) -> None:
    """Assert `actual` matches `expected` within ``dtype_tols`` (of `dtype`, default `actual.dtype`).

    `atol` may be a tensor broadcastable to the shape (an element-wise bound, e.g. ``fp8_dot_tolerance``).

    Raises AssertionError naming `name`, the shape/dtype, how many elements differ and the worst one.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"{name}: expected tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    tol = dtype_tols(dtype or actual.dtype)
    atol = tol["atol"] if atol is None else atol
    rtol = tol["rtol"] if rtol is None else rtol
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if isinstance(atol, torch.Tensor):
        ok = not _bad(a, e, atol.detach().double().cpu(), rtol).any().item()
        atol = atol.detach().double().cpu()
    else:
        ok = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True).all().item()
    if not ok:
        raise AssertionError(f"{name} {tuple(actual.shape)} {actual.dtype}: " + _describe_mismatch(a, e, atol, rtol))


def _clone_inputs(args: Sequence, grad: bool) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = a.detach().clone()
            if grad and c.is_floating_point():
                c.requires_grad_(True)
            out.append(c)
        else:
            out.append(a)
    return out


def check_op(name: str, fn: Callable, ref: Callable, *args, grad: bool = True, seed: int = 0,
             atol: float | None = None, rtol: float | None = None, verbose: bool = True, **kwargs) -> bool:
    """Run `fn` and `ref` on copies of `args` (+ `kwargs`), compare the output and every input gradient.

    * Tensor args that are floating point get ``requires_grad`` when `grad` is True; both sides are
      back-propagated with the same random upstream gradient (seeded by `seed`).
    * Tolerances come from ``dtype_tols`` of the output's dtype unless `atol`/`rtol` are given.
    * Prints one ``PASS: ...`` line (no numbers, so stored outputs compare exactly) or ``FAIL: ...`` lines
      with the worst error, and returns True/False. Use it as ``assert check_op(...)``.
    """
    xs_fn, xs_ref = _clone_inputs(args, grad), _clone_inputs(args, grad)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    label = f"{name} [{str(first.dtype).replace('torch.', '')} {tuple(first.shape)}]" if first is not None else name
    failures: list[str] = []
    checked: list[str] = []
    out = fn(*xs_fn, **kwargs)
    exp = ref(*xs_ref, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    exps = exp if isinstance(exp, (tuple, list)) else (exp,)
    if len(outs) != len(exps):
        failures.append(f"returned {len(outs)} outputs, reference returns {len(exps)}")
    for i, (o, e) in enumerate(zip(outs, exps)):
        tag = "output" if len(exps) == 1 else f"output[{i}]"
        try:
            assert_close(o, e, name=tag, atol=atol, rtol=rtol)
        except AssertionError as err:
            failures.append(str(err))
        checked.append(tag)
    if grad and not failures:
        g = torch.Generator().manual_seed(seed)
        diff = [(o, e) for o, e in zip(outs, exps) if isinstance(e, torch.Tensor) and e.requires_grad]
        if diff:
            ups = [torch.randn(e.shape, generator=g, dtype=torch.float32).to(e.dtype).to(e.device) for _, e in diff]
            torch.autograd.backward([e for _, e in diff], ups)
            try:
                torch.autograd.backward([o for o, _ in diff], ups)
            except RuntimeError as err:
                failures.append(f"backward failed: {err}")
            for i, (a_fn, a_ref) in enumerate(zip(xs_fn, xs_ref)):
                if not (isinstance(a_ref, torch.Tensor) and a_ref.requires_grad) or a_ref.grad is None:
                    continue
                tag = f"grad[{i}]"
                if a_fn.grad is None:
                    failures.append(f"{tag}: no gradient reached input {i}")
                else:
                    try:
                        assert_close(a_fn.grad, a_ref.grad, name=tag, atol=atol, rtol=rtol)
                    except AssertionError as err:
                        failures.append(str(err))
                checked.append(tag)
    if failures:
        if verbose:
            print(f"FAIL: {label}")
            for f in failures:
                print(f"    {f}")
        return False
    if verbose:
        print(f"PASS: {label}: {', '.join(checked)}")
    return True
