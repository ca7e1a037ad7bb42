"""Train the minite GPT: ``python -m minite.train [--preset cpu|gpu] [--data FILE] [--section.field=value ...]``.

    python -m minite.train                                   # Shakespeare, `cpu` preset (or `gpu` with CUDA)
    python -m minite.train --data my.txt --train.max_iters=500 --out_dir out/mine
    python -m minite.train --out_dir out/mine --resume       # continue exactly where a run stopped
    torchrun --nproc-per-node 4 -m minite.train --parallel.tp=2 --parallel.pp=2 --train.stop_at=500   # chapters 10-14
    python -m minite.train --init_from out/ckpt.pt --lora.r=8 --data notes.txt --out_dir out/lora   # LoRA (ch. 09)
    python -m minite.train --train.tensorboard=True          # also TensorBoard scalars in out_dir (minite[tb])
    python -m minite.train --help                            # every field, its doc and its default

One loop, nanoGPT-style: AdamW with warm-up and cosine decay, gradient clipping and accumulation, fixed val batches,
atomic checkpoints with every RNG state (a resumed run reproduces the uninterrupted one). Precision: fp32, bf16/fp16
autocast, or fp8 (fp8_autocast over every minite.nn.Linear). torch.compile on CUDA by default (minite/compile.py).

The run reads top to bottom, in four steps (torchtitan's split, nanoGPT's clarity):

    resolve(cfg, resume=)   the final configuration, decided once: the checkpoint's (--resume), the base's model
                            (--init_from), the data's vocabulary; the prepared data and the states to load
    build(plan, par)        the model (loaded, wrapped by the parallel layout, compiled), optimizer, precision,
                            batch sampler, restored states: a Run
    train_step(run)         one optimizer step on the global batch: accumulation, loss scaling, clipping
    loop(run)               evaluate, checkpoint, log, step, until --train.stop_at or --train.max_iters
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from minite import choices, finetune, resources
from minite.backend import get_backend
from minite.checkpoint import (
    CheckpointError,
    check_finite,
    clean_orphans,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from minite.compile import CompileClock, blocks_of, compile_model, eager_mode
from minite.config import ConfigError, RunConfig, apply_overrides, config_help, make_config, valid_keys
from minite.data import BatchSampler, DataError, PreparedData, prepare
from minite.errors import DivergenceError
from minite.layers.moe import step_expert_bias
from minite.models.gpt import GPT
from minite.parallel.dims import ParallelError, select_device
from minite.parallel.runtime import Parallel, setup_parallel
from minite.recompute import apply_recompute
from minite.resources import check_memory, pick_threads

__all__ = ["train", "resolve", "build", "train_step", "loop", "Plan", "Run", "main", "parse_cli",
           "save_checkpoint", "load_checkpoint", "CheckpointError"]


# ----------------------------------------------------------------------------------------------- 1. resolve
@dataclass
class Plan:
    """What resolve() decided before anything is built."""

    cfg: RunConfig  # final: every later step reads it, none changes it
    data: PreparedData
    block: int  # tokens per training sequence (data.block_size, or the model's)
    resume: dict | None = None  # the checkpoint this run continues (--resume)
    base: dict | None = None  # the checkpoint this run fine-tunes (--init_from)
    t0: float = field(default_factory=time.perf_counter)  # when the run started (elapsed_s counts from here)


def resolve(cfg: RunConfig, *, resume: bool = False, overrides: dict | None = None) -> Plan:
    """Finalise the run's configuration once, and prepare its data.

    resume: start from ``<out_dir>/ckpt.pt``'s configuration, then `overrides` (train/data keys that do not
    change the model). Then the base's model fields (--init_from) and the data's vocabulary size.
    """
    t0 = time.perf_counter()
    ckpt_path = Path(cfg.train.out_dir) / "ckpt.pt"
    for tmp, size in clean_orphans(ckpt_path):  # a run killed while writing a checkpoint left these
        print(f"minite.train: removed {tmp.name} ({size / 1e6:.1f} MB), left by a checkpoint write that was "
              f"interrupted", flush=True)
    state = None
    if cfg.train.tensorboard:
        _summary_writer()  # not installed: say so now, before any data or model is built
    if not resume:
        _check_no_other_run(cfg, ckpt_path)
    if resume:
        state = load_checkpoint(ckpt_path)
        # The saved stop_at ended the previous job; this one runs on unless told where to stop. Invalid values fail
        # here, named. The parallel layout is whatever this launch says (checkpoints are layout-free).
        cfg = apply_overrides(state["config"], {"train.stop_at": 0, **(overrides or {})})
        _check_same_model(cfg, state, ckpt_path)
    # --init_from: the base's model fields and vocab (chapter 09); --model.* flags that disagree are refused
    base, base_tok, final = finetune.base_of(cfg, requested=overrides)
    d = cfg.data
    tokenizer = final.get("data.tokenizer", d.tokenizer)
    data = prepare(d.path or None, data_dir=d.data_dir, tokenizer=tokenizer, vocab=base_tok,
                   unknown_chars=d.unknown_chars)  # every torchrun rank: one writes, the others wait and read
    if state is not None:
        _check_same_vocab(cfg, state, data, ckpt_path)
        _check_resumable(cfg, state, ckpt_path)
    final["model.vocab_size"] = data.tokenizer.vocab_size  # the data decides the vocabulary
    cfg = apply_overrides(cfg, final)
    block = cfg.data.block_size or cfg.model.block_size
    if block > cfg.model.block_size:
        raise ConfigError(f"data.block_size={block} is larger than the model's block_size={cfg.model.block_size}")
    return Plan(cfg, data, block, resume=state, base=base, t0=t0)


def _check_no_other_run(cfg: RunConfig, path: Path) -> None:
    """A new run never silently replaces another run's checkpoints."""
    if not path.exists():
        return
    if not cfg.train.overwrite:
        raise ConfigError(f"{path} holds another run's checkpoint; continue it with --resume, start this run in "
                          f"another --out_dir, or replace it with --train.overwrite=True")
    best = path.with_name("ckpt_best.pt")
    if best.exists():
        best.unlink()  # the replaced run's best would pose as this run's


