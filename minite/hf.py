"""minite inside Hugging Face: run a ``transformers`` Llama, Mistral or Qwen2 on minite's kernels, or convert it to
minite's GPT.

Transformer Engine's Hugging Face tutorial swaps ``LlamaForCausalLM``'s decoder layers for TE's to run an existing
checkpoint on TE's kernels. This module does the same with minite's, two ways:

    apply_minite(hf)       in place: every decoder layer's norms, attention and MLP become minite modules that hold
                           the SAME Parameters (no copy, state_dict keys unchanged), so ``hf(...)``, ``hf.generate``,
                           ``save_pretrained`` and training keep working; the ops are minite's (RMSNorm, RoPE, flash
                           attention, split-KV decode, SwiGLU kernels) and every projection is a ``minite.nn.Linear``,
                           so ``fp8_autocast`` runs them in FP8 (the LM head stays in higher precision, as in the GPT).
                           Per-op switches as Liger's ``apply_liger_kernel_to_*``: rms_norm, rope, swiglu, attention,
                           cross_entropy (the loss of ``hf(x, labels=...)``). ``apply_minite_to_llama()`` (or
                           _mistral, _qwen2) with no model patches the family's classes: every model built or
                           ``from_pretrained`` afterwards is swapped (``revert_minite(family)`` undoes it).
                           ``swap_llama_layers(hf)`` is the same with every switch on.
    from_hf_llama(hf)      a new ``minite.models.gpt.GPT`` with the weights copied (q/k/v and gate/up fused).
    to_hf_llama(gpt)       a new ``LlamaForCausalLM`` (the inverse), e.g. to ``save_pretrained`` a minite run.

Layouts. HF's Llama applies RoPE rotate-half style: pair i is (x[i], x[i + D/2]) (its conversion script permuted
Meta's interleaved q/k rows into that layout once). minite's rope kernel rotates the same pairs, so the q and k
weights map unpermuted; the tests show that an interleaving permutation would change the logits. GQA: both stack
the KVH key/value heads in order and query head h reads kv head h // (H / KVH).

Families. Mistral and Qwen2 are Llama-shaped (pre-norm, RMSNorm, rotate-half RoPE, GQA, SwiGLU); Qwen2 adds
biases to q/k/v (only): the swap keeps each projection's bias; from_hf_llama refuses it (GPTConfig.bias is one
switch for every projection). A sliding window (Mistral's ``sliding_window``, Qwen2's sliding layers) changes
nothing while every position is inside it: the swapped attention runs such a model up to that length and refuses a
longer sequence by name (minite's kernels have no window).

Vocabulary. The GPT pads its vocabulary up to ``vocab_multiple`` (tensor-core tiles); its LM head is tied to the
embedding or, with ``tie_embeddings=False``, a separate ``lm_head.weight``, as HF's ``tie_word_embeddings``.
from_hf_llama copies the V real rows and zeroes the padded ones (never sampled; they do enter the training
softmax, so pass ``vocab_multiple=1`` for a loss equal to HF's); to_hf_llama keeps the V real rows.

KV cache. The swapped attention uses HF's own ``Cache`` object (whatever ``generate`` made: dynamic or static),
not minite's ``KVCache``: HF owns the cache's life cycle (beam reordering, cropping). minite's kernels read it: the
flash-attention kernel for a prefill, the split-KV decode kernel for one new token.

Masks. minite's kernels take causal attention and no mask. A padded batch (left or right padding, as a tokenizer
makes for batched ``generate``) runs exactly all the same: each sequence's real tokens are gathered and attend
causally to each other, one flash-attention launch per sequence. Any other mask (a window shorter than the
sequence, a bias) is refused with a NotImplementedError.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minite.models.gpt import GPT, GPTConfig
from minite.nn import Linear, RMSNorm
from minite.ops import attention, cross_entropy, decode_attention, rope, swiglu

if TYPE_CHECKING:  # an optional dependency (minite[hf]): for the annotations only
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaPreTrainedModel, PreTrainedModel

__all__ = ["from_hf_llama", "to_hf_llama", "apply_minite", "apply_minite_to_llama", "apply_minite_to_mistral",
           "apply_minite_to_qwen2", "revert_minite", "swap_llama_layers", "gpt_config_from_llama",
           "MiniteLlamaAttention", "MiniteLlamaMLP"]

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}  # transformers.models.<key>, class prefix
SWITCHES = ("rms_norm", "rope", "swiglu", "attention", "cross_entropy")


def _transformers():
    try:
        import transformers
    except ImportError as e:  # an optional dependency: minite itself never needs it
        raise ImportError("minite.hf needs Hugging Face transformers: pip install 'minite[hf]'") from e
    return transformers


def _refuse(field: str, value, why: str):
    raise ValueError(f"minite.hf: {field}={value!r} cannot be mapped: {why}")


def _rope_params(config) -> tuple[str, float | None]:
    """(rope_type, rope_theta) from transformers 5 (``rope_parameters``) or 4.x (``rope_scaling`` + ``rope_theta``)."""
    d = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = d.get("rope_type", d.get("type", "default"))
    return rope_type, d.get("rope_theta", getattr(config, "rope_theta", None))


def _family(model_or_class) -> str:
    """'llama' | 'mistral' | 'qwen2': the transformers family of a model (or model class), else a TypeError."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    fam = next((f for f in FAMILIES if cls.__module__ == f"transformers.models.{f}.modeling_{f}"), None)
    tf = _transformers()
    if fam is None or not issubclass(cls, tf.PreTrainedModel):
        raise TypeError(f"minite.hf: expected a transformers Llama, Mistral or Qwen2 model (e.g. LlamaForCausalLM), "
                        f"got {cls.__name__}")
    return fam


