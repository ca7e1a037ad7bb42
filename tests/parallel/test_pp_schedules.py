"""Issue 38: the zero-bubble (ZB-H1) and interleaved pipeline schedules as data, no processes.

Every rank's op list is checked as the executor runs it (``check_plan``: each F before its B, each B before its W,
the sends of one rank met by the receives of the next in the same order, no deadlock); wrong schedules must fail
it; the simulated bubble and peak activations at unit costs equal each schedule's formula; and the B/W split of a
real stage (``DeferredWeights``) gives the dense gradients, with no weight GEMM in B.
"""
import copy

import pytest
import torch

from minite.models.gpt import GPT, GPTConfig
from minite.parallel.schedules import (
    FORMULAS,
    SCHEDULES,
    DeferredWeights,
    check_plan,
    in_flight,
    interleaved,
    plan,
    schedule_table,
    simulate_ops,
    zbh1,
)

CASES = [(2, 1), (2, 4), (3, 5), (4, 2), (4, 3), (4, 8), (4, 12)]


@pytest.mark.parametrize("p,m", CASES)
def test_every_schedule_is_a_valid_plan_and_holds_its_bound(p, m):
    for name, sched in SCHEDULES.items():
        v = getattr(sched, "v", 1)
        if name == "interleaved" and m % p:
            with pytest.raises(ValueError, match=f"m={m}, p={p}"):
                plan(sched, p, m)
            continue
        plans = plan(sched, p, m)
        check_plan(plans, p, m, v)
        for r, ops in plans.items():
            bound = {"afab": m, "1f1b": min(p - r, m), "zbh1": min(p, m),
                     "interleaved": (2 * (p - r - 1) + (v - 1) * p + 1) / v}[name]
            assert in_flight(ops, v) <= bound, (name, r)
        assert max(in_flight(ops, v) for ops in plans.values()) == FORMULAS[name][1](p, m, v) or name == "interleaved"


def test_zbh1_order_and_its_w_ops_fill_the_cool_down():
    assert zbh1(2, 3, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2), ("W", 1),
                             ("W", 2)]
    assert zbh1(2, 3, 0) == [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1), ("W", 1), ("B", 2),
                             ("W", 2)]
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 16)):
        ev = simulate_ops(plan(zbh1, p, m), p)
        ends = [r[-1][4] for r in ev.values()]
        assert max(ends) == 3 * m + p - 1  # (p-1)(F+B-W) of bubble at unit costs
        assert ev[p - 1][-1][0] == "W" and ev[0][-1][0] == "W"


def test_interleaved_chunks_and_order():
    ops = interleaved(2)(2, 4, 0)  # p=2, m=4, v=2: chunks of p micro-batches, the backward's chunks last first
    assert ops[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1)]
    assert sorted(op for op in ops if op[0] == "B") == [("B", i, c) for i in range(4) for c in range(2)]