def _check_same_model(cfg: RunConfig, state: dict, path: Path) -> None:
    old = state["config"]["model"]
    changed = [f"{k}: {old.get(k)!r} in the checkpoint, {v!r} requested"
               for k, v in cfg.model.to_dict().items() if old.get(k) != v]
    if changed:
        raise ConfigError(f"cannot change model fields when resuming from {path} ({'; '.join(changed)}): "
                          "the checkpoint fixes the model; drop those --model flags or use a new --out_dir")


def _check_resumable(cfg: RunConfig, state: dict, path: Path) -> None:
    step = state["step"]
    if step >= cfg.train.max_iters:
        raise ConfigError(f"the run in {path.parent} has finished: its checkpoint is at step {step} and "
                          f"--train.max_iters={cfg.train.max_iters}; to train on, resume with "
                          f"--train.max_iters=N > {step} (the learning-rate schedule then runs to N)")
    check_finite(state["model"], path)


def _check_same_vocab(cfg: RunConfig, state: dict, data: PreparedData, path: Path) -> None:
    tok = data.tokenizer
    if state.get("tokenizer") in (None, tok.to_json()):  # the same padded V is not enough: the same symbols
        return
    old = state["tokenizer"]
    src = state["config"]["data"].get("path") or "the default corpus"
    raise ConfigError(f"checkpoint {path} was trained with a {old['kind']} vocab of {old['vocab_size']} "
                      f"symbols from {src}; --data {cfg.data.path or '(default corpus)'} has a different vocab "
                      f"({tok.vocab_size} symbols); resume with the same data or start a new --out_dir")


# ----------------------------------------------------------------------------------------------- 2. build
@dataclass
class Run:
    """Everything the loop needs: built by build(), advanced by train_step() and loop()."""

    plan: Plan
    par: Parallel
    dev: torch.device
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    ctx: object  # () -> the forward's context: autocast, fp8_autocast or nothing
    scaler: object  # fp16's DynamicLossScaler, else None
    sampler: BatchSampler
    compiled: str
    step: int = 0
    best_val: float = float("inf")
    val_loss: float = float("nan")
    val_step: int = -1  # the step of the last evaluation
    elapsed_before: float = 0.0  # seconds the run had taken before a resume
    train_time: float = 0.0  # seconds in train_step, compilation included
    clock: CompileClock = field(default_factory=CompileClock)  # compiling vs steady state, in this job
    losses: dict = field(default_factory=dict)  # {step: the global batch's train loss}
    grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, before clipping
    tb: object = None  # --train.tensorboard: rank 0's SummaryWriter

    @property
    def cfg(self) -> RunConfig:
        return self.plan.cfg

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.out_dir)

    def elapsed(self) -> float:
        """Seconds of this run, over every job of it (resumes included)."""
        return self.elapsed_before + time.perf_counter() - self.plan.t0


