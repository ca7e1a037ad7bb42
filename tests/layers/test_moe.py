"""Mixture of experts (chapter 16): the layer vs the loop over experts (output and every gradient), routing, the
Switch loss by hand, the DeepSeek-V3 bias update, capacity dropping, permute/unpermute, the GPT with experts."""
import copy
import json

import pytest
import torch

from minite.layers.moe import (
    LocalExchange,
    MoE,
    capacity,
    load_balance_loss,
    moe_ref,
    permute,
    route,
    step_expert_bias,
    unpermute,
    update_bias,
)
from minite.models.gpt import GPT, GPTConfig
from minite.testing import assert_close
from minite.train import load_checkpoint, train

# (top_k, capacity_factor, balance, shared_expert)
CASES = [(1, 0.0, "aux", False), (2, 0.0, "bias", True), (2, 1.0, "aux", False), (1, 0.5, "none", False),
         (3, 0.0, "none", False)]


def _layer(k, cf, balance, shared, E=5, dim=16, hidden=32, seed=0, dtype=torch.float32, device="cpu", backend=None):
    torch.manual_seed(seed)
    m = MoE(dim, hidden, E, k, capacity_factor=cf, balance=balance, shared_expert=shared, backend=backend)
    with torch.no_grad():
        m.router.weight.mul_(40)  # router logits of order 1: a real spread of probabilities
        if balance == "bias":  # a bias large enough to change which experts are chosen
            m.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.2)
    return m.to(device=device, dtype=dtype)


def _grads(m, x, fn):
    x = x.detach().clone().requires_grad_()
    y = fn(m, x)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y)
    names = [n for n, p in m.named_parameters()]
    gs = torch.autograd.grad(y, [x] + [p for _, p in m.named_parameters()], up)
    return y.detach(), dict(zip(["x"] + names, gs))


def _compare(m, x, dtype):
    y_ref, g_ref = _grads(m, x, moe_ref)  # first: a training forward of the layer moves the "bias" balance
    y, g = _grads(m, x, lambda m, x: m(x))
    assert_close(y, y_ref, name="MoE output", dtype=dtype)
    for name in g_ref:
        assert_close(g[name], g_ref[name], name=f"grad {name}", dtype=dtype)
    assert set(g) == {"x", "router.weight", "w_gate_up", "w_down"} | (
        {"shared.gate_up.weight", "shared.down.weight"} if m.shared is not None else set())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("case", CASES)
def test_layer_matches_loop_over_experts(case, backend, device):
    m = _layer(*case, backend=backend, device=device)
    x = torch.randn(3, 9, 16, generator=torch.Generator().manual_seed(1)).to(device)  # 27 tokens: odd
    _compare(m, x, torch.float32)


@pytest.mark.triton
def test_layer_bf16_and_empty_experts(device):
    m = _layer(1, 0.0, "aux", False, E=8, dtype=torch.bfloat16, device=device, backend="triton")
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)  # 3 tokens
    _compare(m, x, torch.bfloat16)
    m(x)
    assert int((m.load == 0).sum()) >= 5  # 3 tokens, 8 experts: at least 5 experts empty


def test_route_topk_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    w, e, p = route(logits, 2)
    assert e.tolist() == [[0, 1], [2, 3]]
    assert_close(p, torch.softmax(logits, -1))
    assert_close(w, torch.tensor([[1 / (1 + torch.e ** -1)] * 1 + [1 / (1 + torch.e)]] +
                                 [[1 / (1 + torch.e ** -2), 1 / (1 + torch.e ** 2)]]))
    w1, e1, _ = route(logits, 1, bias=torch.tensor([0.0, 0.5, 0.0, 0.0]))
    assert e1.tolist() == [[1], [2]]  # the bias changes the first choice (0.24 + 0.5 > 0.64), not the second
    assert_close(w1, p.gather(1, e1))  # ... but the weight is the unbiased probability


def test_switch_loss_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    counts = torch.tensor([1, 1, 0])  # top-1 picks experts 0 and 1
    # f = (1/2, 1/2, 0), P = (0.4, 0.4, 0.2): E * sum f P = 3 * (0.2 + 0.2) = 1.2
    assert abs(float(load_balance_loss(probs, counts)) - 1.2) < 1e-6
    uniform = torch.full((4, 3), 1 / 3)
    assert abs(float(load_balance_loss(uniform, torch.tensor([4, 4, 4]))) - 1.0) < 1e-6  # balanced: 1


