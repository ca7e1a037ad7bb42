"""What ``torchrun --nproc-per-node N -m minite.train --parallel.dp=.. --parallel.tp=.. --parallel.zero=..`` runs.

``setup_parallel(cfg)`` checks the layout, initialises torch.distributed from torchrun's environment, builds
``ParallelDims`` and returns a ``Parallel``, built whole: the handful of hooks minite.train calls (wrap the model,
build the optimizer, cut the global batch, hold gradient reduction back with ``no_sync()``, clip, log the global
loss, consolidate a checkpoint). One process with every degree 1 gets the same object doing nothing, so the
training loop has a single code path. It changes no configuration and no global state of the caller's:
``quiet()`` is the one place rank != 0 is silenced.

Semantics (DESIGN §6): ``--train.batch_size`` is the global batch. Every rank draws the same global batch from the
same seeded sampler and keeps its 1/dp slice, so any layout trains on the same tokens as one process; rank 0 logs
the loss averaged over the dp group, the loss of the global batch.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys

import torch
import torch.distributed as dist

from minite.parallel import comm, reshard, watch
from minite.parallel.dims import ParallelDims, ParallelError, check_layout, fill_dp, init_distributed, select_device

__all__ = ["Parallel", "setup_parallel", "exit_process"]


class Parallel:
    """The parallel layout of one run, as minite.train sees it.

    dims: the process groups; zero: ZeRO stage (0-3); sp: sequence parallelism (with tp); microbatches and
    schedule: the pipeline's (pp > 1); run_device: "cuda" (NCCL) or "cpu" (gloo) under torchrun, None alone.
    """

    def __init__(self, dims: ParallelDims, *, zero: int = 0, sp: bool = False, microbatches: int = 0,
                 schedule: str = "1f1b", run_device: str | None = None, cp_mode: str = "ring"):
        self.dims = dims
        self.zero = zero
        self.sp = sp
        self.microbatches = microbatches
        self.schedule = schedule
        self.cp_mode = cp_mode  # ring | a2a | hybrid (ulysses.py)
        self.run_device = run_device
        self.dp = None  # the DataParallel wrapper, once wrap() made one (dp > 1, zero > 0 or cp > 1)
        self.pipe = None  # the PipelineGPT, once wrap() made one (pp > 1)
        self.dev = torch.device("cpu")

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def is_main(self) -> bool:
        return self.dims.is_main

    @property
    def active(self) -> bool:
        return self.world > 1

    def device(self, dev: torch.device) -> torch.device:
        """This rank's device for a run asking for `dev`: cuda:LOCAL_RANK under torchrun, the CPU on gloo."""
        if self.active and self.run_device == "cpu":  # gloo: train.device=auto with fewer GPUs than ranks
            dev = torch.device("cpu")
        elif dev.type == "cuda" and self.active:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.dev = dev
        return dev

    @contextlib.contextmanager
    def quiet(self):
        """Inside, rank 0 speaks for the run: the other ranks' stdout goes nowhere (errors still reach stderr)."""
        if self.is_main:
            yield
            return
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            yield

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
            hybrid = (d.group("cp_a2a"), d.group("cp_ring")) if self.cp_mode == "hybrid" else None
            model = CPGPT.from_dense(model, d.group("cp"), variant=self.cp_mode, hybrid=hybrid)
        if d.pp > 1:  # chapter 12: this rank's stage of that model; the pipeline averages grads over dp (x cp)
            from minite.parallel.pipeline import PipelineGPT
            model = self.pipe = PipelineGPT(model, d, self.microbatches, self.schedule)  # (its MoE copies, below)
        if getattr(model.config, "moe_num_experts", 0) and d.dp * d.cp > 1:  # chapter 16: the global load
            from minite.parallel.expert import install_batch_load  # into the MoEs that run (CPGPT's are the
            install_batch_load(model, d)  # wrapped model's, a stage's its own): counts summed over dp (x cp)
        if d.ep > 1:  # chapter 16: my experts; dense grads averaged over dp, expert grads over the replicas (edp)
            from minite.parallel.expert import ExpertDataParallel, ExpertZero, shard_experts
            shard_experts(model, d)
            if self.pipe is None:  # (the pipeline reduces its stage's gradients itself) ZeRO: the dense parameters
                self.dp = ExpertZero(model, d, self.zero) if self.zero else ExpertDataParallel(model, d)  # over dp,
            # the experts over edp
            return model
        if self.pipe is not None:
            return self.pipe
        if d.dp > 1 or self.zero > 0 or d.cp > 1:
            from minite.parallel.data import DataParallel
            self.dp = DataParallel(model, d.group("dp_cp" if d.cp > 1 else "dp"), stage=self.zero)
        return model

    def optimizer(self, model, make, t):
        if self.dp is None or self.zero == 0:
            return make(model)
        from minite.parallel.zero import ShardedAdamW
        kw = dict(lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
        if self.dims.ep > 1:  # expert.ExpertZero: one optimizer over the dense and the expert shards
            return self.dp.optimizer(**kw)
        return ShardedAdamW(self.dp, tp_group=self.dims.group("tp"), **kw)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients without reducing them over dp (every micro-batch of a
        gradient-accumulation step but the last), like torch DDP's no_sync()."""
        with contextlib.ExitStack() as stack:
            for wrapper in (self.dp, self.pipe):
                if wrapper is not None:
                    stack.enter_context(wrapper.no_sync())
            yield

    def shard_batch(self, x, y):
        """My dp slice of the global batch."""
        d = self.dims
        if d.dp == 1:
            return x, y
        if x.shape[0] % d.dp:
            raise ParallelError(f"train.batch_size={x.shape[0]} (the global batch) is not divisible by dp={d.dp}")
        n = x.shape[0] // d.dp
        mine = slice(d.dp_rank * n, (d.dp_rank + 1) * n)
        return x[mine], y[mine]

    def clip(self, model, opt, max_norm: float):
        """Clip the global gradient norm of the whole (sharded) model; returns the norm before clipping."""
        if self.dims.ep > 1 and self.pipe is None:  # the experts' part of the norm summed over the ep group
            return self.dp.clip_grad_norm_(max_norm)
        if hasattr(opt, "clip_grad_norm_"):  # ZeRO: the norm over every shard
            return opt.clip_grad_norm_(max_norm)
        if hasattr(model, "clip_grad_norm_"):  # PipelineGPT: the norm over every stage
            return model.clip_grad_norm_(max_norm)
        if self.dims.tp > 1:
            return comm.clip_grad_norm_(model.parameters(), max_norm, [self.dims.group("tp")])
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def global_loss(self, loss: float) -> float:
        if self.dims.dp == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64, device=self.dev)  # NCCL reduces CUDA tensors only
        comm.all_reduce(t, self.dims.group("dp"))
        return float(t) / self.dims.dp

    def found_inf_anywhere(self, found: bool) -> bool:
        """FP16's loss-scaler verdict OR-ed over the world (one all-reduce of one flag): a rank holding only a
        shard, tp slice or stage of the model may see the inf alone, yet every rank must skip that step."""
        if not self.active:
            return found
        flag = torch.tensor([float(found)], device=self.dev)  # NCCL reduces CUDA tensors only, gloo CPU ones
        comm.all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX)  # the world: every rank holds part of it
        return bool(flag.item())

    def model_state(self, model) -> dict:
        """The dense model's state dict (collective: every rank calls it; rank 0 writes it)."""
        if self.dims.ep > 1 and self.pipe is None:  # the experts all-gathered over ep (ZeRO-3: every unit gathered
            return self.dp.dense_state_dict()  # first; the pipeline gathers its own)
        if self.dp is not None and self.zero == 3:
            return self.dp.full_state_dict()
        return model.dense_state_dict() if hasattr(model, "dense_state_dict") else model.state_dict()

    def optim_state(self, opt, model) -> dict:
        """The checkpoint's "optimizer" entry: the dense AdamW state, whatever the layout (collective; reshard.py)."""
        if self.dims.ep > 1 and self.pipe is None:
            return self.dp.dense_optim_state(opt)
        return reshard.dense_optim_state(model, opt, self.dims)

    def load_optim(self, opt, model, state: dict, path) -> None:
        """Resume: this rank's slice of a dense AdamW state written under any layout (reshard.py)."""
        reshard.load_dense_optim_state(model, opt, state, path)