def build(plan: Plan, par: Parallel) -> Run:
    """The model (base or resumed weights, adapters, parallel wrappers, recompute, compile), the optimizer, the
    precision and the batch sampler, on this rank's device; a resumed run gets every state back."""
    cfg = plan.cfg
    t = cfg.train
    dev = par.device(_device(t.device))
    check_memory(plan.cfg, plan.block, par.dims, dev)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    sampler = BatchSampler(plan.data.split("train"), plan.block, t.batch_size, seed=t.seed, split="train", device=dev)
    BatchSampler(plan.data.split("val"), plan.block, t.batch_size, split="val")  # fail now, not at the first eval
    model = GPT(cfg.model).to(dev)
    finetune.prepare_model(model, cfg, plan.base)  # base weights, LoRA adapters (base frozen), trainable vs total
    if plan.resume is not None:  # the dense weights, before the wrappers cut them: any layout resumes any checkpoint
        finetune.load_model_state(model, plan.resume["model"], cfg, Path(t.out_dir) / "ckpt.pt")
    model = par.wrap(model)  # TP(+SP) GPT from the dense one, pipeline stage, DP / ZeRO gradient hooks
    apply_recompute(model, t.recompute)  # activation recompute per block (chapter 14), after the wrappers
    compiled = compile_model(model, t, dev)  # in place: state_dict keys unchanged
    if dev.type == "cpu":
        torch.set_num_threads(t.threads or (1 if par.active else pick_threads(model, t.batch_size, plan.block)))
    opt = par.optimizer(model, lambda m: _optimizer(m, t, dev), t)  # ZeRO >= 1: the sharded AdamW
    ctx, scaler = _precision(cfg, dev)
    if scaler is not None and par.active:  # fp16: skip a step on every rank when any rank's gradient overflowed
        scaler.found_inf_everywhere = par.found_inf_anywhere
        if par.pipe is not None:  # and the pipeline's own backward starts from the scaled loss's gradient
            par.pipe.grad_scale = lambda: scaler.scale_value
    run = Run(plan, par, dev, model, opt, ctx, scaler, sampler, compiled)
    if plan.resume is not None:
        _restore(run, plan.resume)
    return run


def _restore(run: Run, state: dict) -> None:
    """Optimizer, loss scaler, every RNG and the counters from the checkpoint resumed."""
    path = run.out / "ckpt.pt"
    moments = state["optimizer"]
    if state["step"] > 0 and isinstance(moments, dict) and not (moments.get("state") or moments.get("exp_avg")):
        raise CheckpointError(f"checkpoint {path} is at step {state['step']} but its optimizer state is empty "
                              "(AdamW's moments are lost); start a new run from its weights with --init_from")
    try:  # the dense AdamW state, sliced for this rank's parameters (minite/parallel/reshard.py)
        run.par.load_optim(run.opt, run.model, moments, path)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: the optimizer state does not fit the model ({e})") from e
    if run.scaler is not None and state.get("scaler") is not None:
        run.scaler.load_state_dict(state["scaler"])
    try:
        set_rng_state(state["rng"], run.sampler)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: its random-number state ('rng') is missing or malformed "
                              f"({type(e).__name__}: {e}); the run cannot continue exactly") from e
    run.step = state["step"]
    run.best_val = state.get("best_val", run.best_val)
    run.elapsed_before = state.get("elapsed_s", 0.0)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use cpu or auto")
    return dev


def _precision_name(t, dev: torch.device) -> str:
    """train.precision, with auto resolved: bf16 on CUDA, fp32 on the CPU."""
    if t.precision == "auto":
        return "bf16" if dev.type == "cuda" else "fp32"
    return t.precision