def test_aux_loss_gradient_pushes_toward_balance():
    m = _layer(1, 0.0, "aux", False, E=4, backend="torch")
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    m(x)
    busiest = int(m.load.argmax())
    (g,) = torch.autograd.grad(m.aux_loss, m.router.weight)
    before = torch.softmax(x @ m.router.weight.t(), -1).mean(0)[busiest]
    with torch.no_grad():
        m.router.weight -= 0.1 * g / g.norm()  # a step against the balance loss
    after = torch.softmax(x @ m.router.weight.t(), -1).mean(0)[busiest]
    assert after < before  # the busiest expert's mean probability goes down


def test_bias_update_sign_and_balance():
    b = torch.zeros(3)
    update_bias(b, torch.tensor([10, 2, 0]), 0.1)
    assert_close(b, torch.tensor([-0.1, 0.1, 0.1]))  # overloaded down, underloaded up
    m = _layer(2, 0.0, "bias", False, E=6, seed=4, backend="torch")  # balancing, not kernels: the fast path
    with torch.no_grad():
        m.expert_bias.zero_()
        m.router.weight[0] += 3 * m.router.weight[1]  # skew the router
    m.bias_rate = 0.01
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(4))
    m(x).sum().backward()
    first = m.load.float()
    assert m.expert_bias.abs().sum() == 0  # a forward and its backward move nothing: the step does
    assert torch.equal(m.routed, m.load)  # counted for the step
    step_expert_bias(m)
    assert torch.equal(m.expert_bias, 0.01 * torch.sign(first.mean() - first)) and not m.routed.any()
    loads = []
    for _ in range(60):
        m(x).sum().backward()
        step_expert_bias(m)
        loads.append(m.load.float())
    last = torch.stack(loads[-20:]).mean(0)  # the sign update oscillates around the balance: average it
    assert last.std() < 0.5 * first.std()  # the load moved toward uniform, with no loss term
    m.eval()
    bias = m.expert_bias.clone()
    m(x).sum().backward()
    with torch.no_grad():
        m.train()(x)
    step_expert_bias(m)
    assert torch.equal(bias, m.expert_bias)  # no count outside training (eval mode, or no gradient)
    twin = copy.deepcopy(m)  # a copy counts and balances on its own
    twin(x).sum().backward()
    step_expert_bias(twin)
    assert torch.equal(bias, m.expert_bias) and not torch.equal(bias, twin.expert_bias)
    m.router.weight.requires_grad_(False)  # a frozen router (LoRA's base) keeps its bias, and the count is emptied
    m(x).sum().backward()
    step_expert_bias(m)
    assert torch.equal(bias, m.expert_bias) and not m.routed.any()


def test_bias_moves_once_per_step_by_the_summed_load():
    # Gradient accumulation or a pipeline's micro-batches: every forward of the step routes with the same bias and
    # the bias moves once, by the load of all of them; a recompute counts its forward twice, which leaves the signs.
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=1, balance="bias", bias_rate=0.5, backend="torch")
    x = torch.randn(2, 12, 8)
    whole = torch.bincount(moe.router(x.reshape(-1, 8)).argmax(-1), minlength=4)  # top-1, zero bias
    for i, part in enumerate(x.chunk(2)):
        moe(part).sum().backward()
        assert not moe.expert_bias.any()  # the second micro-batch routes with the same bias
        assert int(moe.routed.sum()) == 12 * (i + 1)  # 12 tokens, top-1: each forward counted once
    step_expert_bias(moe)
    want = 0.5 * torch.sign(whole.float().mean() - whole.float())
    assert torch.equal(moe.expert_bias, want) and want.abs().sum() > 0
    with torch.no_grad():
        moe.expert_bias.zero_()
    for part in x.chunk(2):  # under full activation recompute: the forward runs again inside the backward
        checkpoint(moe, part, use_reentrant=False).sum().backward()
    assert torch.equal(moe.routed, 2 * whole)  # every count doubled
    step_expert_bias(moe)
    assert torch.equal(moe.expert_bias, want)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_bias_step_under_recompute_trains_as_without(mode):
    # minite.train's recompute modes re-run a block's forward in the backward (selective: every op it does not
    # save, the count's in-place add among them): the counts double, the bias and every weight stay bit-identical.
    from minite.recompute import apply_recompute

    def run(recompute):
        torch.manual_seed(0)
        m = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, backend="torch",
                          moe_num_experts=4, moe_balance="bias"))
        apply_recompute(m, recompute)
        opt, g = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):  # gradient accumulation: one bias step for both micro-batches
                x = torch.randint(0, 32, (2, 8), generator=g)
                m(x, x)[1].backward()
            routed = m.blocks[0].mlp.routed.clone()
            opt.step()
            step_expert_bias(m)
            opt.zero_grad()
        return m.state_dict(), routed

    (want, routed), (got, routed2) = run("none"), run(mode)
    assert torch.equal(routed2, 2 * routed) and want["blocks.0.mlp.expert_bias"].abs().sum() > 0
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_bad_rates_and_capacities_are_refused_by_name():
    # issue 36: bias_rate=nan was accepted and made expert_bias all NaN one backward later; capacity_factor=inf
    # raised an OverflowError (math.ceil) at the first training step. A dropless layer is capacity_factor=0.
    for rate in (float("nan"), float("inf"), -1e-3):
        with pytest.raises(ValueError, match=f"MoE: bias_rate must be finite and >= 0, got {rate}"):
            MoE(8, 16, 4, balance="bias", bias_rate=rate)
    for cf in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=rf"capacity_factor must be a finite number >= 0 \(0 = dropless\), "
                                             rf"got float {cf}"):
            MoE(8, 16, 4, capacity_factor=cf)
    with pytest.raises(ValueError, match="got str '1'"):
        MoE(8, 16, 4, capacity_factor="1")
    with pytest.raises(ValueError, match="update_bias: rate must be finite and >= 0, got nan"):
        update_bias(torch.zeros(4), torch.tensor([1, 2, 3, 4]), float("nan"))
    m = MoE(8, 16, 4, balance="bias", backend="torch")
    m.bias_rate = float("nan")  # set after construction: refused at the step, before the bias is touched
    m(torch.randn(5, 8)).sum().backward()
    with pytest.raises(ValueError, match="rate must be finite"):
        step_expert_bias(m)
    assert torch.isfinite(m.expert_bias).all()


