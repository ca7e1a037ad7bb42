"""What ``torchrun --nproc-per-node N -m minite.train --parallel.dp=.. --parallel.tp=.. --parallel.zero=..`` runs.

``setup_parallel(cfg)`` initialises torch.distributed from torchrun's environment, builds ``ParallelDims`` and
returns a ``Parallel``: the handful of hooks minite.train calls (wrap the model, build the optimizer, cut the
global batch, finish gradient reduction, clip, log the global loss, consolidate a checkpoint). One process with
every degree 1 gets the same object doing nothing, so the training loop has a single code path.

Semantics (DESIGN §6): ``--train.batch_size`` is the global batch. Every rank draws the same global batch from the
same seeded sampler and keeps its 1/dp slice, so any layout trains on the same tokens as one process; rank 0 logs
the loss averaged over the dp group, the loss of the global batch.
"""
from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist

from minite.parallel import comm, reshard
from minite.parallel.dims import ParallelDims, ParallelError, check_layout, init_distributed, select_device

__all__ = ["Parallel", "setup_parallel", "clip_grad_norm_"]


def clip_grad_norm_(params, max_norm: float, tp_group=None) -> torch.Tensor:
    """Global-norm clipping for TP-sharded parameters: sum g^2 / tp_replicas locally, all-reduce over tp."""
    params = [p for p in params if p.grad is not None]
    sq = sum(((p.grad.double() ** 2) / torch.as_tensor(getattr(p, "tp_replicas", 1), dtype=torch.float64,
                                                        device=p.grad.device)).sum() for p in params).reshape(1)
    comm.all_reduce(sq, tp_group)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return norm


class Parallel:
    def __init__(self, dims: ParallelDims, zero: int = 0, sp: bool = False):
        self.dims, self.zero, self.sp = dims, zero, sp
        self.world, self.is_main = dims.world, dims.is_main
        self.dp, self.dev = None, torch.device("cpu")  # the DataParallel wrapper, when dp > 1 or zero > 0
        self.pipe = None  # the PipelineGPT, when pp > 1
        self.run_device = None  # torchrun: "cuda" (NCCL, a GPU per local rank) or "cpu" (gloo); dims.select_device

    @property
    def active(self) -> bool:
        return self.world > 1

    def device(self, dev: torch.device) -> torch.device:
        if self.active and self.run_device == "cpu":  # gloo: train.device=auto with fewer GPUs than ranks
            dev = torch.device("cpu")
        elif dev.type == "cuda" and self.active:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.dev = dev
        return dev

    def main_first(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on rank 0 first (e.g. preparing the data cache), then on the others."""
        if self.is_main:
            out = fn(*args, **kwargs)
        if self.active:
            dist.barrier()
        return out if self.is_main else fn(*args, **kwargs)

    def save(self, save_fn, path, state: dict) -> None:
        """Rank 0 writes (the state was gathered on every rank)."""
        if self.is_main:
            save_fn(path, state)

    def wrap(self, model):
        d = self.dims
        d.check_model(model.config)
        if d.tp > 1:
            from minite.parallel.sequence import TPGPT
            model = TPGPT.from_dense(model, d.group("tp"), sequence_parallel=self.sp)
        if d.cp > 1:  # chapter 13: my tokens of each sequence, attention by the ring; grads averaged over dp x cp
            from minite.parallel.context_gpt import CPGPT
            model = CPGPT.from_dense(model, d.group("cp"))
        if d.pp > 1:  # chapter 12: this rank's stage of that model; the pipeline averages grads over dp (x cp)
            from minite.parallel.pipeline import PipelineGPT
            self.pipe = PipelineGPT(model, d, *getattr(self, "pp_args", (0, "1f1b")))
            return self.pipe
        if d.dp > 1 or self.zero > 0 or d.cp > 1:
            from minite.parallel.data import DataParallel
            self.dp = DataParallel(model, d.group("dp_cp" if d.cp > 1 else "dp"), stage=self.zero)
        return model

    def optimizer(self, model, make, t):
        if self.dp is None or self.zero == 0:
            return make(model)
        from minite.parallel.zero import ShardedAdamW
        return ShardedAdamW(self.dp, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            norm_weight=lambda n, p: 1.0 / torch.as_tensor(getattr(p, "tp_replicas", 1)),
                            tp_group=self.dims.group("tp"))

    def shard_batch(self, x, y, sync: bool = True):
        """My dp slice of the global batch; sync=False: the gradients of this micro-batch are not reduced yet."""
        if self.dp is not None:
            self.dp.sync = sync
        if self.pipe is not None:
            self.pipe.sync = sync
        d = self.dims
        if d.dp == 1:
            return x, y
        if x.shape[0] % d.dp:
            raise ParallelError(f"train.batch_size={x.shape[0]} (the global batch) is not divisible by dp={d.dp}")
        n = x.shape[0] // d.dp
        return x[d.dp_rank * n:(d.dp_rank + 1) * n], y[d.dp_rank * n:(d.dp_rank + 1) * n]

    def clip(self, model, opt, max_norm: float):
        if hasattr(opt, "clip_grad_norm_"):
            return opt.clip_grad_norm_(max_norm)
        if hasattr(model, "clip_grad_norm_"):  # PipelineGPT: the norm over every stage
            return model.clip_grad_norm_(max_norm)
        if self.dims.tp > 1:
            return clip_grad_norm_(model.parameters(), max_norm, self.dims.group("tp"))
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def global_loss(self, loss: float) -> float:
        if self.dims.dp == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64, device=self.dev)  # NCCL reduces CUDA tensors only
        comm.all_reduce(t, self.dims.group("dp"))
        return float(t) / self.dims.dp

    def model_state(self, model) -> dict:
        """The dense model's state dict (collective: every rank calls it; rank 0 writes it)."""
        if self.dp is not None and self.zero == 3:
            return self.dp.full_state_dict()
        return model.dense_state_dict() if hasattr(model, "dense_state_dict") else model.state_dict()

    def optim_state(self, opt, model) -> dict:
        """The checkpoint's "optimizer" entry: the dense AdamW state, whatever the layout (collective; reshard.py)."""
        return reshard.dense_optim_state(model, opt, self.dims)

    def load_optim(self, opt, model, state: dict, path) -> None:
        """Resume: this rank's slice of a dense AdamW state written under any layout (reshard.py)."""
        reshard.load_dense_optim_state(model, opt, state, path)


def setup_parallel(cfg, resume: bool = False) -> Parallel:
    """Check the layout (before any process group exists), initialise torch.distributed, build the groups."""
    p = cfg.parallel
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1)
    rank, world = init_distributed(p.timeout_s, device=cfg.train.device)  # too few GPUs for cuda: fails fast
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp).build(rank, world, p.timeout_s)
    if world > 1:
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        if rank != 0:  # one voice: rank 0 prints and logs; errors still reach stderr from every rank
            sys.stdout = open(os.devnull, "w")
            cfg.train.progress = False
    par = Parallel(dims, zero=p.zero, sp=p.sp)
    if world > 1:
        par.run_device = select_device(cfg.train.device)
        if par.run_device == "cpu" and cfg.train.device == "auto" and torch.cuda.is_available() and rank == 0:
            print(f"minite: train.device=auto, {torch.cuda.device_count()} GPU(s) for "
                  f"{os.environ.get('LOCAL_WORLD_SIZE', world)} local ranks: running on the CPU (gloo)",
                  file=sys.stderr, flush=True)
    par.pp_args = (p.microbatches, p.pp_schedule)  # chapter 12: PipelineGPT's micro-batches and schedule
    return par