def _modeling(fam: str):
    return importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")


def _check_llama(model, *, to_gpt: bool):
    """The decoder inside ``model`` (a <Family>ForCausalLM or <Family>Model), after refusing what minite cannot run."""
    name = type(model).__name__
    if to_gpt and name not in (f"{p}ForCausalLM" for p in FAMILIES.values()):
        raise TypeError(f"minite.hf: expected a transformers LlamaForCausalLM, got {name} (MistralForCausalLM "
                        "converts too)")
    fam = _family(model)
    c = model.config
    if c.hidden_act not in ("silu", "swish"):  # ACT2FN["swish"] is SiLU too
        _refuse("hidden_act", c.hidden_act, "minite's SwiGLU kernel gates with silu")
    if getattr(c, "attention_dropout", 0.0):
        _refuse("attention_dropout", c.attention_dropout, "minite's attention kernels have no dropout on the "
                "probabilities (the GPT's dropout is on the residual branches)")
    if to_gpt:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim * c.num_attention_heads != c.hidden_size:
            _refuse("head_dim", head_dim, f"the GPT's head size is hidden_size / num_attention_heads = "
                    f"{c.hidden_size} / {c.num_attention_heads}")
        rope_type, _ = _rope_params(c)
        if rope_type != "default":
            _refuse("rope_type", rope_type, "the GPT's RotaryEmbedding has no RoPE scaling (swap_llama_layers "
                    "runs it: it takes HF's cos/sin tables)")
        if fam == "qwen2":  # q/k/v biases, none on o_proj and the MLP
            _refuse("model_type", "qwen2", "its q/k/v projections have biases and o_proj and the MLP none; "
                    "GPTConfig.bias is one switch for every projection (apply_minite runs it)")
        if bool(getattr(c, "attention_bias", False)) != bool(getattr(c, "mlp_bias", False)):
            _refuse("attention_bias", c.attention_bias, f"GPTConfig.bias is one switch for every projection, and "
                    f"mlp_bias={getattr(c, 'mlp_bias', False)!r} differs")
        if getattr(c, "sliding_window", None) is not None:
            _refuse("sliding_window", c.sliding_window, "the GPT's attention has no window (apply_minite runs it "
                    "on sequences that fit inside it)")
    llama = model.model if hasattr(model, "lm_head") else model
    for name, mod in llama.named_modules():
        if isinstance(mod, nn.Linear) and not isinstance(mod, Linear) and type(mod) is not nn.Linear:
            _refuse(f"{name} type", type(mod).__name__, "only plain nn.Linear projections map (not quantized or "
                    "adapter layers)")
    return llama


