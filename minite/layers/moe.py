"""Mixture of experts (chapter 16): a router sends each token to top_k of E SwiGLU experts.

    probs = softmax(x @ W_r^T)                 (N, E)   router, in fp32
    experts = topk(probs [+ bias], k)          (N, k)   which experts each token visits
    y = sum_j w_j * expert_{e_j}(x)            w = probs at the chosen experts (renormalised when k > 1)

The work is done sorted by expert: ``permute`` stable-sorts the N*k (token, expert) assignments by expert id, so
expert e's rows are one slice offsets[e]:offsets[e+1] of a (N*k, C) tensor, and both expert projections are one
grouped GEMM each (minite/kernels/grouped_gemm.py); ``unpermute`` applies the inverse permutation and sums each
token's k weighted outputs. Offsets stay on the device: the dropless path has no host sync.

The token exchange is a collaborator (``exchange``), as torchtitan applies expert parallelism from outside: the
layer hands it the sorted rows and the local experts (``exchange.experts(ffn, xs, offsets)``) and its routed counts
(``exchange.batch_sum(counts)``: the load of the whole batch). The default, ``LocalExchange``, is one process with
every expert. minite/parallel/expert.py shards the experts and installs an all-to-all exchange, and the parallel
runtime one that sums the load over the data-parallel ranks; this module knows no process group.

Load balance, two ways:
* ``"aux"`` (Switch Transformer / GShard): loss += aux_weight * E * sum_i f_i * P_i, f_i the fraction of assignments
  routed to expert i, P_i the mean router probability of expert i; 1.0 when the load is uniform.
* ``"bias"`` (DeepSeek-V3, auxiliary-loss-free): a per-expert bias added to the scores only to *choose* the
  experts; once per optimizer step, bias_i += rate * sign(mean load - load_i). No gradient, no extra loss. Every
  training forward adds its load to ``routed``; ``step_expert_bias(model)``, one explicit call next to the
  optimizer's step (minite.train, the tests' loops), moves every bias by the load of the whole step (its
  micro-batches, a pipeline's too) and starts counting afresh. The bias never moves between a forward and its
  backward, so an activation recompute routes as the first forward did; a recompute counts its forward again,
  which doubles every count of that layer and leaves sign(mean - load_i) unchanged.
Capacity: with capacity_factor c > 0 each expert takes at most ceil(c * N * k / E) assignments, in token order; the
rest are dropped (their token skips the experts: the residual carries it). c = 0 is dropless; c must be finite
(a dropless layer is c = 0, not c = inf). The limit is a training device (a static, balanced expert batch): in
eval mode (validation, generation) every assignment is kept, as in Mixtral's or DeepSeek's inference. Otherwise a
token's output would depend on the other tokens of the batch, and generation with the KV cache (N = B tokens a
step) would not give the tokens of the uncached loop (N = B * T).

The reference ``moe_ref`` is a plain loop over the experts.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from minite import _validate as _v
from minite.kernels.grouped_gemm import grouped_gemm
from minite.kernels.swiglu import swiglu
from minite.layers.mlp import SwiGLU

__all__ = ["route", "expert_counts", "load_balance_loss", "update_bias", "capacity", "permute", "unpermute",
           "moe_ref", "MoE", "LocalExchange", "step_expert_bias", "BALANCE"]

BALANCE = ("aux", "bias", "none")


def route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None):
    """logits (N, E) -> (weights (N, k) fp32, experts (N, k) int64, probs (N, E) fp32).
    The bias (E,) only changes which experts are chosen; the weights are the unbiased probabilities."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    scores = probs if bias is None else probs + bias.float()
    experts = scores.topk(top_k, dim=-1).indices  # (N, k)
    weights = probs.gather(1, experts)  # (N, k)
    if top_k > 1:  # Mixtral: the k weights sum to 1 (with k = 1 that would leave the router no gradient)
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, probs


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts (N, k) -> (E,) int64 assignments per expert. A scatter-add rather than ``bincount``, whose output size
    depends on the data (max id + 1) and which torch.compile marks a dynamic-shape op: this one's size is static."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_i f_i * P_i; probs (N, E), counts (E,) assignments per expert (f_i =
    counts_i / sum(counts); counts may come from a bigger batch than probs: the global load under data parallel)."""
    E = probs.shape[-1]
    f = counts.float() / counts.sum().clamp(min=1)  # (E,) no gradient: counts come from an argmax
    return E * (f * probs.mean(0)).sum()


@torch.no_grad()
def update_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free update, in place: raise the bias of underloaded experts, lower the others."""
    rate = _v.real("update_bias", "rate", rate, ge=0)  # a NaN rate made the whole bias NaN one step later
    load = counts.float()
    bias += rate * torch.sign(load.mean() - load)


