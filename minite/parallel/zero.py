"""Chapter 10: the distributed optimizer (ZeRO-1/2/3's optimizer half) and its sharded checkpoint.

Each rank owns one contiguous fp32 shard: its piece of every unit of ``DataParallel``. The gradients arrive there
reduce-scattered; AdamW state exists for the shard only; the rank steps its shard, and (stage 1/2) the full
parameters are all-gathered back (stage 3 gathers them lazily at the next forward). Weight decay is decoupled and
applied with a per-element mask (matrices and embeddings decay, norm gains do not), which is exactly what
torch.optim.AdamW does with two parameter groups. Clipping needs the *global* norm: every rank sums the squares of
its shard, one all-reduce adds them up (each element is counted once, because the shards do not overlap; an
element that tensor parallelism replicates is divided by its ``tp_replicas``, as ``comm.clip_grad_norm_`` does).

``JointShardedAdamW`` steps several of them as one optimizer (chapter 16: expert parallelism's dense parameters
sharded over dp, its experts over edp): one global norm over all their shards.

A checkpoint is saved sharded (one file per rank, each element tagged by parameter name and range) and can be
loaded at another world size: a rank reads the pieces that overlap its new shard.
"""
from __future__ import annotations

from pathlib import Path

import torch

from minite.parallel import comm
from minite.parallel.data import DataParallel

__all__ = ["ShardedAdamW", "JointShardedAdamW", "memory_per_rank", "bytes_per_step"]


