"""minite inside Hugging Face: run a ``transformers`` Llama on minite's kernels, or convert it to minite's GPT.

Transformer Engine's Hugging Face tutorial swaps ``LlamaForCausalLM``'s decoder layers for TE's to run an existing
checkpoint on TE's kernels. This module does the same with minite's, two ways:

    swap_llama_layers(hf)  in place: every decoder layer's norms, attention and MLP become minite modules that hold
                           the SAME Parameters (no copy, state_dict keys unchanged), so ``hf(...)``, ``hf.generate``,
                           ``save_pretrained`` and training keep working; the ops are minite's (RMSNorm, RoPE, flash
                           attention, split-KV decode, SwiGLU kernels) and every projection is a ``minite.nn.Linear``,
                           so ``fp8_autocast`` runs them in FP8 (the LM head stays in higher precision, as in the GPT).
    from_hf_llama(hf)      a new ``minite.models.gpt.GPT`` with the weights copied (q/k/v and gate/up fused).
    to_hf_llama(gpt)       a new ``LlamaForCausalLM`` (the inverse), e.g. to ``save_pretrained`` a minite run.

Layouts. HF's Llama applies RoPE rotate-half style: pair i is (x[i], x[i + D/2]) (its conversion script permuted
Meta's interleaved q/k rows into that layout once). minite's rope kernel rotates the same pairs, so the q and k
weights map unpermuted; the tests show that an interleaving permutation would change the logits. GQA: both stack
the KVH key/value heads in order and query head h reads kv head h // (H / KVH).

Vocabulary. The GPT pads its vocabulary up to ``vocab_multiple`` (tensor-core tiles) and always ties the LM head
to the embedding. from_hf_llama copies the V real rows and zeroes the padded ones (never sampled; they do enter the
training softmax, so pass ``vocab_multiple=1`` for a loss equal to HF's); to_hf_llama keeps the V real rows.

KV cache. The swapped attention uses HF's own ``Cache`` object (whatever ``generate`` made: dynamic or static),
not minite's ``KVCache``: HF owns the cache's life cycle (beam reordering, cropping). minite's kernels read it: the
flash-attention kernel for a prefill, the split-KV decode kernel for one new token.

Masks. minite's kernels take causal attention and no mask. A padded batch (left or right padding, as a tokenizer
makes for batched ``generate``) runs exactly all the same: each sequence's real tokens are gathered and attend
causally to each other, one flash-attention launch per sequence. Any other mask (a sliding window, a bias) is
refused with a NotImplementedError.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minite.models.gpt import GPT, GPTConfig
from minite.nn import Linear, RMSNorm
from minite.ops import attention, decode_attention, rope, swiglu

if TYPE_CHECKING:  # an optional dependency (minite[hf]): for the annotations only
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaPreTrainedModel

__all__ = ["from_hf_llama", "to_hf_llama", "swap_llama_layers", "gpt_config_from_llama", "MiniteLlamaAttention",
           "MiniteLlamaMLP"]


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


def _check_llama(model, *, to_gpt: bool):
    """The Llama inside ``model`` (a LlamaForCausalLM or LlamaModel), after refusing what minite cannot run."""
    tf = _transformers()
    if not isinstance(model, tf.LlamaPreTrainedModel) or (to_gpt and not isinstance(model, tf.LlamaForCausalLM)):
        need = "LlamaForCausalLM" if to_gpt else "LlamaForCausalLM or LlamaModel"
        raise TypeError(f"minite.hf: expected a transformers {need}, got {type(model).__name__}")
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
        if bool(c.attention_bias) != bool(getattr(c, "mlp_bias", False)):
            _refuse("attention_bias", c.attention_bias, f"GPTConfig.bias is one switch for every projection, and "
                    f"mlp_bias={getattr(c, 'mlp_bias', False)!r} differs")
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if head is not emb and not torch.equal(head, emb):
            _refuse("tie_word_embeddings", c.tie_word_embeddings, "the GPT's LM head is always tied to its "
                    "embedding (wte), and this lm_head holds other weights")
    llama = model.model if isinstance(model, tf.LlamaForCausalLM) else model
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
                     norm_eps=config.rms_norm_eps, bias=bool(config.attention_bias), vocab_multiple=vocab_multiple,
                     backend=backend)


@torch.no_grad()
def from_hf_llama(hf_model: LlamaForCausalLM, *, block_size: int | None = None, vocab_multiple: int = 64,
                  backend: str = "auto") -> GPT:
    """A minite GPT with the weights of a transformers ``LlamaForCausalLM`` (copied: q/k/v and gate/up are fused).

    block_size: the context length (default ``max_position_embeddings``; each layer keeps RoPE tables this long).
    vocab_multiple: the GPT's vocabulary padding; the padded rows are zero. Raises ValueError naming the config
    field of anything that does not map (RoPE scaling, biases on only some projections, an untied LM head, ...).
    """
    _check_llama(hf_model, to_gpt=True)
    cfg = gpt_config_from_llama(hf_model.config, block_size=block_size, vocab_multiple=vocab_multiple,
                                backend=backend)
    src = dict(hf_model.named_parameters())
    emb = hf_model.get_input_embeddings().weight  # (V, C)
    device, dtype = emb.device, emb.dtype
    with torch.device(device):
        gpt = GPT(cfg)  # RoPE tables built on the device, in fp32
    state = {g: torch.cat([src[n] for n in hs]) for g, hs in _pairs(cfg.n_layer, cfg.bias)}
    state["wte.weight"] = torch.cat([emb, emb.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, cfg.n_embd)])
    gpt.load_state_dict(state, strict=True)
    for p in gpt.parameters():  # the checkpoint's dtype for the weights; the RoPE buffers stay fp32
        p.data = p.data.to(dtype)
    return gpt.train(hf_model.training)


@torch.no_grad()
def to_hf_llama(gpt: GPT) -> LlamaForCausalLM:
    """A transformers ``LlamaForCausalLM`` with the weights of a minite GPT (tied embedding, the V real rows)."""
    tf = _transformers()
    c = gpt.config
    if c.moe_num_experts:  # a Llama has one MLP per block: there is no place for experts or a router
        raise ValueError(f"to_hf_llama: this GPT has moe_num_experts={c.moe_num_experts} (a mixture of experts); "
                         "LlamaForCausalLM holds one dense MLP per block, so its experts cannot be mapped")
    config = tf.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.mlp_hidden, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.n_embd // c.n_head,
        max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_base, hidden_act="silu",
        attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=0.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # a minite run has no special tokens
    wte = gpt.wte.weight
    hf = tf.LlamaForCausalLM(config).to(device=wte.device, dtype=wte.dtype)
    dst, src = dict(hf.named_parameters()), dict(gpt.named_parameters())
    for g, hs in _pairs(c.n_layer, c.bias):
        for n, part in zip(hs, src[g].split([dst[n].shape[0] for n in hs])):
            dst[n].copy_(part)
    hf.get_input_embeddings().weight.copy_(wte[:c.vocab_size])
    if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:  # tying failed: copy the head
        hf.get_output_embeddings().weight.copy_(wte[:c.vocab_size])
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
    """HF's LlamaAttention on minite: minite Linears on HF's q/k/v/o weights, minite's rope kernel with HF's cos/sin
    tables (so HF's RoPE scaling types work), HF's cache, then minite's flash attention (or split-KV decode)."""

    def __init__(self, attn: nn.Module, backend: str | None = None) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_linear(getattr(attn, f"{n}_proj"), backend)
                                                              for n in "qkvo")
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.config, self.is_causal, self.backend = attn.config, True, backend
        tf_major_minor = tuple(int(p) for p in _transformers().__version__.split(".")[:2])
        self._returns_cache = tf_major_minor < (4, 48)  # 4.45-4.47 return (out, weights, past_key_value)

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
        q, k = _rope_hf(q, cos, sin, self.backend), _rope_hf(k, cos, sin, self.backend)
        # The cache argument's name changed: past_key_value (4.x) -> past_key_values (4.56) -> cache (5.x).
        cache = next((kwargs[n] for n in ("cache", "past_key_values", "past_key_value") if kwargs.get(n) is not None),
                     None)
        if cache is not None:  # 4.x takes cache_kwargs as the 4th argument; 5.x ignores it
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            k, v = cache.update(k, v, self.layer_idx, cache_kwargs)  # (B, KVH, T_k, D): past + new (static: padded)
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

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, head_dim={self.head_dim}, backend={self.backend!r}"


def swap_llama_layers(hf_model: LlamaPreTrainedModel, *, backend: str | None = None) -> LlamaPreTrainedModel:
    """Run a transformers Llama on minite's kernels, in place, and return it: in every decoder layer the two RMSNorms
    become ``minite.nn.RMSNorm``, the attention ``MiniteLlamaAttention``, the MLP ``MiniteLlamaMLP`` (and the final
    norm too), all holding the model's own Parameters. ``backend`` as everywhere in minite (None: auto)."""
    llama = _check_llama(hf_model, to_gpt=False)
    for layer in llama.layers:
        layer.input_layernorm = _rmsnorm(layer.input_layernorm, backend)
        layer.post_attention_layernorm = _rmsnorm(layer.post_attention_layernorm, backend)
        layer.self_attn = MiniteLlamaAttention(layer.self_attn, backend)
        layer.mlp = MiniteLlamaMLP(layer.mlp, backend)
    llama.norm = _rmsnorm(llama.norm, backend)
    return hf_model
