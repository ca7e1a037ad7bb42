"""Context x tensor (+ sequence) parallelism against the dense GPT, one torchrun launch for every case:

    TRITON_INTERPRET=1 torchrun --nproc-per-node 4 -m minite.parallel.checks_cptp --tp 2 --out DIR [--cases ..]

The world is a tp x cp grid (``ParallelDims(tp, cp)``). Each case builds ``CPGPT(TPGPT(dense))`` from the dense GPT
of the same seed, averages the gradients over the cp ranks with ``DataParallel`` (as ``minite.train`` does) and
compares on every rank: the loss, every local parameter gradient with the dense gradient's slice that the
parameter's tags name (``p.dense_name``, ``p.dense_index``), ``dense_state_dict()``, ``num_params()``, greedy
``generate`` and the parameters after 5 AdamW steps with gradient clipping (case sp_triton: SP on the Triton
kernels, loss and gradients only). Each rank writes DIR/rank<r>.json.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from minite.parallel.checks import CLIP, STEPS, TOL, _result, adamw, batches, dense_run, maxerr, tiny_gpt
from minite.parallel.context_gpt import CPGPT
from minite.parallel.data import DataParallel
from minite.parallel.dims import ParallelDims, init_distributed
from minite.parallel.launch import report, triton_skipped
from minite.parallel.runtime import clip_grad_norm_
from minite.parallel.sequence import TPGPT

# name: (sequence parallel, GPT shape). T = 12: chunks of 3 tokens (2*cp = 4 of them), T/cp = 6, T/(cp tp) = 3.
# n_kv_head=2 splits the kv heads over tp=2; n_kv_head=1 replicates the one kv head (its gradient-summing hook).
# sp_triton: head_dim 16 (the Triton kernels' tl.dot dims), one forward/backward only (the interpreter is slow).
CASES = {"tp": (False, dict(n_head=6, n_kv_head=2, n_embd=48)),
         "sp": (True, dict(n_head=6, n_kv_head=2, n_embd=48)),
         "sp_kv1": (True, dict(n_head=4, n_kv_head=1, n_embd=32)),
         "sp_triton": (True, dict(n_head=4, n_kv_head=2, n_embd=64, backend="triton"), False)}
T, B = 12, 3


def _composed(dims: ParallelDims, sp: bool, kw: dict):
    model = CPGPT.from_dense(TPGPT.from_dense(tiny_gpt(**kw), dims.group("tp"), sequence_parallel=sp),
                             dims.group("cp"))
    return model, DataParallel(model, dims.group("dp_cp"))  # averages the gradients over dp x cp


def check_case(dims: ParallelDims, name: str, sp: bool, kw: dict, steps: bool = True) -> dict:
    """One fwd/bwd (loss, gradients, state, num_params); steps: also greedy generate and 5 AdamW steps."""
    kw = {**kw, "block_size": T}
    if kw.get("backend") == "triton" and (skip := triton_skipped(torch.empty(0))):  # a GPU machine: no interpreter
        return {f"{name}_{k}": skip for k in ("state", "num_params", "loss", "grads")}
    (x, y), = batches(1, B, T=T, seed=7)
    dense = tiny_gpt(**kw)
    d_loss = dense(x, y)[1]
    d_loss.backward()
    d_grads = {n: p.grad for n, p in dense.named_parameters()}
    model, dp = _composed(dims, sp, kw)
    out = {f"{name}_state": _result(maxerr(model.dense_state_dict(), dense.state_dict()), 0.0),
           f"{name}_num_params": _result(abs(model.num_params() - dense.num_params()), 0)}
    loss = model(x, y)[1]
    loss.backward()
    dp.finish()
    out[f"{name}_loss"] = _result(abs(float(loss.detach()) - float(d_loss)), 1e-5)
    errs = {}
    for n, p in model.named_parameters():  # my slice of each dense gradient, named by the parameter's tags
        dim, index = p.dense_index
        ref = d_grads[p.dense_name] if dim is None else d_grads[p.dense_name].index_select(dim, index)
        errs[n] = float((p.grad - ref).abs().max())
    out[f"{name}_grads"] = _result(max(errs.values()), 1e-5, n_params=len(errs), worst=max(errs, key=errs.get))
    if not steps:
        return out
    prompt = x[:, :5]
    same = torch.equal(model.generate(prompt, 4, temperature=0), dense.generate(prompt, 4, temperature=0))
    out[f"{name}_generate"] = _result(0.0 if same else 1.0, 0.0)
    model, dp = _composed(dims, sp, kw)
    data = batches(STEPS, B, T=T, seed=3)
    ref = dense_run(tiny_gpt(**kw), data).state_dict()
    opt = adamw(model)
    for xb, yb in data:
        model(xb, yb)[1].backward()
        dp.finish()
        clip_grad_norm_(model.parameters(), CLIP, dims.group("tp"))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out[f"{name}_5_steps"] = _result(maxerr(model.dense_state_dict(), ref), TOL)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minite.parallel.checks_cptp")
    ap.add_argument("--tp", type=int, default=2, help="tp degree; cp = world / tp")
    ap.add_argument("--out", default=tempfile.gettempdir())
    ap.add_argument("--cases", nargs="+", default=["tp", "sp", "sp_kv1"], choices=sorted(CASES))
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed(args.timeout, backend="gloo")  # CPU tensors
    dims = ParallelDims(tp=args.tp, cp=world // args.tp).build(rank, world, args.timeout)
    results = {}
    for name in args.cases:
        t0 = time.perf_counter()
        res = check_case(dims, name, *CASES[name])
        for v in res.values():
            v["rank"], v["seconds"] = rank, round(time.perf_counter() - t0, 2)
        results.update(res)
    return report(args.out, rank, results)


if __name__ == "__main__":
    sys.exit(main())