def _wrong_plans():
    good = plan(zbh1, 2, 3)
    w_first = copy.deepcopy(good)
    w_first[1] = [("F", 0, 0), ("W", 0, 0), ("B", 0, 0)] + w_first[1][3:]  # W before its B
    swapped = copy.deepcopy(good)  # stage 1 takes its activations in another order than stage 0 sends them
    swapped[1] = [("F", 1, 0), ("B", 1, 0), ("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 2, 0), ("B", 2, 0),
                  ("W", 1, 0), ("W", 2, 0)]
    deadlock = {0: [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],  # stage 0 waits for B0 before sending F1,
                1: [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]}  # stage 1 for F1 before sending B0
    missing = copy.deepcopy(good)
    missing[0] = [op for op in missing[0] if op != ("W", 2, 0)]
    mixed = copy.deepcopy(good)
    mixed[0] = [op for op in mixed[0] if op[0] != "W"]  # stage 0 unsplit, stage 1 split
    return {r"'W', 0, 0\) before its B": (w_first, 3), "sends and receives do not match": (swapped, 3),
            "deadlocks": (deadlock, 2), r"W ops missing .*\(2, 0\)": (missing, 3), "some ranks split": (mixed, 3)}


@pytest.mark.parametrize("why", list(_wrong_plans()))
def test_wrong_schedules_fail_the_check(why):
    plans, m = _wrong_plans()[why]
    with pytest.raises(ValueError, match=why):
        check_plan(plans, 2, m)


def test_afab_breaks_the_zbh1_memory_bound():
    assert max(in_flight(ops) for ops in plan(SCHEDULES["afab"], 4, 8).values()) == 8 > 4


def test_table_at_p4_m8_matches_the_formulas():
    rows = {r["schedule"]: r for r in schedule_table(4, 8, 2)}
    assert set(rows) == {"afab", "1f1b", "zbh1", "interleaved"}
    for r in rows.values():
        assert r["bubble"] == pytest.approx(r["bubble_formula"]) and r["peak_activations"] == r["peak_formula"]
    assert rows["zbh1"]["bubble"] == pytest.approx(3 / 27) and rows["1f1b"]["bubble"] == pytest.approx(3 / 11)
    assert rows["interleaved"]["peak_activations"] == 5.5 and rows["zbh1"]["peak_activations"] == 4


def test_deferred_weights_split_gives_the_dense_gradients():
    """A middle stage (activations in) and the whole model as one stage (ids in, loss out): B computes the input
    gradient and the other parameters' but no linear weight's; W adds those; all equal one backward."""
    from minite.parallel.pipeline_stage import Stage
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, mlp_hidden=24, backend="torch")
    dense = GPT(cfg)
    for layers, first, last in ((range(1, 2), False, False), (range(0, 2), True, True)):
        stage, ref = Stage(dense, layers, first, last), Stage(dense, layers, first, last)
        ref.load_state_dict(stage.state_dict())
        x = torch.randint(0, 32, (3, 8)) if first else torch.randn(3, 8, 16)
        y = torch.randint(0, 32, (3, 8)) if last else None
        inp, inp_ref = (x, x) if first else (x.clone().requires_grad_(), x.clone().requires_grad_())
        out_ref = ref(inp_ref, y)
        g = torch.ones_like(out_ref) if last else torch.randn_like(out_ref)
        out_ref.backward(g)
        split = DeferredWeights(stage)
        with split.forward(0):
            out = stage(inp, y)
        dx = split.backward_input(0, [out], [g], inp if not first else None)
        linears = [mod for mod in stage.modules() if mod.__class__.__name__ == "Linear"]
        assert linears and all(mod.weight.grad is None for mod in linears)
        if not first:
            torch.testing.assert_close(dx, inp_ref.grad)
        split.backward_weight(0)
        want = dict(ref.named_parameters())
        for n, q in stage.named_parameters():
            torch.testing.assert_close(q.grad, want[n].grad, rtol=1e-5, atol=1e-6, msg=n)


def test_interleaved_layouts_that_cannot_run_are_refused_by_name():
    from minite.config import ConfigError, ParallelConfig
    from minite.parallel.dims import ParallelError, check_layout
    with pytest.raises(ConfigError, match="pp_schedule='zb'.*interleaved"):
        ParallelConfig(pp=2, pp_schedule="zb")
    for n_layer, m, want in ((3, 2, "n_layer >= 2\\*pp = 4 \\(n_layer=3\\)"), (4, 3, "divisible by pp=2 \\(3\\)")):
        p = ParallelConfig(pp=2, microbatches=m, pp_schedule="interleaved")
        with pytest.raises(ParallelError, match=want):
            check_layout(p, GPTConfig(n_layer=n_layer), world=2, seq_len=8, batch_size=6)
    check_layout(ParallelConfig(pp=2, microbatches=2, pp_schedule="interleaved"), GPTConfig(n_layer=4), world=2,
                 seq_len=8, batch_size=6)
