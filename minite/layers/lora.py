"""LoRA, low-rank adaptation (chapter 09), with an API shaped like Hugging Face PEFT.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685). A frozen linear layer
W (out, in) learns an update of rank r instead of a full (out, in) matrix::

    y = x W^T + s * (x A^T) B^T          A: (r, in) Kaiming-uniform,  B: (out, r) zeros,  s = alpha / r
    Delta W = s * B @ A                  (rsLoRA, Kalajdzievski 2023: s = alpha / sqrt(r))

B = 0 makes the adapted model *equal* to the base at step 0, and A != 0 gives B a gradient from the first step.

    cfg = LoRAConfig(r=8, alpha=16, target_modules="all-linear")     # or ["qkv", "proj"], or a regex string
    model = apply_lora(model, cfg)              # freezes everything, adds lora_A / lora_B (the only trainables)
    print_trainable_parameters(model)           # trainable params: ... || all params: ... || trainable%: ...
    save_lora(model, "adapter.pt")              # adapters only (lora_state_dict): kilobytes, not the model
    load_lora(other_model, "adapter.pt")        # applies the saved config if needed; checks names and shapes
    merge_lora(model); unmerge_lora(model)      # W += s B A for inference (no extra cost), and back

``LoRALinear`` *is* a ``minite.nn.Linear`` (it takes over the base layer's weight and bias Parameters, so the
base's state_dict keys do not change) and calls ``Linear.forward`` for the base product: inside
``fp8_autocast`` the base GEMMs run in FP8 while the adapter runs in the activation dtype (bf16 in a bf16 model).
Outside FP8, with the Triton backend and no dropout, the layer runs fused (kernels/lora.py): x A^T once, then one GEMM.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minite import _validate as _v
from minite.backend import resolve_backend
from minite.formats.autocast import is_fp8_enabled
from minite.layers.linear import Linear

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "merge_lora", "unmerge_lora", "lora_state_dict",
           "save_lora", "load_lora", "print_trainable_parameters", "lora_layers", "LoRAError"]


class LoRAError(ValueError):
    """A bad LoRA configuration, or an adapter that does not fit the model it is loaded into."""


@dataclass
class LoRAConfig:
    """PEFT's ``LoraConfig``, the fields that matter for a decoder-only model.

    target_modules: a list of module-name suffixes (``["qkv", "proj"]`` matches ``blocks.0.attn.qkv``...), a regex
    string matched against the full module name (``r".*\\.attn\\.qkv"``), or ``"all-linear"``: every linear layer
    except the LM head (a module named ``lm_head``/``head``, or one whose weight is tied to an embedding).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"
    use_rslora: bool = False

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise LoRAError(f"LoRAConfig.r must be a positive int, got r={self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            raise LoRAError(f"LoRAConfig.alpha must be a finite positive number, got alpha={self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"LoRAConfig.dropout must be in [0, 1), got dropout={self.dropout!r}")
        t = self.target_modules
        if isinstance(t, (list, tuple)):
            if not t or not all(isinstance(s, str) and s for s in t):
                raise LoRAError(f"LoRAConfig.target_modules must be non-empty names, got {t!r}")
            self.target_modules = list(t)
        elif isinstance(t, str) and t:
            if t != "all-linear":
                try:
                    re.compile(t)
                except re.error as e:
                    raise LoRAError(f"LoRAConfig.target_modules={t!r} is not a valid regex ({e})") from e
        else:
            raise LoRAError(f"LoRAConfig.target_modules must be a list of names, a regex or 'all-linear', got {t!r}")

    @property
    def scaling(self) -> float:
        """s in Delta W = s * B A: alpha / r, or alpha / sqrt(r) with rsLoRA (keeps the update's scale as r grows)."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _MergedGuard(torch.autograd.Function):
    """A zero that depends on the adapters: a loss through a merged layer has a grad_fn, and its backward raises
    minite's error (not torch's "does not require grad"); the forward (a loss with grad enabled) still works."""

    @staticmethod
    def forward(ctx, lora_A, lora_B):
        return lora_A.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        # Training A, B while s B A sits in W would leave W stale (and unmerge would subtract the new B A)
        raise LoRAError("backward through a merged LoRA layer: its adapter is folded into the weight (merge_lora is "
                        "for inference), so lora_A / lora_B cannot train; unmerge_lora(model) first, then train")


class LoRALinear(Linear):
    """A ``minite.nn.Linear`` with a low-rank adapter: y = base(x) + s * dropout(x) A^T B^T.

    Build it from an existing layer with ``LoRALinear.from_linear(layer, config)``: the weight and bias Parameters
    are shared, not copied. ``lora_A`` (r, in) and ``lora_B`` (out, r) are the only Parameters it adds.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *, r: int = 8,
                 alpha: float = 16.0, dropout: float = 0.0, use_rslora: bool = False,
                 backend: str | None = None) -> None:
        # Checked before anything divides by r: alpha < 0 flips the update, NaN poisons it, r = 0 divides by zero.
        r = _v.integer("LoRALinear", "r", r, lo=1)
        alpha = _v.real("LoRALinear", "alpha", alpha, gt=0)
        dropout = _v.real("LoRALinear", "dropout", dropout, ge=0, lt=1)
        use_rslora = _v.boolean("LoRALinear", "use_rslora", use_rslora)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype, backend=backend)
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_A = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))   # (r, in)
        self.lora_B = nn.Parameter(torch.empty(out_features, r, device=device, dtype=dtype))  # (out, r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # PEFT's init: A like nn.Linear's weight (Kaiming-uniform, a = sqrt(5)), B = 0 so Delta W = 0 at step 0.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    @classmethod
    def from_linear(cls, base: nn.Linear, config: LoRAConfig, backend: str | None = None) -> "LoRALinear":
        w = base.weight
        new = cls(base.in_features, base.out_features, bias=False, device=w.device, dtype=w.dtype,
                  r=config.r, alpha=config.alpha, dropout=config.dropout, use_rslora=config.use_rslora,
                  backend=getattr(base, "backend", None) or backend)
        new.weight, new.bias = base.weight, base.bias  # the very same Parameters: no copy, same state_dict keys
        for p in (new.weight, new.bias):
            if p is not None:
                p.requires_grad_(False)  # the base is frozen: only lora_A and lora_B learn
        if isinstance(base, Linear):
            new.fp8_states, new._fp8_key = base.fp8_states, base._fp8_key
        return new

    def delta_weight(self) -> torch.Tensor:
        """Delta W = s * B @ A, (out, in), computed in fp32."""
        return self.scaling * (self.lora_B.float() @ self.lora_A.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:  # s B A is in the weight: the base alone, grad enabled or not (PEFT skips the adapter too)
            y = super().forward(x)
            if torch.is_grad_enabled() and (self.lora_A.requires_grad or self.lora_B.requires_grad):
                y = y + _MergedGuard.apply(self.lora_A, self.lora_B)  # + an exact 0 whose backward says why
            return y
        fused = (not is_fp8_enabled() and isinstance(self.lora_dropout, nn.Identity)
                 and resolve_backend(x, self.backend, op="lora") == "triton")  # auto: the recorded winner
        if fused:  # x A^T once, then ONE GEMM whose last K-step adds (s x A^T) B^T: y is written once
            from minite.kernels.lora import lora_linear
            dev = x.device.type  # under torch.autocast, run in its dtype as F.linear would (a Function is not cast)
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            y = lora_linear(x.to(dt), self.weight.to(dt), self.lora_A.to(dt), self.lora_B.to(dt),
                            scaling=self.scaling, backend="triton")
            return y if self.bias is None else y + self.bias.to(y.dtype)
        y = super().forward(x)  # the base: FP8 GEMMs inside fp8_autocast, else x W^T (+ b)
        h = self.lora_dropout(x)
        dt = y.dtype  # the adapter runs in the activation dtype (bf16 in a bf16 model), never in FP8
        return y + self.scaling * F.linear(F.linear(h.to(dt), self.lora_A.to(dt)), self.lora_B.to(dt))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:g}"
                + (", merged" if self.merged else ""))


