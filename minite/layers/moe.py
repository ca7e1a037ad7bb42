"""Mixture of experts (chapter 16): a router sends each token to top_k of E SwiGLU experts.

    probs = softmax(x @ W_r^T)                 (N, E)   router, in fp32
    experts = topk(probs [+ bias], k)          (N, k)   which experts each token visits
    y = sum_j w_j * expert_{e_j}(x)            w = probs at the chosen experts (renormalised when k > 1)

The work is done sorted by expert: ``permute`` stable-sorts the N*k (token, expert) assignments by expert id, so
expert e's rows are one slice offsets[e]:offsets[e+1] of a (N*k, C) tensor, and both expert projections are one
grouped GEMM each (minite/kernels/grouped_gemm.py); ``unpermute`` applies the inverse permutation and sums each
token's k weighted outputs. Offsets stay on the device: the dropless path has no host sync.

Load balance, two ways:
* ``"aux"`` (Switch Transformer / GShard): loss += aux_weight * E * sum_i f_i * P_i, f_i the fraction of assignments
  routed to expert i, P_i the mean router probability of expert i; 1.0 when the load is uniform.
* ``"bias"`` (DeepSeek-V3, auxiliary-loss-free): a per-expert bias added to the scores only to *choose* the
  experts; after each training backward, bias_i += rate * sign(mean load - load_i). No gradient, no extra loss.
  (The update runs from a hook on the router's gradient, not in the forward: activation recompute runs the forward
  twice, and the recomputed routing must be the first one.) Under ``hold_bias`` (a pipeline's micro-batches) the
  counts of every forward add up and the bias moves once, at the end: every micro-batch routes with the same bias.
Capacity: with capacity_factor c > 0 each expert takes at most ceil(c * N * k / E) assignments, in token order; the
rest are dropped (their token skips the experts: the residual carries it). c = 0 is dropless. The limit is a training
device (a static, balanced expert batch): in eval mode (validation, generation) every assignment is kept, as in
Mixtral's or DeepSeek's inference. Otherwise a token's output would depend on the other tokens of the batch, and
generation with the KV cache (N = B tokens a step) would not give the tokens of the uncached loop (N = B * T).

The reference ``moe_ref`` is a plain loop over the experts. Under expert parallelism (minite/parallel/expert.py)
this module holds only experts [expert_lo, expert_lo + E_local) and ``ep_group`` is set; the router is replicated.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn import functional as F

from minite.kernels.grouped_gemm import grouped_gemm
from minite.kernels.swiglu import swiglu
from minite.layers.mlp import SwiGLU

__all__ = ["route", "expert_counts", "load_balance_loss", "update_bias", "capacity", "permute", "unpermute",
           "moe_ref", "MoE", "hold_bias", "BALANCE"]

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


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, x (..., dim) -> (..., dim). After a forward: ``aux_loss`` (the Switch loss, for
    the training loss under balance="aux"), ``load`` (E,) assignments per expert, ``dropped`` (over capacity)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2, *, capacity_factor: float = 0.0,
                 balance: str = "aux", bias_rate: float = 1e-3, shared_expert: bool = False,
                 backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if balance not in BALANCE:
            raise ValueError(f"MoE: balance must be one of {BALANCE}, got {balance!r}")
        if not capacity_factor >= 0:
            raise ValueError(f"MoE: capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}")
        where = {"device": device, "dtype": dtype}
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, num_experts, top_k
        self.capacity_factor, self.balance, self.bias_rate, self.backend = capacity_factor, balance, bias_rate, backend
        self.router = nn.Linear(dim, num_experts, bias=False, **where)  # (E, C), applied in fp32
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden, **where))  # (E, C, 2H): [gate|up]
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim, **where))  # (E, H, C)
        for w in (self.router.weight, self.w_gate_up, self.w_down):
            nn.init.normal_(w, std=0.02)
        # (E,) "bias" balancing, never below fp32: its updates (bias_rate ~1e-3) would vanish in a bf16 bias
        bias_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=bias_dtype))
        self.shared = SwiGLU(dim, hidden, backend=backend, fused=True, **where) if shared_expert else None
        self.ep_group = None  # expert parallel: set by minite.parallel.expert.shard_experts
        self.stats_group = None  # the group whose global load the balancing sees (data parallel)
        self.expert_lo = 0
        self.aux_loss = self.load = self.dropped = None
        self._pending = None  # "bias": the load of the last training forward, applied when its backward arrives
        self._hooked = None  # id of the router weight that carries the hook (a deepcopy's weight carries none)
        self._held = None  # under hold_bias: the counts of the forwards so far (the bias moves when it ends)

    def __getstate__(self):  # deepcopy / pickle: the last aux_loss without its graph (a non-leaf cannot be copied)
        state = dict(self.__dict__)
        if isinstance(state.get("aux_loss"), torch.Tensor):
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    def _update_bias(self, _param) -> None:
        if self._pending is not None:
            update_bias(self.expert_bias, self._pending, self.bias_rate)
            self._pending = None

    @torch.compiler.disable  # eager: the autograd engine's state is not something to trace
    def _hold(self, counts: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() == -1:  # a recompute inside a backward is not a new forward
            self._held += counts

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
        counts = expert_counts(experts, E)  # (E,) routed, before any dropping
        if self.stats_group is not None:
            from minite.parallel import comm
            comm.all_reduce(counts, self.stats_group)  # the global load: every dp rank balances the same way
        self.aux_loss = load_balance_loss(probs, counts)  # the loss only under "aux"; a measure of balance always
        if self.balance == "bias" and self.training and torch.is_grad_enabled():
            if self._held is not None:  # hold_bias: summed, moved when the block ends
                self._hold(counts)
            else:
                self._pending = counts  # the bias moves after the backward (for the next step)
                if self._hooked != id(self.router.weight):
                    self.router.weight.register_post_accumulate_grad_hook(self._update_bias)
                    self._hooked = id(self.router.weight)
        cap = capacity(self.capacity_factor, experts.numel(), E) if self.training else 0  # eval: dropless
        xs, order, offsets = permute(x2, experts, E, cap)
        if self.ep_group is not None:
            from minite.parallel.expert import expert_parallel_ffn
            ys = expert_parallel_ffn(self, xs, offsets)
        else:
            ys = self.experts_ffn(xs, offsets)
        y = unpermute(ys, order, weights)  # (N, C)
        self.load, self.dropped = counts.detach(), experts.numel() - offsets[-1].detach()
        if self.shared is not None:
            y = y + self.shared(x2)
        return y.to(x.dtype).view(shape)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, balance={self.balance!r}, "
                f"shared_expert={self.shared is not None}")


@contextlib.contextmanager
def hold_bias(moes):
    """``with hold_bias(moe_layers):`` the "bias" balance of these MoE layers adds up the counts of every training
    forward inside and moves each bias once when the block ends (after the backwards), by the summed load: the
    micro-batches of a pipeline schedule all route with the same bias, like one process on the whole batch. Not
    moved if the block raises. Layers with another balance are left alone."""
    held = [m for m in moes if m.balance == "bias"]
    for m in held:
        m._pending, m._held = None, torch.zeros_like(m.expert_bias, dtype=torch.long)
    try:
        yield
        for m in held:
            update_bias(m.expert_bias, m._held, m.bias_rate)
    finally:
        for m in held:
            m._held = None


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
