"""What the checks of every chapter share: the tiny GPT from a seed, its batches, the AdamW and the tolerance of
the comparisons with one process, and the shape of a result."""
from __future__ import annotations

import torch

from minite.layers.moe import step_expert_bias
from minite.models.gpt import GPT, GPTConfig

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64,
            backend="torch")
MID = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384,
           backend="torch")  # the lessons' measurements: large enough that compute shows
LR = 1e-2
WD = 0.5
STEPS = 5
CLIP = 1.0
# After 5 AdamW steps parameters agree to ~lr/1000 (Adam turns reduction-order noise on near-zero gradients into
# up to lr-sized steps); a missing weight decay (lr*wd*|p| ~ 1e-4 per step) or a wrong lr is far above TOL. The
# gradients themselves are compared at 1e-6 (Adam is blind to a wrong gradient scale). 2e-4, not 1e-4: tp2 x sp
# at world 4 measured 1.008e-4 on an AVX-512 CPU (2026-11-25, the same on main before), where the reduction order
# of the CPU's kernels differs; a missing weight decay (~5e-4 after 5 steps) stays above it.
TOL = 2e-4


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    """The GPT of the checks (TINY, or TINY updated by kw) from `seed`: the same weights on every rank."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def batches(n: int, B: int, T: int = 16, V: int = 64, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n global batches (x, y) of B sequences of T tokens, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def adamw(model) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices and embeddings only (what minite.train builds)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR)


def dense_run(model, data, steps: int = STEPS):
    """The reference: `steps` AdamW steps of one process on the whole batches, clipped at CLIP."""
    opt = adamw(model)
    for x, y in data[:steps]:
        model(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        step_expert_bias(model)  # the "bias" balance's step, as minite.train's
        opt.zero_grad(set_to_none=True)
    return model


def maxerr(a: dict, b: dict) -> float:
    """The largest |a[k] - b[k]| over the tensors of b's keys."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def result(err: float, tol: float, **kw) -> dict:
    """One result of a check: ok when err <= tol."""
    return {"ok": bool(err <= tol), "max_err": err, "tol": tol, **kw}
