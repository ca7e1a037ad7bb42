"""Fine-tuning from a checkpoint, full or LoRA (chapter 09): what ``python -m minite.train --init_from`` adds.

    python -m minite.train --init_from out/ckpt.pt --lora.r=8 --data notes.txt --out_dir out/lora
    python -m minite.train --init_from out/ckpt.pt --lora.r=8 --data pydoc-topics     # a text every Python has
    python -m minite.train --init_from out/ckpt.pt --data notes.txt                   # full fine-tune (r = 0)

* The base's model shape and tokenizer are taken from its checkpoint (``--model.*`` flags are ignored); the new
  text is encoded with the base's vocabulary. A byte-level base reads any text; a char-level base has no id for
  characters its training text did not contain, and LoRA cannot add embedding rows, so such characters are an
  error (``--data.unknown_chars=drop`` removes them, ``--data.unknown_chars=' '`` replaces them).
* With ``--lora.r > 0`` every targeted linear layer gets an adapter, the base is frozen, and checkpoints hold the
  adapters only (kilobytes); ``--resume`` rebuilds the base from ``--init_from`` and loads the adapters on top.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from minite.checkpoint import CheckpointError, check_finite, load_checkpoint
from minite.checkpoint import load_model_state as load_dense_state
from minite.data import Tokenizer
from minite.errors import ConfigError
from minite.layers.lora import (
    LoRAConfig,
    LoRAError,
    apply_lora,
    load_lora,
    lora_state_dict,
    merge_lora,
    print_trainable_parameters,
)
from minite.models.gpt import GPT, GPTConfig

__all__ = ["lora_config", "base_of", "dense_weights", "prepare_model", "model_state", "load_model_state"]


def lora_config(args) -> LoRAConfig:
    """The ``lora`` section of the run config (minite.config.LoRASection) -> a LoRAConfig (ConfigError if bad)."""
    t = args.target_modules.strip()
    names = [s.strip() for s in t.split(",")]
    if t != "all-linear" and all(n.replace("_", "").replace(".", "").isalnum() for n in names):
        t = names  # plain names: a list of suffixes, as PEFT's target_modules=["qkv", "proj"]
    try:
        return LoRAConfig(r=args.r, alpha=args.alpha, dropout=args.dropout, target_modules=t,
                          use_rslora=args.use_rslora)
    except LoRAError as e:
        raise ConfigError(f"--lora.*: {e}") from e


def base_of(cfg, requested: dict | None = None) -> tuple[dict | None, Tokenizer | None, dict]:
    """-> (base checkpoint or None, its tokenizer or None, the overrides the base imposes on `cfg`: its model
    fields and tokenizer kind). Nothing is rebuilt here: minite.train.resolve applies them with the rest.

    requested: the command line's ``{"section.field": value}``; a ``--model.*`` flag there that disagrees with the
    base is refused (the base fixes the model)."""
    if cfg.lora.r < 0:
        raise ConfigError(f"--lora.r must be >= 0 (0 = no LoRA), got {cfg.lora.r}")
    if not cfg.train.init_from:
        if cfg.lora.r > 0:
            raise ConfigError("--lora.r > 0 adapts a trained model: give its checkpoint with --init_from PATH")
        return None, None, {}
    base = load_checkpoint(cfg.train.init_from)
    check_finite(base["model"], cfg.train.init_from)
    clash = [f"--{k}={getattr(cfg.model, k[6:])!r} (the base has {base['config']['model'].get(k[6:])!r})"
             for k in (requested or {}) if k.startswith("model.")
             and getattr(cfg.model, k[6:], None) != base["config"]["model"].get(k[6:])]
    if clash:
        raise ConfigError(f"--init_from {cfg.train.init_from} fixes the model's shape; drop {', '.join(clash)}")
    if cfg.lora.r > 0:
        lora_config(cfg.lora)  # validate before any data is prepared
    tok = Tokenizer.from_json(base["tokenizer"]) if base.get("tokenizer") else None
    over = {f"model.{k}": v for k, v in base["config"]["model"].items()}
    if tok is not None:
        over["data.tokenizer"] = tok.kind
    return base, tok, over


def dense_weights(state: dict, path) -> dict[str, torch.Tensor]:
    """The dense weights a checkpoint stands for: its "model" entry, or, for a LoRA run's checkpoint (adapters
    only), its base's weights (``train.init_from`` in its config) with the adapters merged in."""
    cfg = state["config"]
    lora = cfg.get("lora") or {}
    if not lora.get("r"):
        return state["model"]
    base_path = cfg["train"].get("init_from")
    if not base_path:
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters (r={lora['r']}) but names no base model")
    try:
        base = load_checkpoint(base_path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters only; its base model: {e}") from e
    model = GPT(GPTConfig(**{**cfg["model"], "backend": "torch"}))
    model.load_state_dict(dense_weights(base, base_path))
    apply_lora(model, lora_config(SimpleNamespace(**lora)))
    load_lora(model, state["model"])
    merge_lora(model)
    return {k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}


def prepare_model(model: nn.Module, cfg, base: dict | None) -> None:
    """Load the base weights, add the adapters (base frozen), print trainable vs total parameters."""
    if base is None:
        return
    model.load_state_dict(dense_weights(base, cfg.train.init_from))
    if cfg.lora.r > 0:
        try:
            apply_lora(model, lora_config(cfg.lora))
        except LoRAError as e:
            raise ConfigError(f"--lora.target_modules: {e}") from e
    print(f"minite.train: fine-tuning {cfg.train.init_from} (step {base['step']}), "
          + (f"LoRA r={cfg.lora.r} alpha={cfg.lora.alpha:g} on {cfg.lora.target_modules}" if cfg.lora.r > 0
             else "full fine-tune") + ": ", end="")
    print_trainable_parameters(model)


def model_state(model: nn.Module, cfg) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: the adapters only under LoRA, else the whole state_dict."""
    return lora_state_dict(model) if cfg.lora.r > 0 else model.state_dict()


def load_model_state(model: nn.Module, state: dict, cfg, path) -> None:
    """Inverse of model_state, on resume from checkpoint `path`: the adapters under LoRA (the base is already
    loaded by prepare_model), else the dense weights (a CheckpointError names a wrong-shaped or missing tensor)."""
    if cfg.lora.r > 0:
        try:
            load_lora(model, state)
        except LoRAError as e:
            raise ConfigError(f"resume: {e}") from e
    else:
        load_dense_state(model, state, path)
