"""A decoder-only GPT built only from minite parts (chapter 14, the graduation run).

    idx (B, T) -> token embedding -> n_layer x Block -> RMSNorm -> LM head -> logits (B, T, V_pad)
    Block: x = x + attn(norm1(x)); x = x + mlp(norm2(x))            (pre-norm residual stream)

Modern choices instead of GPT-2's: RMSNorm instead of LayerNorm, rotary position embeddings instead of a learned
position table, a SwiGLU MLP instead of GELU, grouped-query attention, no biases. Every op goes through
``minite.ops`` / ``minite.nn``, so the backend switch swaps the PyTorch references for the Triton kernels without
touching this file, and every projection is a ``minite.nn.Linear`` so ``fp8_autocast`` can run it in FP8.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from minite import _validate as _v
from minite.layers.attention import CausalSelfAttention
from minite.layers.kv_cache import KVCache
from minite.layers.moe import MoE
from minite.nn import RMSNorm, SwiGLU
from minite.ops import cross_entropy

__all__ = ["GPTConfig", "GPT", "Block", "MLP", "MoEMLP", "head_weight"]


def _doc(text: str, default):
    """A dataclass field with a documentation string (``--help`` of minite.train prints it)."""
    return field(default=default, metadata={"doc": text})


@dataclass
class GPTConfig:
    """Shape and numerics of the GPT. Every field is a CLI key of minite.train (``--model.<field>=...``)."""

    vocab_size: int = _doc("tokens in the tokenizer (set from the data; padded up to a multiple of 64 inside)", 256)
    block_size: int = _doc("context length T: the longest sequence the model accepts", 128)
    n_layer: int = _doc("number of transformer blocks", 4)
    n_head: int = _doc("query heads H (n_embd must be divisible by it)", 4)
    n_kv_head: int = _doc("key/value heads KVH for grouped-query attention (n_head % n_kv_head == 0); "
                          "0 means n_kv_head = n_head", 0)
    n_embd: int = _doc("model width C", 128)
    mlp_hidden: int = _doc("SwiGLU hidden width; 0 means 8/3 * n_embd rounded up to a multiple of 32", 0)
    rope_base: float = _doc("RoPE frequency base", 10000.0)
    dropout: float = _doc("dropout on the residual branches and the embeddings (0 for short runs)", 0.0)
    norm_eps: float = _doc("RMSNorm epsilon", 1e-6)
    bias: bool = _doc("biases in the linear layers", False)
    tie_embeddings: bool = _doc("LM head tied to the token embedding (one (V_pad, C) matrix, key wte.weight); "
                                "False: a separate lm_head.weight, as most Llama checkpoints have", True)
    vocab_multiple: int = _doc("pad the vocabulary up to a multiple of this (64: tensor-core friendly)", 64)
    backend: str = _doc("op implementation: auto | torch | triton (auto: on CUDA per op the recorded winner, minite's "
                        "kernel or the peer, minite/choices.py; on the CPU Triton if interpreted, else torch)", "auto")
    moe_num_experts: int = _doc("mixture of experts (chapter 16): experts per block instead of the MLP; 0 = dense", 0)
    moe_top_k: int = _doc("experts each token visits (1 <= top_k <= num_experts)", 2)
    moe_capacity_factor: float = _doc("assignments an expert may take in training, as a multiple of N*k/E; 0 = "
                                      "dropless (evaluation and generation always are)", 0.0)
    moe_balance: str = _doc("load balancing: aux (Switch loss) | bias (DeepSeek-V3, loss-free) | none", "aux")
    moe_aux_weight: float = _doc("weight of the Switch balance loss in the training loss (balance=aux)", 0.01)
    moe_shared_expert: bool = _doc("add a dense SwiGLU expert every token goes through (DeepSeek)", False)

    def __post_init__(self):
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.mlp_hidden == 0:
            self.mlp_hidden = 32 * math.ceil(8 * self.n_embd / 3 / 32)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_multiple",
                     "mlp_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        # A zero, negative or NaN base or epsilon trains to a NaN loss at the first step: refuse it here.
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a finite number > 0, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"head size n_embd // n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto | torch | triton, got {self.backend!r}")
        if self.moe_num_experts < 0 or (self.moe_num_experts and not 1 <= self.moe_top_k <= self.moe_num_experts):
            raise ValueError(f"moe_num_experts={self.moe_num_experts} must be >= 0 and moe_top_k={self.moe_top_k} "
                             "in [1, num_experts]")
        if self.moe_balance not in ("aux", "bias", "none"):
            raise ValueError(f"moe_balance must be aux | bias | none, got {self.moe_balance!r}")
        for name in ("moe_capacity_factor", "moe_aux_weight"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"GPTConfig.{name} must be a finite number >= 0, got {getattr(self, name)}")

    @property
    def padded_vocab_size(self) -> int:
        # The 50257 -> 50304 lesson (nanoGPT): GPT-2's vocabulary of 50257 is odd, so the LM-head matmul
        # (N, C) @ (C, 50257) falls off the fast tensor-core tiles; padding to 50304 = 64 * 786 made the whole
        # model ~25% faster. The extra rows are never targets: they learn a low logit and are masked when sampling.
        m = self.vocab_multiple
        return m * math.ceil(self.vocab_size / m)

    def to_dict(self) -> dict:
        return asdict(self)


class MLP(SwiGLU):
    """SwiGLU feed-forward: minite.nn.SwiGLU (down(silu(gate(x)) * up(x)), gate and up fused into one
    projection ``gate_up``), then residual dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias, backend=_backend_arg(cfg), fused=True)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(super().forward(x))  # (B, T, C)