# ------------------------------------------------------------------------------------- weights: HF <-> GPT
def _pairs(n_layer: int, bias: bool):
    """(GPT name, [HF names]): the GPT's fused tensor is the HF tensors concatenated along dim 0 (q|k|v, gate|up)."""
    yield "norm_f.weight", ["model.norm.weight"]
    for i in range(n_layer):
        g, h = f"blocks.{i}.", f"model.layers.{i}."
        yield g + "norm1.weight", [h + "input_layernorm.weight"]
        yield g + "norm2.weight", [h + "post_attention_layernorm.weight"]
        for s in ("weight", "bias") if bias else ("weight",):
            yield g + f"attn.qkv.{s}", [h + f"self_attn.{x}_proj.{s}" for x in "qkv"]  # rows [H*D | KVH*D | KVH*D]
            yield g + f"attn.proj.{s}", [h + f"self_attn.o_proj.{s}"]
            yield g + f"mlp.gate_up.{s}", [h + f"mlp.{x}_proj.{s}" for x in ("gate", "up")]  # [gate | up]
            yield g + f"mlp.down.{s}", [h + f"mlp.down_proj.{s}"]


def gpt_config_from_llama(config: LlamaConfig, *, block_size: int | None = None, vocab_multiple: int = 64,
                          backend: str = "auto") -> GPTConfig:
    """The GPTConfig of a LlamaConfig (no checks: from_hf_llama refuses what does not map)."""
    return GPTConfig(vocab_size=config.vocab_size, block_size=block_size or config.max_position_embeddings,
                     n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                     n_kv_head=config.num_key_value_heads, n_embd=config.hidden_size,
                     mlp_hidden=config.intermediate_size, rope_base=float(_rope_params(config)[1]),
                     norm_eps=config.rms_norm_eps, bias=bool(getattr(config, "attention_bias", False)),
                     tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)), vocab_multiple=vocab_multiple,
                     backend=backend)


@torch.no_grad()
def from_hf_llama(hf_model: LlamaForCausalLM, *, block_size: int | None = None, vocab_multiple: int = 64,
                  backend: str = "auto") -> GPT:
    """A minite GPT with the weights of a transformers ``LlamaForCausalLM`` (copied: q/k/v and gate/up are fused).

    block_size: the context length (default ``max_position_embeddings``; each layer keeps RoPE tables this long).
    vocab_multiple: the GPT's vocabulary padding; the padded rows are zero. An untied lm_head becomes the GPT's
    ``lm_head.weight`` (tie_embeddings=False). A Mistral without a sliding window converts too (the same layout).
    Raises ValueError naming the config field of anything that does not map (RoPE scaling, biases on only some
    projections, a sliding window, ...).
    """
    _check_llama(hf_model, to_gpt=True)
    cfg = gpt_config_from_llama(hf_model.config, block_size=block_size, vocab_multiple=vocab_multiple,
                                backend=backend)
    src = dict(hf_model.named_parameters())
    emb, head = hf_model.get_input_embeddings().weight, hf_model.get_output_embeddings().weight  # (V, C) each
    cfg.tie_embeddings = head is emb  # what the model is, whatever its config says
    device, dtype = emb.device, emb.dtype
    with torch.device(device):
        gpt = GPT(cfg)  # RoPE tables built on the device, in fp32 (cfg validated again by its __post_init__)
    state = {g: torch.cat([src[n] for n in hs]) for g, hs in _pairs(cfg.n_layer, cfg.bias)}
    pad = emb.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, cfg.n_embd)
    state["wte.weight"] = torch.cat([emb, pad])
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = torch.cat([head, pad])
    gpt.load_state_dict(state, strict=True)
    for p in gpt.parameters():  # the checkpoint's dtype for the weights; the RoPE buffers stay fp32
        p.data = p.data.to(dtype)
    return gpt.train(hf_model.training)