# ------------------------------------------------------------------------------------------------ apply / find
def _lm_head_like(model: nn.Module, name: str, module: nn.Linear) -> bool:
    if name.split(".")[-1] in ("lm_head", "head", "output"):
        return True
    emb = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    return any(module.weight is w or module.weight.data_ptr() == w.data_ptr() for w in emb)  # tied weight


def _matches(name: str, target: list[str] | str) -> bool:
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: LoRALinear} of every adapted layer."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, config: LoRAConfig, *, backend: str | None = None) -> nn.Module:
    """Replace the target linear layers of `model` (in place) by LoRALinear, freeze all else; returns `model`.

    Raises LoRAError naming the problem: a target that matches no module, a target that is not a linear layer,
    or a model that already has adapters.
    """
    if not isinstance(config, LoRAConfig):
        raise LoRAError(f"apply_lora: config must be a LoRAConfig, got {type(config).__name__}")
    if lora_layers(model):
        raise LoRAError(f"apply_lora: the model already has LoRA layers ({', '.join(list(lora_layers(model))[:4])}"
                        "...); load_lora() into it, or start from the base model")
    backend = backend or getattr(model, "backend", None)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    t = config.target_modules
    if t == "all-linear":
        chosen = [n for n, m in linears.items() if not _lm_head_like(model, n, m)]
    else:
        names = [n for n, _ in model.named_modules() if n]
        chosen = [n for n in names if _matches(n, t)]
        for part in (t if isinstance(t, list) else [t]):  # every target must match something
            if not any(_matches(n, [part] if isinstance(t, list) else part) for n in names):
                raise LoRAError(f"apply_lora: target_modules entry {part!r} matches no module of "
                                f"{type(model).__name__}; linear layers are: {', '.join(linears) or 'none'}")
        bad = [n for n in chosen if n not in linears]
        if bad:
            raise LoRAError(f"apply_lora: target_modules {t!r} matches modules that are not linear layers: "
                            f"{', '.join(f'{n} ({type(model.get_submodule(n)).__name__})' for n in bad)}")
    if not chosen:
        raise LoRAError(f"apply_lora: target_modules={t!r} matches no linear layer of {type(model).__name__}")
    for p in model.parameters():
        p.requires_grad_(False)
    for n in chosen:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear.from_linear(linears[n], config, backend=backend))
    model.lora_config = config  # what save_lora writes next to the tensors
    return model