class MoEMLP(MoE):
    """The block's feed-forward as a mixture of experts (chapter 16), each expert the MLP's SwiGLU, then dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.n_embd, cfg.mlp_hidden, cfg.moe_num_experts, cfg.moe_top_k,
                         capacity_factor=cfg.moe_capacity_factor, balance=cfg.moe_balance,
                         shared_expert=cfg.moe_shared_expert, backend=_backend_arg(cfg))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(super().forward(x))  # (B, T, C)


def _take_aux_loss(cfg: GPTConfig, blocks) -> torch.Tensor | None:
    """The Switch losses of the MoE blocks, summed (None when dense); the blocks keep detached copies (for the
    log, and so that the model can still be deep-copied: a tensor inside a graph cannot be)."""
    if not cfg.moe_num_experts:
        return None
    total = sum(b.mlp.aux_loss for b in blocks)
    for b in blocks:
        b.mlp.aux_loss = b.mlp.aux_loss.detach()
    return total


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        be = _backend_arg(cfg)
        self.norm1 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, backend=be)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, cfg.n_kv_head, max_seq_len=cfg.block_size,
                                        rope_base=cfg.rope_base, dropout=cfg.dropout, bias=cfg.bias, backend=be)
        self.norm2 = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, backend=be)
        self.mlp = MoEMLP(cfg) if cfg.moe_num_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache=None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), kv_cache, layer)  # (B, T, C)
        x = x + self.mlp(self.norm2(x))  # (B, T, C)
        return x


def _check_idx(where: str, idx, V: int, values: bool) -> None:
    """idx must be a (B, T >= 1) integer tensor; with `values`, every id in [0, V) (V = vocab_size: the padded rows
    of the embedding are never tokens). forward checks the values on the CPU only (on CUDA: a host sync per
    training step, and the embedding's own bounds check still catches ids past the padded vocabulary); generate
    checks them once per call. The parallel GPTs call GPT.generate too: hence a function, not a method."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"{where}: idx must be a (B, T) tensor of token ids with T >= 1, got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else _v.describe(idx)}")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"{where}: idx must hold integer token ids, got dtype {idx.dtype}")
    if values and idx.numel():
        bad = (idx < 0) | (idx >= V)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{where}: idx[{b}, {t}] = {int(idx[b, t])} is not a token id in [0, vocab_size={V})")


def head_weight(model) -> torch.Tensor:
    """The LM head's (V_pad, C) weight: the embedding's when tied, else ``lm_head.weight``. A function, not a method:
    the parallel GPTs run GPT.forward on their own modules (an untied one without ``lm_head`` fails loudly here)."""
    return model.wte.weight if model.config.tie_embeddings else model.lm_head.weight


def _backend_arg(cfg: GPTConfig) -> str | None:
    # "auto" is passed as None so a surrounding use_backend() context or $MINITE_BACKEND can still decide.
    return None if cfg.backend == "auto" else cfg.backend