def _precision(cfg: RunConfig, dev: torch.device):
    """(forward context factory, loss scaler or None) for train.precision."""
    p = _precision_name(cfg.train, dev)
    if p == "fp32":
        return contextlib.nullcontext, None
    if p in ("bf16", "fp16"):
        dtype = torch.bfloat16 if p == "bf16" else torch.float16
        scaler = None
        if p == "fp16":  # fp16's 5 exponent bits underflow small gradients: scale the loss up, unscale grads
            from minite.formats import DynamicLossScaler
            scaler = DynamicLossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                       growth_interval=1000)
        return (lambda: torch.autocast(device_type=dev.type, dtype=dtype)), scaler
    if p == "fp8":
        from minite.formats import RECIPES, fp8_autocast  # RECIPES: the names of --fp8.recipe (chapter 15)
        recipe = RECIPES[cfg.train.fp8_recipe](min_dim=cfg.train.fp8_min_dim)
        return (lambda: fp8_autocast(enabled=True, recipe=recipe)), None
    raise ConfigError(f"train.precision must be auto | fp32 | bf16 | fp16 | fp8, got {p!r}")


def _optimizer(model: GPT, t, dev: torch.device) -> torch.optim.AdamW:
    # Weight decay on matrices and embeddings only; norms' gains (and biases) are not pulled toward zero.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=dev.type == "cuda")