# ------------------------------------------------------------------------------------------------ merge
@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """W <- W + s B A in every LoRA layer: inference then costs exactly the base model's GEMMs."""
    for m in lora_layers(model).values():
        if not m.merged:
            m.weight.copy_((m.weight.float() + m.delta_weight()).to(m.weight.dtype))
            m.merged = True
    return model


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> nn.Module:
    """W <- W - s B A: back to the frozen base plus a separate adapter (exact up to the weight dtype's rounding)."""
    for m in lora_layers(model).values():
        if m.merged:
            m.weight.copy_((m.weight.float() - m.delta_weight()).to(m.weight.dtype))
            m.merged = False
    return model


# ------------------------------------------------------------------------------------------------ checkpoints
def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters: ``{"<layer>.lora_A": (r, in), "<layer>.lora_B": (out, r)}`` (PEFT's names)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def save_lora(model: nn.Module, path: str | Path) -> Path:
    """Write the adapters and their LoRAConfig to `path` (a small file: no base weights)."""
    if not lora_layers(model):
        raise LoRAError("save_lora: the model has no LoRA layers (apply_lora first)")
    if any(m.merged for m in lora_layers(model).values()):
        raise LoRAError("save_lora: the adapters are merged into the weights; unmerge_lora(model) first")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"lora": lora_state_dict(model), "lora_config": model.lora_config.to_dict()}, path)
    return path


def load_lora(model: nn.Module, source: str | Path | dict, *, config: LoRAConfig | None = None) -> nn.Module:
    """Load adapters (a file from save_lora, or a lora_state_dict) into `model`, applying LoRA first if needed.

    Raises LoRAError naming the keys that are missing or unexpected and the shapes that differ: an adapter
    trained on another base does not load silently.
    """
    if any(m.merged for m in lora_layers(model).values()):  # unmerge would subtract the new B A from W + old B A
        raise LoRAError("load_lora: the model's adapters are merged into its weights; unmerge_lora(model) first, "
                        "then load (and merge_lora again if wanted)")
    if isinstance(source, (str, Path)):
        state = torch.load(source, map_location="cpu", weights_only=True)
        tensors, saved_cfg = state["lora"], LoRAConfig(**state["lora_config"])
    else:
        tensors, saved_cfg = source, None
    if not lora_layers(model):
        if (config or saved_cfg) is None:
            raise LoRAError("load_lora: the model has no LoRA layers and no LoRAConfig was given")
        apply_lora(model, config or saved_cfg)
    own = lora_state_dict(model)
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    shapes = [f"{k}: adapter {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(tensors)) if tensors[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        src = source if isinstance(source, (str, Path)) else "the given state dict"
        parts = [f"missing in the adapter: {missing}" if missing else "",
                 f"not in the model: {unexpected}" if unexpected else "",
                 f"shape mismatch: {'; '.join(shapes)}" if shapes else ""]
        raise LoRAError(f"load_lora: the adapters of {src} do not fit this model (another base?): "
                        + " | ".join(p for p in parts if p))
    model.load_state_dict(tensors, strict=False)
    return model


def print_trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """Print PEFT's line ``trainable params: T || all params: N || trainable%: P``; returns (T, N)."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():  # parameters() already yields a tied weight once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}")
    return trainable, total