@torch.no_grad()
def to_hf_llama(gpt: GPT) -> LlamaForCausalLM:
    """A transformers ``LlamaForCausalLM`` with the weights of a minite GPT (the V real rows; tied or untied LM
    head as the GPT's ``tie_embeddings``)."""
    tf = _transformers()
    c = gpt.config
    if c.moe_num_experts:  # a Llama has one MLP per block: there is no place for experts or a router
        raise ValueError(f"to_hf_llama: this GPT has moe_num_experts={c.moe_num_experts} (a mixture of experts); "
                         "LlamaForCausalLM holds one dense MLP per block, so its experts cannot be mapped")
    config = tf.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.n_embd // c.n_head,
        max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, hidden_act="silu",
        attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=0.0, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # a minite run has no special tokens
    wte = gpt.wte.weight
    hf = tf.LlamaForCausalLM(config).to(device=wte.device, dtype=wte.dtype)
    dst, src = dict(hf.named_parameters()), dict(gpt.named_parameters())
    for g, hs in _pairs(c.n_layer, c.bias):
        for n, part in zip(hs, src[g].split([dst[n].shape[0] for n in hs])):
            dst[n].copy_(part)
    hf.get_input_embeddings().weight.copy_(wte[:c.vocab_size])
    head = hf.get_output_embeddings().weight
    if (head is hf.get_input_embeddings().weight) != c.tie_embeddings:
        raise RuntimeError(f"to_hf_llama: transformers did not honour tie_word_embeddings={c.tie_embeddings}")
    if not c.tie_embeddings:
        head.copy_(gpt.lm_head.weight[:c.vocab_size])
    return hf.train(gpt.training)


# ------------------------------------------------------------------------------------- swap: minite inside HF
def _linear(lin: nn.Linear, backend: str | None) -> Linear:
    """A minite.nn.Linear holding `lin`'s own Parameters (built on the meta device: nothing allocated, no copy)."""
    with torch.device("meta"):
        new = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, backend=backend)
    new.weight = lin.weight
    if lin.bias is not None:
        new.bias = lin.bias
    return new


def _rmsnorm(norm: nn.Module, backend: str | None) -> RMSNorm:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    with torch.device("meta"):
        new = RMSNorm(norm.weight.shape[0], eps=eps, backend=backend)
    new.weight = norm.weight  # the same Parameter; the key stays "<...>.weight"
    return new


class MiniteLlamaMLP(nn.Module):
    """HF's LlamaMLP on minite: ``down_proj(swiglu(gate_proj(x), up_proj(x)))``, minite Linears on HF's weights."""

    def __init__(self, mlp: nn.Module, backend: str | None = None) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(getattr(mlp, f"{n}_proj"), backend)
                                                        for n in ("gate", "up", "down"))
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=self.backend))  # (B, T, C)


def _rope_hf(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend) -> torch.Tensor:
    """minite's rope kernel with HF's tables: x (B, H, T, D); cos/sin (B or 1, T, D) = [angles | angles]."""
    half = x.shape[-1] // 2
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        raise NotImplementedError("minite.hf: HF's RoPE tables are not rotate-half ([angles | angles])")
    c, s = cos[..., :half].float(), sin[..., :half].float()  # (B or 1, T, D/2)
    if c.shape[0] == 1 or (torch.equal(c, c[:1].expand_as(c)) and torch.equal(s, s[:1].expand_as(s))):
        return rope(x, c[0], s[0], backend=backend)  # every sequence at the same positions: one launch
    return torch.cat([rope(x[b:b + 1], c[b], s[b], backend=backend) for b in range(x.shape[0])])


