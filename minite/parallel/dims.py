"""``ParallelDims(dp, tp, pp, cp)``: every process group of a run, built from one grid and passed in explicitly.

The world's ranks are laid out as a grid ``torch.arange(world).view(pp, dp, cp, tp)``: tp varies fastest, so the
ranks of a tensor-parallel group are neighbours (the same node, the fastest links; Megatron's order). Each
parallel dimension's groups are the lines of the grid along that axis; ``dp_cp`` (the ranks that hold the same
weights when context parallelism is on) is the plane spanned by dp and cp. Nothing is module-global: a layer is
handed the group it reduces over, and a group of size 1 (or no process group at all) makes every collective in
``minite.parallel.comm`` the identity, so ``ParallelDims()`` runs the dense model unchanged in one process.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minite.errors import ParallelError
from minite.parallel import watch

__all__ = ["ParallelDims", "ParallelError", "check_layout", "init_distributed", "select_device"]

AXES = ("pp", "dp", "cp", "tp")  # the grid's axis order, slowest to fastest


def select_device(device: str = "auto", local_world: int | None = None, gpus: int | None = None) -> str:
    """The device type of a torchrun rank: "cuda" (NCCL, cuda:LOCAL_RANK) or "cpu" (gloo).

    CUDA only when the run's device is CUDA and this node has a GPU per local rank (torchrun's LOCAL_WORLD_SIZE):
    ranks sharing one GPU make NCCL fail ("Duplicate GPU detected") or hang. device="auto" falls back to the CPU
    (gloo) when the GPUs are too few; an explicit "cuda"/"cuda:N" fails fast, naming the numbers.
    gpus: this node's GPU count (default: torch.cuda's); launch.worker_device asks the same rule before a launch."""
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    kind = str(device).split(":")[0]
    if kind not in ("auto", "cpu", "cuda"):
        raise ParallelError(f"device {device!r}: expected auto, cpu, cuda or cuda:N")
    if kind == "cpu":
        return "cpu"
    n = gpus if gpus is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= local_world:
        return "cuda"
    if kind == "auto":
        return "cpu"
    raise ParallelError(f"--nproc-per-node {local_world} needs {local_world} GPUs on this node, found {n} (device "
                        f"{device!r}: NCCL wants a GPU per rank); use --train.device=cpu for gloo, or fewer processes")


def init_distributed(timeout_s: float = 60.0, backend: str | None = None, device: str = "auto") -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; (rank, world).

    NCCL with cuda:LOCAL_RANK when ``select_device(device)`` says "cuda" (a GPU per local rank), gloo otherwise.
    Without torchrun's variables this is a single process: (0, 1), nothing initialised. `timeout_s` bounds every
    collective: a rank that dies or hangs makes the others raise within it (torchrun also tears them down).
    backend: force one ("gloo" for workers whose tensors live on the CPU, even on a GPU machine)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    cuda = backend != "gloo" and select_device(device) == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), timeout=datetime.timedelta(seconds=timeout_s))
    watch.start()  # a heartbeat per rank; an error that ends this process names the ranks that stopped
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ParallelDims:
    """Degrees of data (dp), tensor (tp), pipeline (pp), context (cp) and expert (ep, within dp) parallelism."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism (chapter 16): the experts cut over groups of ep dp ranks; not a grid axis
    cp_a2a: int = 1  # hybrid CP (ulysses.py): a2a groups of cp_a2a neighbouring cp ranks, the ring across them
    rank: int = 0
    world: int = 1
    groups: dict = field(default_factory=dict, repr=False)  # axis name -> ProcessGroup (None when size 1)
    ranks: dict = field(default_factory=dict, repr=False)  # axis name -> list of global ranks in my group

    def __post_init__(self):
        for a in AXES:
            v = getattr(self, a)
            if not isinstance(v, int) or v < 1:
                raise ParallelError(f"parallel degree {a}={v!r} must be a positive integer")
        if not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ParallelError(f"expert-parallel degree ep={self.ep!r} must be a positive integer dividing "
                                f"dp={self.dp}")
        if not isinstance(self.cp_a2a, int) or self.cp_a2a < 1 or self.cp % self.cp_a2a:
            raise ParallelError(f"hybrid context parallelism: cp_a2a={self.cp_a2a!r} must be a positive integer "
                                f"dividing cp={self.cp}")

    @classmethod
    def from_config(cls, p, world: int) -> "ParallelDims":
        """The degrees of a ``ParallelConfig`` (not built: no group yet) for a run of `world` processes;
        a ParallelError naming the numbers when world != dp*tp*pp*cp."""
        dims = cls(dp=fill_dp(p, world), tp=p.tp, pp=p.pp, cp=p.cp, ep=getattr(p, "ep", 1),
                   cp_a2a=getattr(p, "cp_a2a", 0) or 1)
        if world != dims.size:
            raise ParallelError(dims._world_mismatch(world))
        return dims

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def _world_mismatch(self, world: int) -> str:
        hint = "launch with torchrun --nproc-per-node N" if world == 1 else f"launch {self.size} processes"
        return (f"world size {world} != dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.size} "
                f"({hint}, or change the degrees)")

    def build(self, rank: int | None = None, world: int | None = None, timeout_s: float = 120.0) -> "ParallelDims":
        """Create every group (a collective call: all ranks call it, in the same order). Returns self.
        timeout_s bounds each collective on these groups (new_group does not inherit init_process_group's)."""
        if rank is None:
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if world != self.size:
            raise ParallelError(self._world_mismatch(world))
        self.rank, self.world = rank, world
        grid = torch.arange(world).view(self.pp, self.dp, self.cp, self.tp)
        for name, axes in (("pp", (0,)), ("dp", (1,)), ("cp", (2,)), ("tp", (3,)), ("dp_cp", (1, 2))):
            keep = [i for i in range(4) if i not in axes]
            lines = grid.permute(*keep, *axes).reshape(-1, math.prod(grid.shape[a] for a in axes))
            for line in lines.tolist():  # every rank creates every group (new_group is collective)
                pg = dist.new_group(line, timeout=datetime.timedelta(seconds=timeout_s)) \
                    if len(line) > 1 and dist.is_initialized() else None
                if rank in line:
                    self.groups[name], self.ranks[name] = pg, line
        # ep: consecutive runs of ep ranks along each dp line; edp: the ranks at the same place of each run
        for line in grid.permute(0, 2, 3, 1).reshape(-1, self.dp).tolist() if self.ep > 1 else []:
            runs = [line[i:i + self.ep] for i in range(0, self.dp, self.ep)]
            for name, lines in (("ep", runs), ("edp", [list(c) for c in zip(*runs)])):
                for sub in lines:
                    pg = dist.new_group(sub, timeout=datetime.timedelta(seconds=timeout_s)) \
                        if len(sub) > 1 and dist.is_initialized() else None
                    if rank in sub:
                        self.groups[name], self.ranks[name] = pg, sub
        # cp_a2a, cp_ring (hybrid CP): runs of cp_a2a ranks along each cp line, and the ranks at the same place of each
        a = self.cp_a2a
        for line in grid.permute(0, 1, 3, 2).reshape(-1, self.cp).tolist() if 1 < a < self.cp else []:
            runs = [line[i:i + a] for i in range(0, self.cp, a)]
            for name, lines in (("cp_a2a", runs), ("cp_ring", [list(c) for c in zip(*runs)])):
                for sub in lines:
                    pg = dist.new_group(sub, timeout=datetime.timedelta(seconds=timeout_s)) \
                        if dist.is_initialized() else None
                    if rank in sub:
                        self.groups[name], self.ranks[name] = pg, sub
        # edp_cp (ep with cp): the edp ranks at every cp index, all the replicas of the same experts over dp x cp
        for plane in grid.permute(0, 3, 2, 1).reshape(-1, self.cp, self.dp) if self.ep > 1 and self.cp > 1 else []:
            for sub in [plane[:, j::self.ep].reshape(-1).tolist() for j in range(self.ep)]:
                pg = dist.new_group(sub, timeout=datetime.timedelta(seconds=timeout_s)) \
                    if dist.is_initialized() else None
                if rank in sub:
                    self.groups["edp_cp"], self.ranks["edp_cp"] = pg, sub
        return self

    # ------------------------------------------------------------------ coordinates and neighbours
    def group(self, name: str):
        return self.groups.get(name)

    def local_rank(self, name: str) -> int:
        return self.ranks[name].index(self.rank) if name in self.ranks else 0

    @property
    def dp_rank(self) -> int:
        return self.local_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.local_rank("tp")

    @property
    def ep_rank(self) -> int:
        return self.local_rank("ep")

    @property
    def pp_rank(self) -> int:
        return self.local_rank("pp")

    @property
    def cp_rank(self) -> int:
        return self.local_rank("cp")

    def neighbour(self, name: str, step: int) -> int:
        """Global rank `step` places along axis `name` (ring order): pp's next/previous stage, cp's ring."""
        line = self.ranks.get(name, [self.rank])
        return line[(line.index(self.rank) + step) % len(line)]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ validation against a model
    def check_model(self, cfg) -> None:
        """Reject a GPTConfig the layout cannot shard, naming the numbers (tp vs heads, kv heads, vocab, MLP)."""
        tp, errs = self.tp, []
        if cfg.n_head % tp:
            errs.append(f"n_head={cfg.n_head} is not divisible by tp={tp}")
        kvh = cfg.n_kv_head
        if kvh % tp and tp % kvh:
            errs.append(f"n_kv_head={kvh} and tp={tp}: one must divide the other (kv heads split or replicated)")
        if cfg.padded_vocab_size % tp:
            errs.append(f"padded vocab {cfg.padded_vocab_size} is not divisible by tp={tp}")
        if cfg.mlp_hidden % tp and not getattr(cfg, "moe_num_experts", 0):  # a MoE is whole on every tp rank
            errs.append(f"mlp_hidden={cfg.mlp_hidden} is not divisible by tp={tp}")
        if self.pp > cfg.n_layer:
            errs.append(f"pp={self.pp} stages but only n_layer={cfg.n_layer} layers")
        split = [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp") if getattr(self, k) > 1]
        if not getattr(cfg, "tie_embeddings", True) and split:  # their heads read the (vocab-split) wte
            errs.append(f"model.tie_embeddings=False (an untied LM head) is not supported with {', '.join(split)}: "
                        "their LM head is the (vocab-split) token embedding; dp keeps a head whole")
        E = getattr(cfg, "moe_num_experts", 0)
        if self.ep > 1 and (E == 0 or E % self.ep):
            errs.append(f"ep={self.ep} needs a number of experts divisible by it, got moe_num_experts={E}")
        if errs:
            raise ParallelError("cannot shard this GPT: " + "; ".join(errs))


def fill_dp(p, world: int) -> int:
    """The data-parallel degree of ParallelConfig `p` in a run of `world` processes: ``p.dp``, or when it is 0
    (the default) whatever fills the world, world // (tp*pp*cp), as torchtitan's dp_shard=-1 and nanoGPT's DDP
    do. A world the other degrees do not divide is then refused by the world-size check, which names the numbers."""
    return p.dp or max(1, world // (p.tp * p.pp * p.cp))


def check_layout(p, model, *, world: int, seq_len: int, batch_size: int, lora_r: int = 0) -> None:
    """Reject a parallel layout that cannot work, naming every number, before any process group exists.

    p: the run's ParallelConfig; model: its GPTConfig; world: the processes launched; seq_len: the training
    sequence length T; batch_size: the global batch; lora_r: the LoRA rank (0: no LoRA). Checked: the degrees
    against the world size, tp against heads / MLP / vocabulary, pp against layers, cp and sp against the
    sequence, dp and micro-batches against the global batch, and the combinations not built here."""
    if not p.dp:  # 0: data parallelism fills the world
        p = dataclasses.replace(p, dp=fill_dp(p, world))
    errs = []
    try:
        dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=getattr(p, "ep", 1))
    except ParallelError as e:  # ep does not divide dp: report it with the rest
        errs.append(str(e))
        dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp)
    if world != dims.size:
        errs.append(dims._world_mismatch(world))
    try:
        dims.check_model(model)
    except ParallelError as e:
        errs.append(str(e).removeprefix("cannot shard this GPT: "))
    T = seq_len
    B = batch_size
    if p.cp > 1 and T % (2 * p.cp):  # context parallelism cuts each sequence into 2*cp load-balanced chunks
        errs.append(f"context parallelism: sequence length T={T} must be divisible by 2*cp={2 * p.cp}")
    elif p.sp and p.tp > 1 and (T // p.cp) % p.tp:
        errs.append(f"sequence parallelism with cp={p.cp}, tp={p.tp}: T/cp = {T}/{p.cp} = {T // p.cp} tokens "
                    f"per cp rank must be divisible by tp={p.tp}")
    a = {"a2a": p.cp, "hybrid": getattr(p, "cp_a2a", 1)}.get(getattr(p, "cp_mode", "ring"), 1)
    if a > 1 and model.n_head % p.tp == 0:  # Ulysses: each tp rank's heads split over the all-to-all
        from minite.parallel.ulysses import check_heads
        try:
            check_heads(model.n_head // p.tp, max(model.n_kv_head // p.tp, 1), a,
                        "cp" if p.cp_mode == "a2a" else "cp_a2a", f" (per tp rank, tp={p.tp})" if p.tp > 1 else "")
        except ParallelError as e:
            errs.append(str(e))
    microbatches = p.microbatches or p.pp
    if B % p.dp:
        errs.append(f"train.batch_size={B} (the global batch) is not divisible by dp={p.dp}")
    elif p.pp > 1 and (B // p.dp) % microbatches:
        errs.append(f"the batch of {B // p.dp} sequences per dp rank does not split into {microbatches} "
                    "micro-batches (--parallel.microbatches)")
    if p.pp > 1 and getattr(p, "pp_schedule", "") == "interleaved" and (  # issue 38
            model.n_layer < 2 * p.pp or microbatches % p.pp or p.tp * p.cp > 1 or model.moe_num_experts):
        errs.append(f"pp_schedule=interleaved (2 chunks a rank) needs n_layer >= 2*pp = {2 * p.pp} (n_layer="
                    f"{model.n_layer}), micro-batches divisible by pp={p.pp} ({microbatches}), tp=cp=1 and no MoE "
                    f"(tp={p.tp}, cp={p.cp}, moe_num_experts={model.moe_num_experts})")
    unsupported = [
        (p.pp > 1 and p.zero > 0, f"pp={p.pp} with zero={p.zero} (use zero=0: the pipeline averages gradients "
                                  "over dp itself)"),
        (p.zero == 3 and p.tp > 1, f"zero=3 with tp={p.tp} (use zero 0-2 with tp)"),
        (lora_r > 0 and dims.size > 1, f"LoRA (lora.r={lora_r}) under a parallel layout (fine-tune in one "
                                       "process)"),
    ]
    for bad, why in unsupported:
        if bad:
            errs.append(f"{why} is not supported")
    if errs:
        raise ParallelError("parallel layout rejected: " + "; ".join(errs))