# ----------------------------------------------------------------------------------------------- 3. one step
def _lr_at(step: int, t) -> float:
    """Linear warm-up to t.lr, then cosine decay to t.min_lr at t.max_iters."""
    if step < t.warmup_iters:
        return t.lr * (step + 1) / t.warmup_iters
    progress = min(1.0, (step - t.warmup_iters) / max(1, t.max_iters - t.warmup_iters))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def train_step(run: Run) -> float:
    """One optimizer step on the global batch (t.grad_accum micro-batches of my dp slice); returns its loss."""
    t = run.cfg.train
    for g in run.opt.param_groups:
        g["lr"] = _lr_at(run.step, t)
    for micro in range(t.grad_accum):
        last = micro == t.grad_accum - 1  # gradients are reduced over dp once, after the last micro-batch
        with contextlib.nullcontext() if last else run.par.no_sync():
            x, y = run.par.shard_batch(*run.sampler.get_batch())
            with run.ctx():
                _, loss = run.model(x, y)
            loss = loss / t.grad_accum
            (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
    if run.scaler is not None:
        run.scaler.unscale_(run.opt)
    if t.grad_clip > 0 or t.tensorboard:  # the norm before clipping; max_norm=inf measures it and clips nothing
        run.grad_norm = run.par.clip(run.model, run.opt, t.grad_clip or math.inf)
    if run.scaler is not None:
        run.scaler.step(run.opt)  # skips the update when a gradient overflowed
        run.scaler.update()
    else:
        run.opt.step()
    step_expert_bias(run.model)  # chapter 16: "bias" balance, moved once per step by the whole step's load
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    return run.par.global_loss(loss.item() * t.grad_accum)  # the global batch's loss


@torch.no_grad()
def evaluate(model: GPT, ids: np.ndarray, cfg: RunConfig, block: int, dev, ctx) -> float:
    """Mean loss over train.eval_iters fixed batches (the same batches at every evaluation: a smooth curve)."""
    model.eval()
    sampler = BatchSampler(ids, block, cfg.train.batch_size, seed=cfg.train.seed + 1, split="val", device=dev)
    losses = []
    for _ in range(cfg.train.eval_iters):
        x, y = sampler.get_batch()
        with ctx():
            losses.append(model(x, y)[1].float().item())
    model.train()
    return float(np.mean(losses))


# ----------------------------------------------------------------------------------------------- 4. the loop
def loop(run: Run, callback: Callable[[int, float], None] | None = None) -> dict:
    """Evaluate, checkpoint, log and step until stop_at (or max_iters); returns the summary.
    callback(step, loss): called after every optimizer step (tests stop runs there)."""
    t = run.cfg.train
    log = _open_log(run)
    start_step = run.step
    tokens_per_step = t.batch_size * t.grad_accum * run.plan.block
    pbar = _progress_bar(run) if t.progress and run.par.is_main else None
    run.clock.start(run.compiled, len(blocks_of(run.model)), pbar)  # "compiling", until the first step is done
    try:
        while True:
            fresh = run.step != start_step or run.plan.resume is None  # a resumed step was evaluated before
            if (fresh and run.step % t.eval_interval == 0) or run.step == t.max_iters:
                with run.clock.timed(steps=0):  # the first evaluation builds the inference graphs
                    _evaluate(run, log)
            if fresh and run.step > 0 and (run.step % (t.ckpt_interval or t.eval_interval) == 0
                                           or run.step in (t.max_iters, t.stop_at)):
                _checkpoint(run, log)
            if run.step >= (t.stop_at or t.max_iters):  # stop_at: end this job; the schedule runs to max_iters
                break
            ts = time.perf_counter()
            with run.clock.timed(steps=1):
                loss = train_step(run)
            run.train_time += time.perf_counter() - ts
            if run.step == start_step + 1:
                run.clock.first_step(run.plan.t0)
            if not math.isfinite(loss) and run.scaler is None:  # fp16: the loss scaler skips such steps itself
                raise DivergenceError(f"the loss is {loss} at step {run.step}: training diverged. The last "
                                      f"checkpoint ({run.out / 'ckpt.pt'}) is kept; lower --train.lr, or check "
                                      "the model's numbers (--model.rope_base, --model.norm_eps)")
            run.losses[run.step] = loss
            tps = run.clock.rate(tokens_per_step, run.step - start_step, run.train_time)  # steady state
            if run.step % t.log_interval == 0 or run.step == t.max_iters:
                norm = {} if run.grad_norm is None else {"grad_norm": round(float(run.grad_norm), 6)}
                _write(run, log, step=run.step, loss=round(loss, 6), lr=_lr_at(run.step - 1, t),
                       tokens_per_s=round(tps), elapsed_s=round(run.elapsed(), 2), **norm, **_moe_row(run))
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss:.3f}", val=f"{run.val_loss:.3f}@{run.val_step}", tok_s=f"{tps:,.0f}",
                                 refresh=False)
            if callback is not None:
                callback(run.step, loss)
    finally:
        run.clock.stop()
        if pbar is not None:
            pbar.set_postfix(val=f"{run.val_loss:.3f}@{run.val_step}", refresh=True)  # the final evaluation's
            pbar.close()
        log.close()
        if run.tb is not None:
            run.tb.close()
    if run.par.is_main:
        _plot(run.out / "log.jsonl", run.out / "loss.png")
    tps = run.clock.rate(tokens_per_step, run.step - start_step, run.train_time)
    return {"val_loss": run.val_loss, "best_val_loss": run.best_val, "steps": run.step, "losses": run.losses,
            "tokens_per_s": tps, "train_time_s": run.train_time, "wall_time_s": time.perf_counter() - run.plan.t0,
            "compile": run.compiled, **run.clock.summary(), "params": run.model.num_params(), "sample": _sample(run),
            "out_dir": str(run.out), "config": run.cfg}


def _open_log(run: Run):
    """log.jsonl for appending (rank 0; the others write to os.devnull). A resumed run forgets the lines written
    after its checkpoint (the steps about to be redone) and a line cut short by a kill; a fresh one starts anew.
    --train.tensorboard: the same for rank 0's TensorBoard events in out_dir (run.tb, a SummaryWriter)."""
    log_path = run.out / "log.jsonl"
    resumed = run.plan.resume is not None
    if run.par.is_main and log_path.exists():
        if resumed:
            rows = [r for r in log_path.read_text().splitlines() if (d := _json_or_none(r)) and d["step"] <= run.step]
            log_path.write_text("".join(r + "\n" for r in rows))
        else:
            log_path.unlink()
            for f in run.out.glob("events.out.tfevents.*"):  # the replaced run's TensorBoard events
                f.unlink()
    run.out.mkdir(parents=True, exist_ok=True)
    if run.cfg.train.tensorboard and run.par.is_main:  # purge_step: TensorBoard drops the old events from there on
        run.tb = _summary_writer()(str(run.out), purge_step=run.step + 1 if resumed else None)
    return open(log_path if run.par.is_main else os.devnull, "a")