def _shutdown() -> None:
    """At exit: the heartbeat first (its thread talks to the group's store), then the process group."""
    watch.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """The end of a ``python -m minite.train`` process: in a process group, leave it together and end the process
    without the interpreter's finalisation; otherwise ``sys.exit(code)``.

    Why: the subgroups (dp, cp, ep, ...) stay referenced by the model's modules and autograd state after
    ``destroy_process_group``, so their gloo backends are destroyed during interpreter finalisation, while gloo's
    worker threads may still hold tensors whose release needs the GIL: the process then dies of SIGABRT
    ("terminate called without an active exception") after a run that succeeded, and torchrun reports the whole
    run as failed. Every file of the run is closed by now; stdout and stderr are flushed before ``os._exit``."""
    if not dist.is_initialized():
        sys.exit(code)
    try:
        if code == 0:  # a clean end: nobody closes its connections while a peer still talks on them
            dist.barrier()
        watch.stop()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def setup_parallel(cfg) -> Parallel:
    """The run's (minite.config.RunConfig, final) layout: checked before any process group exists, then
    torch.distributed initialised from torchrun's environment and the groups built."""
    p = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    p.dp = fill_dp(p, world)  # --parallel.dp=0 (the default): data parallelism fills the world
    check_layout(p, cfg.model, world=world, seq_len=cfg.data.block_size or cfg.model.block_size,
                 batch_size=cfg.train.batch_size, lora_r=cfg.lora.r)
    rank, world = init_distributed(p.timeout_s, device=cfg.train.device)  # too few GPUs for cuda: fails fast
    dims = ParallelDims.from_config(p, world).build(rank, world, p.timeout_s)
    run_device = None
    if world > 1:
        atexit.register(_shutdown)
        run_device = select_device(cfg.train.device)
        if run_device == "cpu" and cfg.train.device == "auto" and torch.cuda.is_available() and rank == 0:
            print(f"minite: train.device=auto, {torch.cuda.device_count()} GPU(s) for "
                  f"{os.environ.get('LOCAL_WORLD_SIZE', world)} local ranks: running on the CPU (gloo)",
                  file=sys.stderr, flush=True)
    return Parallel(dims, zero=p.zero, sp=p.sp, microbatches=p.microbatches, schedule=p.pp_schedule,
                    run_device=run_device, cp_mode=p.cp_mode)