def test_the_token_exchange_is_a_collaborator():
    # The layer hands its sorted rows and its counts to its exchange and knows nothing else of where the experts
    # are (minite.parallel.expert installs the all-to-all one): a recording exchange sees both, and the default
    # is one process.
    seen = []

    class Recording(LocalExchange):
        def experts(self, ffn, xs, offsets):
            seen.append(("experts", xs.shape, offsets.tolist()))
            return ffn(xs, offsets)

        def batch_sum(self, t):
            seen.append(("batch_sum", t.tolist()))
            return t * 3  # as if two more ranks held the same tokens

    torch.manual_seed(0)
    m = MoE(8, 16, 4, 2, backend="torch", exchange=Recording())
    x = torch.randn(6, 8)
    y = m(x)
    assert [s[0] for s in seen] == ["batch_sum", "experts"] and seen[1][1] == (12, 8)
    assert torch.equal(m.load, 3 * torch.tensor(seen[0][1]))  # the batch's load is the exchange's
    torch.testing.assert_close(y, moe_ref(m, x))
    assert isinstance(MoE(8, 16, 4).exchange, LocalExchange)
    assert copy.deepcopy(m).exchange is m.exchange  # shared, never copied (a parallel one holds process groups)


def test_capacity_drops_in_token_order():
    experts = torch.tensor([[0], [0], [1], [0], [0], [2]])  # 6 tokens, k = 1, E = 3
    x = torch.arange(6.0)[:, None].repeat(1, 2)
    cap = capacity(1.0, 6, 3)
    assert cap == 2
    xs, order, offsets = permute(x, experts, 3, cap)
    assert offsets.tolist() == [0, 2, 3, 4]
    assert xs[:, 0].tolist() == [0.0, 1.0, 2.0, 5.0, 3.0, 4.0]  # expert 0 keeps tokens 0, 1; 3 and 4 dropped
    m = _layer(1, 0.5, "none", False, E=4, backend="torch")
    y = m(torch.randn(40, 16, generator=torch.Generator().manual_seed(6)))
    cap = capacity(0.5, 40, 4)
    assert int(m.dropped) == int((m.load - cap).clamp(min=0).sum()) > 0
    assert int((y.abs().sum(-1) == 0).sum()) == int(m.dropped)  # k = 1: a dropped token's output is 0
    m.capacity_factor = 0.0
    m(torch.randn(40, 16))
    assert int(m.dropped) == 0  # dropless


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_capacity_applies_in_training_only(backend, device):
    # Eval (validation, generation) is dropless: the layer and the loop both keep every assignment there.
    m = _layer(1, 0.5, "none", False, E=4, backend=backend, device=device)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(6)).to(device)
    m(x)
    assert int(m.dropped) > 0
    m.eval()
    _compare(m, x, torch.float32)
    assert int(m.dropped) == 0
    m.capacity_factor = 0.0
    torch.testing.assert_close(m(x), moe_ref(m, x))