def _moe_row(run: Run) -> dict:
    """A mixture-of-experts run's routing at the last step: tokens per expert (summed over the blocks), dropped
    assignments and the Switch balance loss (1.0 = uniform), as moe_* keys of the log line; {} for a dense model."""
    stats = getattr(run.model, "moe_stats", lambda: None)()
    return {f"moe_{k}": v for k, v in stats.items()} if stats else {}


def _write(run: Run, log, **row) -> None:
    log.write(json.dumps(row) + "\n")
    if run.tb is not None:  # --train.tensorboard: every number of the line at its step, grouped as torchtitan does
        for key in row.keys() - {"step"}:  # numbers only: moe_tokens_per_expert is a list
            if isinstance(row[key], (int, float)):
                run.tb.add_scalar(tb_tag(key), row[key], row["step"])


def tb_tag(key: str) -> str:
    """TensorBoard's tag for a log.jsonl key: val_loss -> val/loss, moe_dropped -> moe/dropped, tokens_per_s ->
    perf/tokens_per_s, the rest (loss, lr, grad_norm) under train/."""
    for prefix, group in (("val_", "val/"), ("moe_", "moe/")):
        if key.startswith(prefix):
            return group + key[len(prefix):]
    return ("perf/" if key in ("tokens_per_s", "mfu") else "train/") + key


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("--train.tensorboard=True needs the tensorboard package, which is not installed here: "
                          f"pip install tensorboard (or pip install 'minite[tb]') ({e})") from None
    return SummaryWriter


def _json_or_none(line: str) -> dict | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) and isinstance(d.get("step"), int) else None


def _evaluate(run: Run, log) -> None:
    """Val loss now; a new best (after step 0) is also written to ckpt_best.pt, beside the last checkpoint."""
    run.val_loss = evaluate(run.model, run.plan.data.split("val"), run.cfg, run.plan.block, run.dev, run.ctx)
    run.val_step = run.step
    _write(run, log, step=run.step, val_loss=round(run.val_loss, 6), elapsed_s=round(run.elapsed(), 2),
           train_time_s=round(run.train_time, 2))
    log.flush()
    if run.val_loss < run.best_val:
        run.best_val = run.val_loss
        if run.step > 0:
            _checkpoint(run, log, "ckpt_best.pt")


def _checkpoint(run: Run, log, name: str = "ckpt.pt") -> None:
    """Under torchrun every rank gathers the state (collectives); rank 0 writes it."""
    log.flush()  # every log line up to this step is on disk before the checkpoint that claims this step
    with contextlib.suppress(OSError):  # ranks other than 0 log to os.devnull, which cannot be fsynced
        os.fsync(log.fileno())
    cfg = run.cfg
    model_state = finetune.model_state(run.model, cfg) if cfg.lora.r > 0 else run.par.model_state(run.model)
    state = {
        "model": model_state,
        "optimizer": run.par.optim_state(run.opt, run.model),
        "step": run.step,
        "best_val": run.best_val,
        "config": {"model": cfg.model.to_dict(), "data": vars(cfg.data).copy(), "train": vars(cfg.train).copy(),
                   "lora": vars(cfg.lora).copy()},
        "tokenizer": run.plan.data.tokenizer.to_json(),
        "rng": rng_state(run.sampler),
        "elapsed_s": run.elapsed(),
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
    }
    run.par.save(save_checkpoint, run.out / name, state)


def _progress_bar(run: Run):
    from tqdm import tqdm
    tty = sys.stderr.isatty()  # in a log file (CI, nohup) redraw every second, not every step
    return tqdm(total=run.cfg.train.max_iters, initial=run.step, unit="step", dynamic_ncols=True, file=sys.stderr,
                mininterval=0.1 if tty else 1.0, miniters=1)  # miniters=1: a slow evaluation never silences it