class ShardedAdamW:
    """AdamW on my shard of a ``DataParallel`` at stage >= 1. ``param_groups[0]["lr"]`` is settable as usual.

    tp_group: with tensor parallelism, the group over which the global norm also sums (None without TP); the
    parameters' ``tp_replicas`` tags say how often each element is held there."""

    def __init__(self, dp: DataParallel, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay=lambda name, p: p.dim() >= 2, tp_group=None):
        if dp.stage < 1:
            raise ValueError("ShardedAdamW needs DataParallel stage >= 1 (stage 0 uses torch.optim.AdamW)")
        self.dp, self.weight_decay, self.tp_group = dp, weight_decay, tp_group
        self.inner = torch.optim.AdamW([dp.shard_param], lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        self.param_groups = self.inner.param_groups
        self.decay_mask = dp.shard_mask(lambda n, p: float(decay(n, p)))
        # how many tp ranks hold each element of my shard (1 on the padding): the norm counts it once
        dp.shard_param.tp_replicas = dp.shard_mask(lambda n, p: getattr(p, "tp_replicas", 1), padding=1.0)

    def grads(self) -> list[torch.Tensor]:
        """The gradient step() applies, my reduced shard (a loss scaler unscales and checks it: it is no .grad)."""
        return [self.dp.shard_grad]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient to a global norm of max_norm, from the shards; returns the norm before clipping."""
        shard = self.dp.shard_param
        shard.grad = self.dp.shard_grad  # my reduced gradient, as step() hands it to AdamW
        try:
            return comm.clip_grad_norm_([shard], max_norm, [self.dp.group, self.tp_group])
        finally:
            shard.grad = None

    @torch.no_grad()
    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        shard = self.dp.shard_param
        shard.mul_(1 - lr * self.weight_decay * self.decay_mask)  # decoupled decay, only where it applies
        shard.grad = self.dp.shard_grad
        self.inner.step()
        shard.grad = None
        if self.dp.stage < 3:
            self.dp.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dp.zero_grad()

    # ------------------------------------------------------------------ layout-free checkpoint (chapter 14)
    def full_moments(self) -> tuple[dict, float]:
        """{parameter: (exp_avg, exp_avg_sq)} whole, all-gathered unit by unit from the shards (a collective)."""
        st = self.inner.state.get(self.dp.shard_param)
        if not st:
            return {}, 0.0
        out = {}
        for u, so in zip(self.dp.units, self.dp.shard_off):
            fulls = []
            for k in ("exp_avg", "exp_avg_sq"):
                fulls.append(st[k].new_empty(u.numel))
                comm.all_gather_into(fulls[-1], st[k][so:so + u.shard_numel], self.dp.group)
            for (_, p), o in zip(u.params, u.offsets):
                out[p] = tuple(f[o:o + p.numel()].view(p.shape) for f in fulls)
        return out, float(st["step"])

    @torch.no_grad()
    def load_moments(self, moments: dict, step: float) -> None:
        """The inverse: my shard's pieces of each parameter's whole moments."""
        if not moments:
            return
        p = self.dp.shard_param
        bufs = (torch.zeros_like(p), torch.zeros_like(p))
        for u, so in zip(self.dp.units, self.dp.shard_off):
            params = dict(u.params)
            for name, lo, hi, slo, shi in u.pieces(self.dp.r):
                for b, m in zip(bufs, moments[params[name]]):
                    b[so + slo:so + shi] = m.reshape(-1)[lo:hi]
        self.inner.state[p] = {"step": torch.tensor(float(step)), "exp_avg": bufs[0], "exp_avg_sq": bufs[1]}

    # ------------------------------------------------------------------ sharded checkpoint
    def _pieces(self):
        for u, so in zip(self.dp.units, self.dp.shard_off):
            for name, lo, hi, slo, shi in u.pieces(self.dp.r):
                yield name, lo, hi, so + slo, so + shi

    def state_dict(self) -> dict:
        st = self.inner.state.get(self.dp.shard_param, {})
        bufs = {"param": self.dp.shard_param.detach()}
        if st:
            bufs.update(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
        return {"step": float(st["step"]) if st else 0.0, "lr": self.param_groups[0]["lr"],
                "world": self.dp.W, "rank": self.dp.r,
                "pieces": [(n, lo, hi, {k: v[a:b].clone() for k, v in bufs.items()})
                           for n, lo, hi, a, b in self._pieces()]}

    def save_sharded(self, directory: str | Path) -> Path:
        path = Path(directory) / f"optim_rank{self.dp.r:05d}_of_{self.dp.W:05d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), path)
        return path

    @torch.no_grad()
    def load_sharded(self, directory: str | Path) -> None:
        """Load the shards written by save_sharded at any world size: take every piece overlapping mine."""
        files = sorted(Path(directory).glob("optim_rank*_of_*.pt"))
        if not files:
            raise FileNotFoundError(f"no optim_rank*_of_*.pt shards in {directory}")
        saved = [torch.load(f, weights_only=True) for f in files]
        if len(saved) != saved[0]["world"]:
            raise ValueError(f"{directory} holds {len(saved)} shard files but they were written by {saved[0]['world']}"
                             " ranks")
        p = self.dp.shard_param
        bufs = {"param": p.data, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for name, lo, hi, a, _ in self._pieces():
            for s in saved:
                for n2, lo2, hi2, t in s["pieces"]:
                    x, y = max(lo, lo2), min(hi, hi2)
                    if n2 == name and x < y:
                        for k, v in t.items():
                            bufs[k][a + x - lo:a + y - lo] = v[x - lo2:y - lo2]
        if saved[0]["step"] > 0:
            self.inner.state[p] = {"step": torch.tensor(saved[0]["step"]), "exp_avg": bufs["exp_avg"],
                                   "exp_avg_sq": bufs["exp_avg_sq"]}
        self.param_groups[0]["lr"] = saved[0]["lr"]
        if self.dp.stage < 3:
            self.dp.gather_params()



class JointShardedAdamW:
    """Several ``ShardedAdamW`` as one optimizer (step, zero_grad, param_groups, clip, the layout-free moments).

    groups: the norm's squares, every shard's, are summed over each of them (tp_replicas counted as above); the
    shards must cover the whole model once over them (expert parallelism: dp, then tp)."""

    def __init__(self, parts: list[ShardedAdamW], groups):
        self.parts, self.groups = parts, groups
        self.param_groups = [g for opt in parts for g in opt.param_groups]  # train.py sets the lr of each

    def grads(self) -> list[torch.Tensor]:
        return [g for opt in self.parts for g in opt.grads()]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        shards = [opt.dp.shard_param for opt in self.parts]
        for opt in self.parts:
            opt.dp.shard_param.grad = opt.dp.shard_grad
        try:
            return comm.clip_grad_norm_(shards, max_norm, self.groups)
        finally:
            for s in shards:
                s.grad = None

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad()

    def full_moments(self) -> tuple[dict, float]:
        """Every part's {parameter: (exp_avg, exp_avg_sq)} (collectives, in the same order on every rank)."""
        moments, step = {}, 0.0
        for opt in self.parts:
            m, s = opt.full_moments()
            moments.update(m)
            step = max(step, s)
        return moments, step

    def load_moments(self, moments: dict, step: float) -> None:
        for opt in self.parts:
            opt.load_moments(moments, step)


# ----------------------------------------------------------------------------------- the formulas
def memory_per_rank(n_params: int, world: int, stage: int, bytes_per: int = 4) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state (fp32 AdamW: m and v, plus, at stage 1/2, the
    fp32 shard this implementation steps, which mixed-precision ZeRO needs anyway as its master copy)."""
    n, w = n_params * bytes_per, world
    params = n / w if stage == 3 else n
    grads = n if stage <= 1 else n / w
    opt = 2 * n if stage == 0 else (3 * n / w if stage in (1, 2) else 2 * n / w)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def bytes_per_step(n_params: int, world: int, stage: int, bytes_per: int = 4, resident: int = 0) -> float:
    """Bytes each rank sends per optimizer step with ring collectives (padding ignored). resident: parameters of
    a stage-3 unit that stays gathered from forward to backward (minite's root unit: embedding + final norm)."""
    n, f = n_params * bytes_per, (world - 1) / world
    if stage == 0:
        return 2 * f * n  # all-reduce = reduce-scatter + all-gather
    if stage in (1, 2):
        return 2 * f * n  # reduce-scatter grads + all-gather params: the same bytes as DDP
    return 3 * f * n - f * resident * bytes_per  # all-gather for forward, again for backward, reduce-scatter