def _keep(mask: torch.Tensor) -> torch.Tensor:
    """HF's mask as booleans (True = attend), after refusing an additive mask that is a bias, not -inf / 0."""
    if mask.dim() == 2 or mask.dtype == torch.bool:
        return mask.bool()
    keep = mask == 0  # additive (eager attention): 0 = attend, the dtype's minimum = masked
    if not bool((mask[~keep] <= torch.finfo(mask.dtype).min / 2).all()):
        raise NotImplementedError("minite.hf: the attention mask adds a bias to the scores; minite's attention "
                                  "kernels take causal attention and padding only")
    return keep


def _visible_keys(mask, T: int, T_k: int) -> int | None:
    """n such that query i sees keys j <= i + n - T (bottom-right causal over the first n cached keys), read from
    HF's mask; None when the mask is anything else (a padded batch: _padded_attention)."""
    if mask is None:  # HF skipped the mask for SDPA's is_causal, which is top-left aligned: with T > 1 queries only
        return T_k if T == 1 else T  # the first T keys are seen (a static cache's prefill pads the keys beyond)
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
        raise NotImplementedError(f"minite.hf: an attention mask of type {type(mask).__name__} is not supported")
    keep = _keep(mask)
    if mask.dim() == 2:  # flash-attention style (B, T_k) padding mask
        keep_ok, n = bool(keep.all()), keep.shape[-1]
    else:  # (B, 1 or H, T, T_mask)
        n = int(keep[0, 0, -1].sum())  # the last query sees every visible key
        causal = torch.ones(T, keep.shape[-1], dtype=torch.bool, device=keep.device).tril(n - T)
        keep_ok = torch.equal(keep, causal.expand_as(keep))
    return n if keep_ok and n <= T_k else None


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      backend: str | None) -> torch.Tensor:
    """Attention over a padded batch (left or right padding), exact for every real token: each sequence's real
    keys, gathered, then minite's causal attention over them, one launch per sequence. q (B, H, T, D) sit at
    positions p0 .. p0 + T - 1 of the keys k/v (B, KVH, T_k, D): the newest T (a dynamic cache), or followed by a
    static cache's unused slots. Padding queries get zeros: their outputs reach only padding keys of later
    layers, which every real query masks. Any other mask is refused."""
    B, _, T, _ = q.shape
    T_k = k.shape[2]
    keep = _keep(mask)  # (B, T_k) real tokens, or (B, 1 or H, T, T_k) query x key
    if mask.dim() == 4:
        if keep.shape[-1] != T_k or not torch.equal(keep, keep[:, :1].expand_as(keep)):
            raise NotImplementedError(_MASK_REFUSED)
        keep = keep[:, 0]  # (B, T, T_k)
    real = keep.any(1) if keep.dim() == 3 else keep  # (B, T_k): keys some query attends: the real tokens
    p0 = T_k - T
    if keep.dim() == 3 and keep.any():  # a real query's last visible key is itself: p0 = its column - its row
        last = T_k - 1 - keep.flip(-1).int().argmax(-1)  # (B, T) each row's last visible key
        p0 = int((last - torch.arange(T, device=q.device))[keep.any(-1)].max())  # padding rows see less
    if real.shape[-1] != T_k or p0 + T > T_k:
        raise NotImplementedError(_MASK_REFUSED)
    queries = real[:, p0:p0 + T]  # (B, T): which of this call's queries are real tokens
    causal = torch.ones(T, T_k, dtype=torch.bool, device=q.device).tril(p0)  # (T, T_k): key j <= p0 + i
    if keep.dim() == 3 and not torch.equal(keep[queries], (causal[None] & real[:, None])[queries]):
        raise NotImplementedError(_MASK_REFUSED)  # e.g. a sliding window
    y = q.new_zeros(q.shape)  # (B, H, T, D)
    for b in range(B):
        qb = q[b:b + 1, :, queries[b]]  # (1, H, T_b, D): the real queries are the last T_b real keys
        kb, vb = k[b:b + 1, :, real[b]], v[b:b + 1, :, real[b]]  # (1, KVH, n_b, D)
        if qb.shape[2]:
            y[b:b + 1, :, queries[b]] = attention(qb, kb, vb, causal=True, scale=scale, backend=backend)
    return y