def _sample(run: Run) -> str:
    """A few tokens from the trained model (train.sample_tokens), "" for none."""
    t = run.cfg.train
    if t.sample_tokens <= 0:
        return ""
    tok = run.plan.data.tokenizer
    g = torch.Generator(device=run.dev).manual_seed(t.seed)
    prompt = torch.tensor([tok.encode("\n") if tok.kind == "byte" or "\n" in tok.chars else [0]], device=run.dev)
    run.model.eval()  # no dropout, no capacity limit (layers/moe.py), as a user's sampling would run
    try:
        with run.ctx(), eager_mode():  # one compiled graph per prompt length would be wasted on a one-off sample
            ids = run.model.generate(prompt, t.sample_tokens, temperature=0.8, top_k=None, generator=g)
    finally:
        run.model.train()
    return tok.decode(ids[0].tolist())


def _plot(log_path: Path, png_path: Path) -> None:
    try:  # no pyplot: never switches the backend of a notebook that calls train()
        from matplotlib.figure import Figure
    except ImportError:  # matplotlib is the `plot` extra: a kernels-only install trains without the picture
        print(f"no {png_path.name}: matplotlib is not installed (pip install 'minite[plot]')")
        return
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = Figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    for pts, style, label in ((tr, "-", "train (batch)"), (va, "o-", "val")):
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="minite GPT")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(png_path, dpi=100)


def _announce(run: Run) -> None:
    t = run.cfg.train
    data = run.plan.data
    prec = _precision_name(t, run.dev)
    picked = resources.threads_note(t.threads, run.dev, run.par.active)  # " (picked in 2.1 s)", " (cached)"
    if run.plan.resume is not None:
        start = f"resuming at step {run.step}"
    elif run.plan.base is not None:
        start = f"fine-tuning {t.init_from}"
    else:
        start = "from scratch"
    print(f"minite.train: {run.model.num_params() / 1e6:.2f}M parameters, {run.dev}, precision {prec}, "
          f"compile {run.compiled}, threads {torch.get_num_threads()}{picked}, data {data.dir} (vocab "
          f"{data.tokenizer.vocab_size}, {len(data.split('train')):,} train tokens), {start}", flush=True)
    if extra := _non_defaults(run, prec):  # issue 37: what changes the math or the speed, said at the start
        print("minite.train: " + "; ".join(extra), flush=True)
    if kernels := choices.run_line(run.model, run.dev, run.compiled != "off", get_backend()):  # issue 33: GPU, auto
        print("minite.train: " + kernels, flush=True)  # which implementation runs each op, and why


def _non_defaults(run: Run, prec: str) -> list[str]:
    """The run's settings beyond a dense one-process GPT: experts, the FP8 recipe (and whether it is emulated),
    the parallel layout, recompute, where TensorBoard writes."""
    m, t, par = run.model.config, run.cfg.train, run.par
    out = []
    if m.moe_num_experts:
        cap = f"capacity {m.moe_capacity_factor:g} in training" if m.moe_capacity_factor else "dropless"
        out.append(f"MoE {m.moe_num_experts} experts, top-{m.moe_top_k}, balance {m.moe_balance}, {cap}"
                   + (", a shared expert" if m.moe_shared_expert else ""))
    if prec == "fp8":
        real = run.dev.type == "cuda" and torch.cuda.get_device_capability(run.dev) >= (8, 9)
        out.append(f"fp8 recipe {t.fp8_recipe} (Linear layers with min(in, out) >= {t.fp8_min_dim}), "
                   + ("on FP8 tensor cores" if real else f"emulated on {run.dev.type}: operands rounded to fp8, "
                      "GEMMs in fp32"))
    d = par.dims
    layout = {"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep}
    if par.world > 1:
        out.append("layout " + " ".join(f"{k}={v}" for k, v in layout.items() if v > 1)
                   + (f" zero={par.zero}" if par.zero else "") + (" sp" if par.sp else "")
                   + (f" {par.schedule} x{par.microbatches or d.pp}" if d.pp > 1 else "") + f" ({par.world} ranks)")
    if t.recompute != "none":
        out.append(f"recompute {t.recompute}")
    if t.tensorboard:
        out.append(f"TensorBoard in {run.out}")
    return out


# ----------------------------------------------------------------------------------------------- train
def train(cfg: RunConfig, *, resume: bool = False, callback: Callable[[int, float], None] | None = None,
          resume_overrides: dict | None = None) -> dict:
    """Run training; returns a summary dict (val_loss, losses per step, tokens_per_s, sample, ...).

    resume: continue from ``<out_dir>/ckpt.pt``: its configuration, then `resume_overrides` (only train/data keys
    that do not change the model). callback(step, loss): called after every optimizer step (tests stop runs there).
    """
    plan = resolve(cfg, resume=resume, overrides=resume_overrides)
    par = setup_parallel(plan.cfg)  # torchrun: the process groups; one process: a layout doing nothing
    with par.quiet():  # rank 0 speaks for the run
        run = build(plan, par)
        _announce(run)
        return loop(run, callback)


# ----------------------------------------------------------------------------------------------- CLI
USAGE = """usage: python -m minite.train [--preset cpu|gpu] [--data FILE] [--out_dir DIR] [--precision P] [--resume]
                              [--init_from CKPT [--lora.r=R]] [--section.field=value ...] [--help]"""


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, str], bool]:
    """-> (preset or None, {"section.field": raw value}, resume)."""
    preset, overrides, resume = None, {}, False
    aliases = {"data": "data.path", "out_dir": "train.out_dir", "precision": "train.precision",
               "init_from": "train.init_from"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}\n{USAGE}")
        key, eq, value = arg[2:].partition("=")
        if key == "resume":
            resume, i = True, i + 1
            continue
        if not eq:  # --key value
            if i + 1 >= len(argv):
                full = [f"--{k}=..." for k in valid_keys() if k.split(".", 1)[1] == key]  # --compile: no section
                hint = f" (did you mean {', '.join(full)}?)" if full else ""
                raise ConfigError(f"--{key} needs a value{hint}\n{USAGE}")
            value, i = argv[i + 1], i + 1
        i += 1
        if key == "preset":
            preset = value
        else:
            overrides[aliases.get(key, key)] = value
    return preset, overrides, resume


