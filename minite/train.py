"""Train the minite GPT: ``python -m minite.train [--preset cpu|gpu] [--data FILE] [--section.field=value ...]``.

    python -m minite.train                                   # Shakespeare, `cpu` preset (or `gpu` with CUDA)
    python -m minite.train --data my.txt --train.max_iters=500 --out_dir out/mine
    python -m minite.train --out_dir out/mine --resume       # continue exactly where a run stopped
    torchrun --nproc-per-node 4 -m minite.train --parallel.tp=2 --parallel.pp=2 --train.stop_at=500   # chapters 10-14
    python -m minite.train --init_from out/ckpt.pt --lora.r=8 --data notes.txt --out_dir out/lora   # LoRA (ch. 09)
    python -m minite.train --help                            # every field, its doc and its default

One loop, nanoGPT-style: AdamW with warm-up and cosine decay, gradient clipping and accumulation, fixed val batches,
atomic checkpoints with every RNG state (a resumed run reproduces the uninterrupted one). Precision: fp32, bf16/fp16
autocast, or fp8 (fp8_autocast over every minite.nn.Linear). torch.compile on CUDA by default (minite/compile.py).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from minite import finetune
from minite.checkpoint import CheckpointError, clean_orphans, load_checkpoint, load_model_state, save_checkpoint
from minite.compile import compile_model, eager_mode
from minite.config import ConfigError, RunConfig, apply_overrides, config_help, make_config
from minite.data import BatchSampler, DataError, prepare
from minite.models.gpt import GPT
from minite.parallel.runtime import setup_parallel
from minite.recompute import apply_recompute

__all__ = ["train", "main", "save_checkpoint", "load_checkpoint", "CheckpointError", "parse_cli"]


def _rng_state(sampler: BatchSampler) -> dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_version": 3,
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "sampler": sampler.state_dict()}


def _set_rng_state(s: dict, sampler: BatchSampler) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate((s["python_version"], tuple(s["python"]), None))
    np.random.set_state((s["numpy"][0], s["numpy"][1].numpy().astype(np.uint32), *s["numpy"][2:]))
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    sampler.load_state_dict(s["sampler"])


# ----------------------------------------------------------------------------------------------- pieces
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use cpu or auto")
    return dev


def _precision(cfg: RunConfig, dev: torch.device):
    """(forward context factory, loss scaler or None) for train.precision."""
    p = cfg.train.precision
    if p == "auto":
        p = "bf16" if dev.type == "cuda" else "fp32"
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
        from minite.formats import DelayedScaling, fp8_autocast
        recipe = DelayedScaling()
        return (lambda: fp8_autocast(enabled=True, recipe=recipe)), None
    raise ConfigError(f"train.precision must be auto | fp32 | bf16 | fp16 | fp8, got {p!r}")


def _pick_threads(model: GPT, t, block: int) -> int:
    """The faster of "all cores" and 1 thread, timed on a throwaway copy of the model (RNG untouched).

    On a quiet machine all cores win (~1.5x on 2). When other processes share the cores, OpenMP threads wait for
    each other at every op and a 2-thread run can be 10x slower than a 1-thread one (measured on 2 shared cores).
    """
    cores, timings = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, {}
    with torch.random.fork_rng(devices=[]):
        x = torch.randint(0, model.config.vocab_size, (t.batch_size, block))
        for n in (cores, 1):
            torch.set_num_threads(n)
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=0.0)
            for i in range(5):  # 2 warm-up steps, 3 timed
                if i == 2:
                    t0 = time.perf_counter()
                m(x, x)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            timings[n] = time.perf_counter() - t0
    return min(timings, key=timings.get)


def _lr_at(step: int, t) -> float:
    """Linear warm-up to t.lr, then cosine decay to t.min_lr at t.max_iters."""
    if step < t.warmup_iters:
        return t.lr * (step + 1) / t.warmup_iters
    progress = min(1.0, (step - t.warmup_iters) / max(1, t.max_iters - t.warmup_iters))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def _optimizer(model: GPT, t, dev: torch.device) -> torch.optim.AdamW:
    # Weight decay on matrices and embeddings only; norms' gains (and biases) are not pulled toward zero.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=dev.type == "cuda")


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


def _json_or_none(line: str) -> dict | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) and isinstance(d.get("step"), int) else None


def _plot(log_path: Path, png_path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: never switches the backend of a notebook that calls train()
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = Figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    for pts, style, label in ((tr, "-", "train (batch)"), (va, "o-", "val")):
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="minite GPT")
    ax.legend(), ax.grid(alpha=0.3)
    fig.savefig(png_path, dpi=100)


# ----------------------------------------------------------------------------------------------- the loop
def train(cfg: RunConfig, *, resume: bool = False, callback=None, resume_overrides: dict | None = None) -> dict:
    """Run training; returns a summary dict (val_loss, losses per step, tokens_per_s, sample, ...).

    resume: continue from ``<out_dir>/ckpt.pt``: its configuration, then `resume_overrides` (only train/data keys
    that do not change the model). callback(step, loss): called after every optimizer step (tests stop runs there).
    """
    t0 = time.perf_counter()
    out = Path(cfg.train.out_dir)
    ckpt_path, log_path = out / "ckpt.pt", out / "log.jsonl"
    state = None
    for tmp, size in clean_orphans(ckpt_path):  # a run killed while writing a checkpoint left these
        print(f"minite.train: removed {tmp.name} ({size / 1e6:.1f} MB), left by a checkpoint write that was "
              f"interrupted", flush=True)
    if resume:
        state = load_checkpoint(ckpt_path)
        # The saved stop_at ended the previous job; this one runs on unless told where to stop. Invalid values fail
        # here, named. The parallel layout is whatever this launch says (checkpoints are layout-free).
        cfg = apply_overrides(state["config"], {"train.stop_at": 0, **(resume_overrides or {})})
        old = state["config"]["model"]
        changed = [f"{k}: {old.get(k)!r} in the checkpoint, {v!r} requested"
                   for k, v in cfg.model.to_dict().items() if old.get(k) != v]
        if changed:
            raise ConfigError(f"cannot change model fields when resuming from {ckpt_path} ({'; '.join(changed)}): "
                              "the checkpoint fixes the model; drop those --model flags or use a new --out_dir")
    cfg, base, base_tok = finetune.setup(cfg)  # --init_from: the base's model fields and vocab (chapter 09)
    t = cfg.train
    dev = (par := setup_parallel(cfg, resume)).device(_device(t.device))  # torchrun: groups; else a no-op
    torch.manual_seed(t.seed), random.seed(t.seed), np.random.seed(t.seed)

    data = par.main_first(prepare, cfg.data.path or None, data_dir=cfg.data.data_dir, tokenizer=cfg.data.tokenizer,
                          vocab=base_tok, unknown_chars=cfg.data.unknown_chars)
    tok = data.tokenizer
    if state is not None and state.get("tokenizer") not in (None, tok.to_json()):  # same padded V is not enough
        old, src = state["tokenizer"], state["config"]["data"].get("path") or "the default corpus"
        raise ConfigError(f"checkpoint {ckpt_path} was trained with a {old['kind']} vocab of {old['vocab_size']} "
                          f"symbols from {src}; --data {cfg.data.path or '(default corpus)'} has a different vocab "
                          f"({tok.vocab_size} symbols); resume with the same data or start a new --out_dir")
    if cfg.model.vocab_size != tok.vocab_size:  # the data decides the vocabulary
        cfg = apply_overrides(cfg, {"model.vocab_size": tok.vocab_size})
    block = cfg.data.block_size or cfg.model.block_size
    if block > cfg.model.block_size:
        raise ConfigError(f"data.block_size={block} is larger than the model's block_size={cfg.model.block_size}")
    train_ids, val_ids = data.split("train"), data.split("val")
    sampler = BatchSampler(train_ids, block, t.batch_size, seed=t.seed, split="train", device=dev)
    BatchSampler(val_ids, block, t.batch_size, split="val")  # fail now, not at the first evaluation
    model = GPT(cfg.model).to(dev)
    finetune.prepare_model(model, cfg, base)  # base weights, LoRA adapters (base frozen), trainable vs total
    if state is not None:  # the dense weights, before the wrappers cut them: any layout resumes any checkpoint
        if cfg.lora.r > 0:
            finetune.load_model_state(model, state["model"], cfg)  # under LoRA: the adapters only
        else:
            load_model_state(model, state["model"], ckpt_path)  # names a wrong-shaped or missing tensor
    model = par.wrap(model)  # TP(+SP) GPT from the dense one, pipeline stage, DP / ZeRO gradient hooks
    apply_recompute(model, t.recompute)  # activation recompute per block (chapter 14), after the wrappers
    compiled = compile_model(model, t, dev)  # in place: state_dict keys unchanged
    if dev.type == "cpu":
        torch.set_num_threads(t.threads or (1 if par.active else _pick_threads(model, t, block)))
    opt = par.optimizer(model, lambda m: _optimizer(m, t, dev), t)  # ZeRO >= 1: the sharded AdamW
    ctx, scaler = _precision(cfg, dev)
    step, best_val, el0 = 0, float("inf"), 0.0  # el0: seconds the run had taken before a resume
    if state is not None:
        try:  # the dense AdamW state, sliced for this rank's parameters (minite/parallel/reshard.py)
            par.load_optim(opt, model, state["optimizer"], ckpt_path)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {ckpt_path}: the optimizer state does not fit the model ({e})") from e
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"], sampler)
        step, best_val, el0 = state["step"], state.get("best_val", best_val), state.get("elapsed_s", 0.0)
        # Forget log lines written after this checkpoint (the steps about to be redone), and a line cut short by
        # a kill in the middle of a write.
        if log_path.exists() and par.is_main:
            rows = [r for r in log_path.read_text().splitlines() if (d := _json_or_none(r)) and d["step"] <= step]
            log_path.write_text("".join(r + "\n" for r in rows))
    elif out.exists() and log_path.exists() and par.is_main:
        log_path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    log = open(log_path if par.is_main else os.devnull, "a")
    start_step, ckpt_every = step, t.ckpt_interval or t.eval_interval
    n_params = model.num_params()
    prec = t.precision if t.precision != "auto" else "bf16" if dev.type == "cuda" else "fp32"
    print(f"minite.train: {n_params / 1e6:.2f}M parameters, {dev}, precision {prec}, "
          f"compile {compiled}, threads {torch.get_num_threads()}, data {data.dir} (vocab {tok.vocab_size}, "
          f"{len(train_ids):,} train tokens), {'resuming at step ' + str(step) if resume else 'from scratch'}",
          flush=True)

    def checkpoint():  # under torchrun every rank gathers the state (collectives), rank 0 writes it
        log.flush()  # every log line up to this step is on disk before the checkpoint that claims this step
        with contextlib.suppress(OSError):  # ranks other than 0 log to os.devnull, which cannot be fsynced
            os.fsync(log.fileno())
        par.save(save_checkpoint, ckpt_path, {
            "model": finetune.model_state(model, cfg) if cfg.lora.r > 0 else par.model_state(model),
            "optimizer": par.optim_state(opt, model), "step": step, "best_val": best_val,
            "config": {"model": cfg.model.to_dict(), "data": vars(cfg.data).copy(), "train": vars(t).copy(),
                       "lora": vars(cfg.lora).copy()},
            "tokenizer": tok.to_json(), "rng": _rng_state(sampler), "elapsed_s": el0 + time.perf_counter() - t0,
            "scaler": scaler.state_dict() if scaler is not None else None})

    losses, val_loss = {}, float("nan")  # {step: train loss}
    tokens_per_step = t.batch_size * t.grad_accum * block
    train_time, pbar = 0.0, None
    if t.progress:
        from tqdm import tqdm
        tty = sys.stderr.isatty()  # in a log file (CI, nohup) redraw every 15 s, not every step
        pbar = tqdm(total=t.max_iters, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr,
                    mininterval=0.1 if tty else 15.0)
    try:
        while True:
            fresh = step != start_step or not resume  # the resumed step was evaluated before the interruption
            if (fresh and step % t.eval_interval == 0) or step == t.max_iters:
                val_loss = evaluate(model, val_ids, cfg, block, dev, ctx)
                best_val = min(best_val, val_loss)
                log.write(json.dumps({"step": step, "val_loss": round(val_loss, 6), "elapsed_s": round(
                    el0 + time.perf_counter() - t0, 2), "train_time_s": round(train_time, 2)}) + "\n")
                log.flush()
            if fresh and step > 0 and (step % ckpt_every == 0 or step in (t.max_iters, t.stop_at)):
                checkpoint()
            if step >= (t.stop_at or t.max_iters):  # stop_at: end this job; the schedule still runs to max_iters
                break
            ts, lr = time.perf_counter(), _lr_at(step, t)
            for g in opt.param_groups:
                g["lr"] = lr
            for micro in range(t.grad_accum):  # my dp slice of the global batch; DP syncs on the last micro-batch
                x, y = par.shard_batch(*sampler.get_batch(), sync=micro == t.grad_accum - 1)
                with ctx():
                    _, loss = model(x, y)
                loss = loss / t.grad_accum
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if t.grad_clip > 0:
                par.clip(model, opt, t.grad_clip)
            if scaler is not None:
                scaler.step(opt)  # skips the update when a gradient overflowed
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            step, loss_f = step + 1, par.global_loss(loss.item() * t.grad_accum)  # the global batch's loss
            train_time += time.perf_counter() - ts
            losses[step] = loss_f
            tps = tokens_per_step * (step - start_step) / max(train_time, 1e-9)
            if step % t.log_interval == 0 or step == t.max_iters:
                log.write(json.dumps({"step": step, "loss": round(loss_f, 6), "lr": lr, "tokens_per_s": round(tps),
                                      "elapsed_s": round(el0 + time.perf_counter() - t0, 2)}) + "\n")
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_f:.3f}", val=f"{val_loss:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
            if callback is not None:
                callback(step, loss_f)
    finally:
        if pbar is not None:
            pbar.close()
        log.close()
    if par.is_main:
        _plot(log_path, out / "loss.png")
    sample = ""
    if t.sample_tokens > 0:
        g = torch.Generator(device=dev).manual_seed(t.seed)
        prompt = torch.tensor([tok.encode("\n") if tok.kind == "byte" or "\n" in tok.chars else [0]], device=dev)
        with ctx(), eager_mode():  # one compiled graph per prompt length would be wasted on a one-off sample
            ids = model.generate(prompt, t.sample_tokens, temperature=0.8, top_k=None, generator=g)
        sample = tok.decode(ids[0].tolist())
    tps = tokens_per_step * (step - start_step) / max(train_time, 1e-9)
    return {"val_loss": val_loss, "best_val_loss": best_val, "steps": step, "losses": losses, "tokens_per_s": tps,
            "train_time_s": train_time, "wall_time_s": time.perf_counter() - t0, "params": n_params,
            "sample": sample, "out_dir": str(out), "config": cfg}


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
                raise ConfigError(f"--{key} needs a value\n{USAGE}")
            value, i = argv[i + 1], i + 1
        i += 1
        if key == "preset":
            preset = value
        else:
            overrides[aliases.get(key, key)] = value
    return preset, overrides, resume


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__ + "\n" + USAGE + "\n\nFields (--section.field=value; defaults before presets):" + config_help())
        return 0
    try:
        preset, overrides, resume = parse_cli(argv)
        preset = preset or ("gpu" if torch.cuda.is_available() else "cpu")
        cfg = make_config(preset, overrides)  # validates every key and type, also when resuming
        summary = train(cfg, resume=resume, resume_overrides=overrides)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: continue from the last checkpoint with --resume", file=sys.stderr)
        return 130
    s = summary
    print(f"\nval loss {s['val_loss']:.4f} (best {s['best_val_loss']:.4f}) after {s['steps']} steps | "
          f"{s['wall_time_s']:.1f} s wall ({s['train_time_s']:.1f} s training) | {s['tokens_per_s']:,.0f} tokens/s")
    print(f"log: {s['out_dir']}/log.jsonl  plot: {s['out_dir']}/loss.png  checkpoint: {s['out_dir']}/ckpt.pt")
    if s["sample"]:
        print("\n--- sample (temperature 0.8) ---" + s["sample"] + "\n---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