class GPT(nn.Module):
    """Decoder-only transformer language model. ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.backend = _backend_arg(cfg)
        V, C = cfg.padded_vocab_size, cfg.n_embd
        self.wte = nn.Embedding(V, C)  # token embedding (V_pad, C); no position table: RoPE rotates q and k
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(C, eps=cfg.norm_eps, backend=self.backend)
        # The LM head is tied to the embedding by default (weight sharing, Press & Wolf 2017): logits = x @ wte^T;
        # tie_embeddings=False gives it its own (V_pad, C) weight, lm_head.weight (Llama 2/3, Mistral). Either is
        # applied with F.linear on purpose, not minite.nn.Linear, so fp8_autocast leaves it in higher precision:
        # the logits feed a softmax over the whole vocabulary and are the most precision-sensitive GEMM.
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(C, V, bias=False)  # a plain nn.Linear: never an FP8 or LoRA target
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so the output projections start with
        # std 0.02 / sqrt(2 * n_layer) and the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight", "mlp.w_down", "mlp.shared.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, nn.Linear):  # minite.nn.Linear subclasses nn.Linear
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameter count (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, kv_cache=None, lengths=None):
        """With a KVCache (chapter 08) idx holds only the new tokens, appended at each sequence's cache position;
        ``lengths`` (one count per sequence) marks how many of them are real in a right-padded prefill: the cache
        advances by those and the logits are taken at each sequence's last real token."""
        free = isinstance(idx, torch.Tensor) and idx.device.type == "cpu" and not torch.compiler.is_compiling()
        _check_idx("GPT.forward", idx, self.config.vocab_size, values=free)  # values: where no sync, no graph break
        B, T = idx.shape  # batch, sequence length
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != idx.shape):
            raise ValueError(f"GPT.forward: targets must be a tensor of idx's shape {tuple(idx.shape)}, got "
                             f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else _v.describe(targets)}")
        if kv_cache is not None:
            if lengths is not None:  # before anything is written: each sequence holds 1 ... T real new tokens
                lengths = kv_cache._counts(lengths)
                if min(lengths) < 1 or max(lengths) > T:
                    raise ValueError(f"GPT.forward: lengths must be in [1, T={T}] (real tokens of each row), "
                                     f"got {lengths}")
            x = self.drop(self.wte(idx))  # (B, T, C)
            for i, block in enumerate(self.blocks):
                x = block(x, kv_cache, i)  # (B, T, C)
            kv_cache.advance(T if lengths is None else lengths)
            last = torch.full((B,), T - 1, device=idx.device) if lengths is None else torch.as_tensor(lengths) - 1
            x = self.norm_f(x[torch.arange(B, device=idx.device), last.to(idx.device)][:, None])  # (B, 1, C)
            return F.linear(x, head_weight(self)), None  # (B, 1, V_pad)
        if T > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {T}: block_size is only {self.config.block_size} "
                             "(crop the input, or train a model with a larger --model.block_size)")
        x = self.drop(self.wte(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        aux = _take_aux_loss(self.config, self.blocks)  # a function: CPGPT runs this forward on its own modules
        x = self.norm_f(x)  # (B, T, C)
        if targets is None:
            logits = F.linear(x[:, [-1], :], head_weight(self))  # (B, 1, V_pad): only the last position is needed
            return logits, None
        logits = F.linear(x, head_weight(self))  # (B, T, V_pad)
        loss = cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), backend=self.backend)  # (N, V_pad)
        c = self.config
        if aux is not None and c.moe_balance == "aux" and c.moe_aux_weight and self.training:  # not in eval
            loss = loss + c.moe_aux_weight * aux  # the balance loss joins the training loss
        return logits, loss

    def moe_stats(self) -> dict | None:
        """The last forward's routing, summed over the blocks: tokens per expert, dropped assignments, and the
        mean Switch balance loss E * sum f_i P_i (1.0 = uniform; measured whatever the balancing); None when dense."""
        if not self.config.moe_num_experts:
            return None
        moes = [b.mlp for b in self.blocks if getattr(b.mlp, "load", None) is not None]
        if not moes:
            return None
        load = sum(m.load for m in moes)  # the batch's load already (the exchange summed it in forward)
        # this rank's dropped assignments (capacity is per rank) and Switch losses (global f_i, my P_i): summed,
        # and averaged, over the ranks whose tokens the load counts (the exchange's batch_sum: under a parallel
        # layout a collective, so every rank logs; alone the numbers themselves). The last entry counts the ranks.
        mine = torch.stack([sum(m.dropped for m in moes).double(), sum(m.aux_loss.double() for m in moes),
                            torch.ones((), dtype=torch.float64, device=load.device)])
        total = moes[0].exchange.batch_sum(mine)
        return {"tokens_per_expert": [int(v) for v in load], "dropped": int(total[0]),
                "balance_loss": round(float(total[1] / total[2]) / len(moes), 4)}

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True, decoder=None) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to idx (B, T); the context is cropped to the last block_size.
        use_cache: keep a KVCache (chapter 08): prefill once, then one token per step; when the context is
        full it is cropped and prefilled again, so the tokens are those of the uncached loop.

        temperature < 1 sharpens the distribution, > 1 flattens it; 0 means greedy (argmax).
        top_k keeps only the k most likely tokens before sampling.
        decoder: with the cache, what runs the one-token steps, e.g. ``minite.decoding.Decoder(model,
        compile="reduce-overhead")`` (one CUDA graph a step); None: this forward with the cache.
        """
        max_new_tokens = _v.integer("generate", "max_new_tokens", max_new_tokens, lo=0)
        temperature = _v.real("generate", "temperature", temperature, ge=0)  # NaN sampled from NaN probabilities
        if top_k is not None:
            top_k = _v.integer("generate", "top_k", top_k, lo=1)
        _v.boolean("generate", "use_cache", use_cache)
        _check_idx("generate", idx, self.config.vocab_size, True)  # one host sync per call, not per token
        V, bs, cache = self.config.vocab_size, self.config.block_size, None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -bs:])  # (B, 1, V_pad): the whole context again, O(T) work per token
            elif cache is None or max(cache.host_lengths) >= bs:  # (re)fill: first step, or the context is full
                cache = KVCache.for_model(self, idx.shape[0]) if cache is None else cache
                cache.reset()
                logits, _ = self(idx[:, -bs:], kv_cache=cache)  # (B, 1, V_pad)
            else:
                # only the newest token: O(1) projections
                logits = self(idx[:, -1:], kv_cache=cache)[0] if decoder is None else decoder(idx[:, -1:], cache)
            logits = logits[:, -1, :V].float()  # (B, V): the padded ids are never sampled
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, V))  # (B, k)
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = torch.softmax(logits, dim=-1)  # (B, V)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
        return idx