def default_preset(overrides: dict) -> str:
    """`gpu` when this process will train on a GPU (select_device: a GPU per torchrun rank, --train.device), else `cpu`:
    ranks that fall back to gloo on the CPU get the CPU's model, not the GPU's."""
    try:
        return "gpu" if select_device(str(overrides.get("train.device", "auto"))) == "cuda" else "cpu"
    except ParallelError:  # cuda asked for, too few GPUs: the run itself stops with that error, on the GPU preset
        return "gpu"


def closing_line(s: dict) -> str:
    """Val loss | wall time, when the first step ended | compile time and graphs | the steady-state rate."""
    comp = "compile off" if s.get("compile", "off") == "off" else \
        f"compile {s['compile_time_s']:.1f} s ({s['compile_graphs']} graphs, {s['compile']})"
    return (f"val loss {s['val_loss']:.4f} (best {s['best_val_loss']:.4f}) after {s['steps']} steps | "
            f"{s['wall_time_s']:.1f} s wall, first step at {s.get('first_step_s', math.nan):.1f} s | {comp} | "
            f"{s['tokens_per_s']:,.0f} tokens/s steady ({s.get('steady_steps', 0)} steps, "
            f"{s.get('steady_time_s', s['train_time_s']):.1f} s)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # the values this command line would start from: its preset's
        given = [a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "") for i, a in enumerate(argv)
                 if a.split("=")[0] == "--preset"]
        preset = given[-1] if given else default_preset({})
        print(__doc__ + "\n" + USAGE + f"\n\nFields (--section.field=value, as the {preset} preset sets them):"
              + config_help(preset))
        return 0
    try:
        preset, overrides, resume = parse_cli(argv)
        preset = preset or default_preset(overrides)
        cfg = make_config(preset, overrides, new_run=not resume)  # validates every key and type, also resuming
        summary = train(cfg, resume=resume, resume_overrides=overrides)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DivergenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: continue from the last checkpoint with --resume", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 reports for the run
        return 0
    s = summary
    print("\n" + closing_line(s))
    print(f"log: {s['out_dir']}/log.jsonl  plot: {s['out_dir']}/loss.png  checkpoint: {s['out_dir']}/ckpt.pt")
    if s["sample"]:
        print("\n--- sample (temperature 0.8) ---" + s["sample"] + "\n---")
    return 0


if __name__ == "__main__":
    from minite.parallel.runtime import exit_process
    exit_process(main())  # sys.exit, or (in a process group) a clean exit without finalisation