_MASK_REFUSED = ("minite.hf: the attention mask is neither causal attention nor causal attention over a padded "
                 "batch (left or right padding); minite's attention kernels take no other mask")


class MiniteLlamaAttention(nn.Module):
    """HF's Llama / Mistral / Qwen2 attention on minite: minite Linears on HF's q/k/v/o weights (and Qwen2's q/k/v
    biases), minite's rope kernel with HF's cos/sin tables (so HF's RoPE scaling types work), HF's cache, then
    minite's flash attention (or split-KV decode). ``rope=False`` / ``attention=False``: HF's own rotation /
    attention function (the one its ``config._attn_implementation`` names) for that step."""

    def __init__(self, attn: nn.Module, backend: str | None = None, *, rope: bool = True,
                 attention: bool = True) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_linear(getattr(attn, f"{n}_proj"), backend)
                                                              for n in "qkvo")
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.config, self.is_causal, self.backend = attn.config, True, backend
        self.num_key_value_groups = attn.num_key_value_groups  # what HF's attention functions read off `module`
        self.attention_dropout = getattr(attn, "attention_dropout", 0.0)
        # Mistral reads the window off its config, Qwen2 sets it per layer (None on full-attention layers)
        self.sliding_window = (attn.sliding_window if hasattr(attn, "sliding_window")
                               else getattr(attn.config, "sliding_window", None))
        self.minite_rope, self.minite_attention = rope, attention
        self._hf = _modeling(_family_of_module(attn))
        tf_major_minor = tuple(int(p) for p in _transformers().__version__.split(".")[:2])
        self._returns_cache = tf_major_minor < (4, 48)  # 4.45-4.47 return (out, weights, past_key_value)

    def _check_window(self, kwargs: dict, T_k: int) -> None:
        """Refuse a sequence longer than the sliding window: there HF's window masks keys minite would attend."""
        w = self.sliding_window
        pos = kwargs.get("position_ids")
        n = int(pos.max()) + 1 if isinstance(pos, torch.Tensor) and pos.numel() else T_k
        if w is not None and n > w:
            raise NotImplementedError(f"minite.hf: sliding_window={w} is shorter than the sequence ({n} positions): "
                                      f"minite's attention kernels have no window (up to {w} positions they match)")

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple:
        B, T, _ = hidden_states.shape
        D = self.head_dim
        q = self.q_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)  # (B, KVH, T, D)
        v = self.v_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)  # (B, KVH, T, D)
        if position_embeddings is None:
            raise RuntimeError("minite.hf: the decoder layer passed no position_embeddings (transformers < 4.45?)")
        cos, sin = position_embeddings  # (B or 1, T, D)
        if self.minite_rope:
            q, k = _rope_hf(q, cos, sin, self.backend), _rope_hf(k, cos, sin, self.backend)
        else:
            q, k = self._hf.apply_rotary_pos_emb(q, k, cos, sin)
        # The cache argument's name changed: past_key_value (4.x) -> past_key_values (4.56) -> cache (5.x).
        cache = next((kwargs[n] for n in ("cache", "past_key_values", "past_key_value") if kwargs.get(n) is not None),
                     None)
        if cache is not None:  # 4.x takes cache_kwargs as the 4th argument; 5.x ignores it
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            k, v = cache.update(k, v, self.layer_idx, cache_kwargs)  # (B, KVH, T_k, D): past + new (static: padded)
        if not self.minite_attention:
            return self._hf_attention(q, k, v, attention_mask, cache, B, T, {n: a for n, a in kwargs.items() if n
                                                                             not in ("cache", "past_key_values",
                                                                                     "past_key_value")})
        self._check_window(kwargs, k.shape[2])
        n = _visible_keys(attention_mask, T, k.shape[2])
        if n is None:  # a padded batch: each sequence's real tokens, one launch each
            y = _padded_attention(q, k, v, attention_mask, self.scaling, self.backend)
        elif T == 1 and not torch.is_grad_enabled():  # a decode step: minite's split-KV kernel over the n keys
            lengths = torch.full((B,), n, device=q.device)
            y = decode_attention(q[:, :, 0], k, v, lengths, scale=self.scaling, max_len=n,
                                 backend=self.backend)[:, :, None]  # (B, H, 1, D)
        else:  # prefill / training: flash attention, causal bottom-right (the new queries sit after the cache)
            y = attention(q, k[:, :, :n], v[:, :, :n], causal=True, scale=self.scaling, backend=self.backend)
        out = self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)
        return (out, None, cache) if self._returns_cache else (out, None)

    def _hf_attention(self, q, k, v, mask, cache, B: int, T: int, kwargs: dict) -> tuple:
        """attention=False: HF's attention function (sdpa, eager, ...) on this module, as HF's own layer calls it."""
        impl = getattr(self.config, "_attn_implementation", None) or "sdpa"
        fns = getattr(self._hf, "ALL_ATTENTION_FUNCTIONS", None)
        fn = (self._hf.eager_attention_forward if impl == "eager" or fns is None
              else fns.get_interface(impl, self._hf.eager_attention_forward) if hasattr(fns, "get_interface")
              else fns[impl])
        y, _ = fn(self, q, k, v, mask, dropout=0.0 if not self.training else self.attention_dropout,
                  scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)  # (B, T, H, D)
        out = self.o_proj(y.reshape(B, T, -1))  # (B, T, C)
        return (out, None, cache) if self._returns_cache else (out, None)

    def extra_repr(self) -> str:
        which = {True: "minite", False: "hf"}
        return (f"layer_idx={self.layer_idx}, head_dim={self.head_dim}, backend={self.backend!r}, "
                f"rope={which[self.minite_rope]}, attention={which[self.minite_attention]}")