def capacity(factor: float, n_assign: int, num_experts: int) -> int:
    """Assignments one expert may take: ceil(factor * N * k / E); 0 = no limit (dropless)."""
    return 0 if factor <= 0 else math.ceil(factor * n_assign / num_experts)


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int, cap: int = 0):
    """Sort the N*k assignments by expert id. x (N, C), experts (N, k) ->
    (x_sorted (N*k, C), order (N*k,) assignment index of each sorted row, offsets (E + 1,)).
    With cap > 0, the assignments past an expert's first `cap` (in token order) go after offsets[E]: dropped."""
    k = experts.shape[1]
    flat = experts.reshape(-1)  # (N*k,) assignment a = token * k + slot
    order = torch.argsort(flat, stable=True)  # stable: token order within each expert
    counts = expert_counts(flat, num_experts)  # (E,)
    if cap > 0:
        starts = torch.cumsum(counts, 0) - counts  # (E,) first sorted row of each expert
        pos = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]  # rank within the expert
        key = torch.where(pos < cap, flat[order], num_experts)  # dropped: past every expert
        order = order[torch.argsort(key, stable=True)]
        counts = counts.clamp(max=cap)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])  # (E + 1,)
    return x[order // k], order, offsets


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The inverse of ``permute``: row a of the (N*k, C) assignment order is y_sorted[inverse[a]]; then each token's
    k rows weighted by weights (N, k) and summed -> (N, C). Dropped rows of y_sorted are 0."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)  # inverse[order[i]] = i
    N, k = weights.shape
    y = y_sorted[inverse].view(N, k, -1)  # (N, k, C)
    return (y * weights.to(y.dtype)[..., None]).sum(1)


class LocalExchange:
    """The default token exchange: every expert is in this process and this process's tokens are the whole batch.
    ``experts(ffn, xs, offsets)``: rows sorted by expert id (M, C) -> (M, C), through ``ffn`` (the layer's experts);
    ``batch_sum(t)``: t summed over the processes holding tokens of the batch (here: t itself). Stateless: a deep
    copy of the layer shares it (minite.parallel.expert's exchanges hold process groups, which are not copied)."""

    def experts(self, ffn, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return ffn(xs, offsets)

    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def __deepcopy__(self, memo):
        return self


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, x (..., dim) -> (..., dim). After a forward: ``aux_loss`` (the Switch loss, for
    the training loss under balance="aux"), ``load`` (E,) assignments per expert of the batch, ``dropped`` (over
    capacity, this process's). ``routed`` (E,): the load of the training forwards since the last
    ``step_expert_bias`` (balance="bias"). ``exchange``: the token exchange (``LocalExchange`` unless given)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2, *, capacity_factor: float = 0.0,
                 balance: str = "aux", bias_rate: float = 1e-3, shared_expert: bool = False,
                 backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, exchange: LocalExchange | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if balance not in BALANCE:
            raise ValueError(f"MoE: balance must be one of {BALANCE}, got {balance!r}")
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
                or not 0 <= capacity_factor < math.inf:  # inf overflowed ceil() at the first step: dropless is 0
            raise ValueError(f"MoE: capacity_factor must be a finite number >= 0 (0 = dropless), got "
                             f"{_v.describe(capacity_factor)}")
        bias_rate = _v.real("MoE", "bias_rate", bias_rate, ge=0)  # NaN: the bias all NaN after one step
        where = {"device": device, "dtype": dtype}
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, num_experts, top_k
        self.capacity_factor, self.balance, self.bias_rate, self.backend = capacity_factor, balance, bias_rate, backend
        self.exchange = LocalExchange() if exchange is None else exchange
        self.router = nn.Linear(dim, num_experts, bias=False, **where)  # (E, C), applied in fp32
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden, **where))  # (E, C, 2H): [gate|up]
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim, **where))  # (E, H, C)
        for w in (self.router.weight, self.w_gate_up, self.w_down):
            nn.init.normal_(w, std=0.02)
        # (E,) "bias" balancing, never below fp32: its updates (bias_rate ~1e-3) would vanish in a bf16 bias
        bias_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=bias_dtype))
        # (E,) the load counted for the next bias step: not a weight, not in the checkpoint (a step empties it)
        self.register_buffer("routed", torch.zeros(num_experts, device=device, dtype=torch.long), persistent=False)
        self.shared = SwiGLU(dim, hidden, backend=backend, fused=True, **where) if shared_expert else None
        self.aux_loss = self.load = self.dropped = None

    def __getstate__(self):  # deepcopy / pickle: the last aux_loss without its graph (a non-leaf cannot be copied)
        state = dict(self.__dict__)
        if isinstance(state.get("aux_loss"), torch.Tensor):
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    def experts_ffn(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The local experts on rows sorted by expert: (M, C) -> (M, C); two grouped GEMMs around SwiGLU."""
        h = grouped_gemm(xs, self.w_gate_up.to(xs.dtype), offsets, backend=self.backend)  # (M, 2H)
        gate, up = h.split(self.hidden, dim=-1)  # (M, H) strided views
        return grouped_gemm(swiglu(gate, up, backend=self.backend), self.w_down.to(xs.dtype), offsets,
                            backend=self.backend)  # (M, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.dim:
            raise ValueError(f"MoE: expected an input (..., dim={self.dim}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        shape, E = x.shape, self.num_experts
        x2 = x.reshape(-1, self.dim)  # (N, C)
        logits = F.linear(x2.float(), self.router.weight.float())  # (N, E), fp32 even under autocast
        weights, experts, probs = route(logits, self.top_k, self.expert_bias if self.balance == "bias" else None)
        # (E,) routed, before any dropping; the batch's load (every rank balances the same way under dp)
        counts = self.exchange.batch_sum(expert_counts(experts, E))
        self.aux_loss = load_balance_loss(probs, counts)  # the loss only under "aux"; a measure of balance always
        if self.balance == "bias" and self.training and torch.is_grad_enabled():
            self.routed += counts  # the bias moves at step_expert_bias, after the whole step's backwards
        cap = capacity(self.capacity_factor, experts.numel(), E) if self.training else 0  # eval: dropless
        xs, order, offsets = permute(x2, experts, E, cap)
        ys = self.exchange.experts(self.experts_ffn, xs, offsets)  # (N*k, C), rows in the same order
        y = unpermute(ys, order, weights)  # (N, C)
        self.load, self.dropped = counts.detach(), experts.numel() - offsets[-1].detach()
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.to(x.dtype).view(shape)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, balance={self.balance!r}, "
                f"shared_expert={self.shared is not None}")


@torch.no_grad()
def step_expert_bias(model: nn.Module) -> None:
    """The loss-free balance's step, once per optimizer step (call it next to ``opt.step()``): every MoE layer of
    `model` under balance="bias" moves its bias by the load its training forwards counted since the last call
    (``routed``: the whole step's micro-batches, summed over the batch's ranks by the exchange) and empties it. The
    bias belongs to the router: a frozen router (a LoRA fine-tune's base, whose checkpoint holds only the adapters)
    keeps its bias as well."""
    for m in model.modules():
        if isinstance(m, MoE) and m.balance == "bias":
            if m.router.weight.requires_grad:
                update_bias(m.expert_bias, m.routed, m.bias_rate)
            m.routed.zero_()


def moe_ref(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The spec: a loop over the experts in fp32, each taking its tokens in token order (the first `cap` of them
    under a capacity limit, in training mode only); the same router math. Leaves the layer's state alone."""
    shape, E, k = x.shape, moe.num_experts, moe.top_k
    x2 = x.reshape(-1, moe.dim).float()  # (N, C)
    probs = torch.softmax(x2 @ moe.router.weight.float().t(), dim=-1)  # (N, E)
    chosen = (probs + moe.expert_bias if moe.balance == "bias" else probs).topk(k, dim=-1).indices  # (N, k)
    w = probs.gather(1, chosen)
    w = w / w.sum(-1, keepdim=True) if k > 1 else w
    cap = math.ceil(moe.capacity_factor * chosen.numel() / E) if moe.capacity_factor > 0 and moe.training \
        else chosen.numel()
    out = torch.zeros_like(x2)
    for e in range(E):
        tok, slot = (chosen == e).nonzero(as_tuple=True)  # row-major: in token order
        tok, slot = tok[:cap], slot[:cap]
        gate, up = (x2[tok] @ moe.w_gate_up[e].float()).chunk(2, dim=-1)  # (n_e, H) each
        y = (F.silu(gate) * up) @ moe.w_down[e].float()  # (n_e, C)
        out = out.index_add(0, tok, y * w[tok, slot, None])
    if moe.shared is not None:
        out = out + moe.shared(x2.to(x.dtype)).float()
    return out.to(x.dtype).view(shape)