def test_generation_with_the_cache_matches_without_it_under_a_capacity():
    # generate()'s contract, with experts: the KV cache routes B tokens a step, the uncached loop B * T, so a
    # capacity limit at generation time dropped different assignments and gave other tokens (48 of 60 differed).
    from minite.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_embd=64, moe_num_experts=8, moe_top_k=2,
                    moe_capacity_factor=1.0, backend="torch")
    m = GPT(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)  # sharp routing: a skewed load that a capacity limit would cut
        idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
        cached = m.generate(idx, 30, temperature=0, use_cache=True)
        uncached = m.generate(idx, 30, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached), int((cached != uncached).sum())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_permute_unpermute_round_trip(k):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(13, 5, generator=g)
    experts = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(13)])  # (13, k) distinct per token
    xs, order, offsets = permute(x, experts, 6)
    flat = experts.reshape(-1)[order]
    assert torch.all(flat[1:] >= flat[:-1])  # sorted by expert
    assert offsets.tolist() == [0] + torch.bincount(experts.reshape(-1), minlength=6).cumsum(0).tolist()
    for r in range(13 * k):  # each sorted row is its assignment's token
        assert torch.equal(xs[r], x[order[r] // k])
    assert_close(unpermute(xs, order, torch.full((13, k), 1.0 / k)), x)


def test_gpt_with_experts_loss_and_stats():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, mlp_hidden=64, backend="torch",
                    moe_num_experts=4, moe_top_k=2, moe_aux_weight=0.5)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 64, (2, 15))
    _, loss = model(x, x)
    aux = sum(float(b.mlp.aux_loss) for b in model.blocks)
    copy.deepcopy(model)  # after a training forward (the TP / pipeline wrappers and the thread probe deep-copy)
    model.eval()
    _, ce = model(x, x)
    assert abs(loss.item() - ce.item() - 0.5 * aux) < 1e-5  # the balance loss joins the training loss only
    s = model.moe_stats()
    assert sum(s["tokens_per_expert"]) == 2 * 2 * 15 * 2 and s["dropped"] == 0  # layers x tokens x k
    assert model.state_dict()["blocks.0.mlp.w_gate_up"].shape == (4, 32, 128)  # dense expert weights
    out = model.generate(x[:1, :4], 5, temperature=0)  # the KV-cache path routes one token at a time
    assert torch.equal(out, model.generate(x[:1, :4], 5, temperature=0, use_cache=False))
    with pytest.raises(ValueError, match="moe_top_k=5"):
        GPTConfig(moe_num_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="moe_balance"):
        GPTConfig(moe_num_experts=4, moe_balance="loss")
    with pytest.raises(ValueError, match=r"expected an input \(\.\.\., dim=32\), got \(2, 15, 31\)"):
        model.blocks[0].mlp(torch.randn(2, 15, 31))
    with pytest.raises(ValueError, match="top_k=0 must be in"):
        MoE(8, 16, 4, 0)


def test_moe_gpt_trains_logs_and_resumes(run_cfg, tmp_path):
    over = {"model.moe_num_experts": 4, "model.moe_top_k": 2, "model.moe_balance": "bias",
            "model.moe_capacity_factor": 1.0, "train.max_iters": 6, "train.eval_interval": 3}
    full = train(run_cfg(**over, **{"train.out_dir": str(tmp_path / "full")}))
    cut = run_cfg(**over, **{"train.out_dir": str(tmp_path / "cut"), "train.stop_at": 3})
    train(cut)
    state = load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    assert state["model"]["blocks.0.mlp.w_down"].shape[0] == 4  # the dense experts
    assert state["model"]["blocks.0.mlp.expert_bias"].abs().sum() > 0  # the balancing bias is saved too
    resumed = train(cut, resume=True, resume_overrides={"train.out_dir": str(tmp_path / "cut"), "train.stop_at": 0})
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], (step, loss, full["losses"][step])
    rows = [json.loads(r) for r in (tmp_path / "full" / "log.jsonl").read_text().splitlines() if '"loss"' in r]
    assert all(len(r["moe_tokens_per_expert"]) == 4 and "moe_dropped" in r and "moe_balance_loss" in r
               for r in rows)
    assert any(r["moe_dropped"] > 0 for r in rows)