def _family_of_module(mod: nn.Module) -> str:
    return next((f for f in FAMILIES if type(mod).__module__ == f"transformers.models.{f}.modeling_{f}"), "llama")


def _causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                    shift_labels=None, **kwargs) -> torch.Tensor:
    """HF's ForCausalLMLoss (shift, flatten, mean over counted tokens or sum / num_items_in_batch) on minite's
    cross-entropy kernel."""
    logits = logits.float()
    if shift_labels is None:  # tokens < n predict n
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits, shift_labels = logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


def _switches(kw: dict) -> dict:
    unknown = set(kw) - set(SWITCHES)
    if unknown:
        raise TypeError(f"minite.hf: unknown switch {sorted(unknown)[0]!r}; the switches are {', '.join(SWITCHES)}")
    for n, on in kw.items():
        if not isinstance(on, bool):
            raise TypeError(f"minite.hf: switch {n}={on!r} must be True or False")
    return {n: kw.get(n, True) for n in SWITCHES}


def apply_minite(hf_model: PreTrainedModel, *, backend: str | None = None, **switches: bool) -> PreTrainedModel:
    """Run a transformers Llama, Mistral or Qwen2 (``<Family>ForCausalLM`` or ``<Family>Model``) on minite's
    kernels, in place, and return it. Per-op switches, each True by default:

        rms_norm       every RMSNorm (the two of each layer, the final one) becomes ``minite.nn.RMSNorm``
        rope           the attention rotates q and k with minite's rope kernel (HF's cos/sin tables)
        swiglu         the MLP becomes ``MiniteLlamaMLP`` (minite Linears, minite's SwiGLU kernel)
        attention      minite's flash attention / split-KV decode (False: HF's attention function)
        cross_entropy  ``model(x, labels=...)``'s loss is minite's cross-entropy kernel (a ForCausalLM only)

    With rope or attention on, the attention module becomes ``MiniteLlamaAttention`` (its projections minite
    Linears). Every swapped module holds the model's own Parameters. ``backend`` as everywhere in minite."""
    on = _switches(switches)
    llama = _check_llama(hf_model, to_gpt=False)
    for layer in llama.layers:
        if on["rms_norm"]:
            layer.input_layernorm = _rmsnorm(layer.input_layernorm, backend)
            layer.post_attention_layernorm = _rmsnorm(layer.post_attention_layernorm, backend)
        if (on["rope"] or on["attention"]) and not isinstance(layer.self_attn, MiniteLlamaAttention):
            layer.self_attn = MiniteLlamaAttention(layer.self_attn, backend, rope=on["rope"],
                                                   attention=on["attention"])
        if on["swiglu"] and not isinstance(layer.mlp, MiniteLlamaMLP):
            layer.mlp = MiniteLlamaMLP(layer.mlp, backend)
    if on["rms_norm"]:
        llama.norm = _rmsnorm(llama.norm, backend)
    if on["cross_entropy"] and hasattr(hf_model, "lm_head"):
        hf_model.loss_function = _causal_lm_loss
    return hf_model


def _apply_to(fam: str, model, backend, switches):
    if model is not None:
        if _family(model) != fam:
            raise TypeError(f"minite.hf: apply_minite_to_{fam} got a {type(model).__name__}")
        return apply_minite(model, backend=backend, **switches)
    on = _switches(switches)  # the classes: every model built afterwards (from_pretrained too) is swapped
    mod, prefix = _modeling(fam), FAMILIES[fam]
    revert_minite(fam)
    _wrap_init(getattr(mod, f"{prefix}Model"),
               lambda m: apply_minite(m, backend=backend, **{**on, "cross_entropy": False}))
    if on["cross_entropy"]:
        _wrap_init(getattr(mod, f"{prefix}ForCausalLM"), lambda m: setattr(m, "loss_function", _causal_lm_loss))
    return None


def _wrap_init(cls: type, then) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        then(self)
    cls.__init__, cls._minite_original_init = __init__, original


def revert_minite(family: str) -> None:
    """Undo ``apply_minite_to_<family>()`` on the classes (models already built stay swapped)."""
    if family not in FAMILIES:
        raise ValueError(f"minite.hf: family={family!r}; expected one of {', '.join(FAMILIES)}")
    mod, prefix = _modeling(family), FAMILIES[family]
    for cls in (getattr(mod, f"{prefix}Model"), getattr(mod, f"{prefix}ForCausalLM")):
        if "_minite_original_init" in cls.__dict__:
            cls.__init__ = cls.__dict__["_minite_original_init"]
            del cls._minite_original_init


def apply_minite_to_llama(model: PreTrainedModel | None = None, *, backend: str | None = None,
                          **switches: bool) -> PreTrainedModel | None:
    """Liger's ``apply_liger_kernel_to_llama`` shape: with a model, ``apply_minite(model, ...)``; without, patch
    LlamaModel / LlamaForCausalLM so that every Llama built afterwards (``from_pretrained`` too) is swapped."""
    return _apply_to("llama", model, backend, switches)


def apply_minite_to_mistral(model: PreTrainedModel | None = None, *, backend: str | None = None,
                            **switches: bool) -> PreTrainedModel | None:
    """apply_minite_to_llama for Mistral (a sliding window runs up to its length, see the module docstring)."""
    return _apply_to("mistral", model, backend, switches)


def apply_minite_to_qwen2(model: PreTrainedModel | None = None, *, backend: str | None = None,
                          **switches: bool) -> PreTrainedModel | None:
    """apply_minite_to_llama for Qwen2 (its q/k/v biases ride along in the swapped projections)."""
    return _apply_to("qwen2", model, backend, switches)


def swap_llama_layers(hf_model: LlamaPreTrainedModel, *, backend: str | None = None) -> LlamaPreTrainedModel:
    """``apply_minite(hf_model)`` with the switches that change modules (the loss stays HF's, as it always was):
    norms, attention and MLP on minite's kernels, in place, holding the model's own Parameters."""
    return apply_minite(hf_model, backend=backend, cross_entropy=False)
