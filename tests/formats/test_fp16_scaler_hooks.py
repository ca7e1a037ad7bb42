"""DynamicLossScaler's two hooks for distributed training: the gradients an optimizer names with ``grads()`` (ZeRO's
flat shard, which is no parameter's ``.grad``) and ``found_inf_everywhere`` (the verdict OR-ed over the ranks).
On real ranks: tests/parallel/test_fp16_parallel.py."""
import math

import pytest
import torch

from minite.formats import DynamicLossScaler
from minite.models.gpt import GPT, GPTConfig
from minite.parallel.data import DataParallel
from minite.parallel.dims import ParallelDims
from minite.parallel.runtime import Parallel
from minite.parallel.zero import JointShardedAdamW, ShardedAdamW

S = 2.0 ** 10


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=32,
                         backend="torch"))


def _zero_step(stage, scaler, poison=None):
    """One ZeRO step of one process (DataParallel over no group) with `scaler`: (model, dp, norm, stepped)."""
    model = _gpt()
    dp = DataParallel(model, None, stage=stage)
    opt = ShardedAdamW(dp, lr=0.1)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    scaler.scale(model(x, x)[1]).backward()
    dp.finish()
    if poison is not None:
        dp.shard_grad[3] = poison
    scaler.unscale_(opt)
    norm = float(opt.clip_grad_norm_(math.inf))
    stepped = scaler.step(opt)
    scaler.update()
    return model, dp, norm, stepped


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_shard_gradient_is_unscaled(stage):
    ref = _gpt()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ref(x, x)[1].backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf))
    _, dp, norm, stepped = _zero_step(stage, DynamicLossScaler(init_scale=S))
    assert stepped and norm == pytest.approx(ref_norm, rel=1e-5)  # not S times it
    assert torch.allclose(dp.shard_grad, dp.shard_mask(lambda n, p: dict(ref.named_parameters())[n].grad),
                          atol=1e-6)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_zero_shard_overflow_skips(bad):
    scaler = DynamicLossScaler(init_scale=S)
    model, dp, _, stepped = _zero_step(2, scaler, poison=bad)
    assert not stepped and scaler.scale_value == S / 2
    for k, v in dp.full_state_dict().items():
        assert torch.equal(v, _gpt().state_dict()[k]), k


def test_joint_sharded_adamw_grads_are_every_part():
    dps = [DataParallel(_gpt(s), None, stage=1) for s in (0, 1)]
    opt = JointShardedAdamW([ShardedAdamW(d) for d in dps], [None])
    assert [g.data_ptr() for g in opt.grads()] == [d.shard_grad.data_ptr() for d in dps]
    dps[1].shard_grad[0] = math.inf
    assert DynamicLossScaler().unscale_(opt) is True


def _linear_step(scaler, grad_value):
    """One SGD step of a Linear whose gradient is `grad_value` * S everywhere: (stepped, weight changed)."""
    lin = torch.nn.Linear(2, 2, bias=False)
    before = lin.weight.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    lin.weight.grad = torch.full_like(lin.weight, grad_value * scaler.scale_value)
    stepped = scaler.step(opt)
    scaler.update()
    return stepped, not torch.equal(lin.weight, before)


def test_found_inf_everywhere_decides_and_is_called_once_per_step():
    calls = []

    def everywhere(found):  # another rank found an inf: every rank skips
        calls.append(found)
        return True
    scaler = DynamicLossScaler(init_scale=S, found_inf_everywhere=everywhere)
    assert _linear_step(scaler, 1.0) == (False, False)  # my grads are finite, yet the step is skipped
    assert calls == [False] and scaler.scale_value == S / 2
    scaler.found_inf_everywhere = lambda found: found  # nobody else: my own verdict
    assert _linear_step(scaler, 1.0) == (True, True)
    assert _linear_step(scaler, math.inf) == (False, False)


def test_found_inf_everywhere_not_called_when_disabled_and_rejected_when_not_callable():
    scaler = DynamicLossScaler(enabled=False, found_inf_everywhere=lambda found: pytest.fail("called"))
    assert _linear_step(scaler, 1.0) == (True, True)
    with pytest.raises(TypeError, match="found_inf_everywhere.*bool"):
        DynamicLossScaler(found_inf_everywhere=True)


def test_state_dict_unchanged_and_hook_kept_by_load():
    hook = lambda found: found  # noqa: E731
    scaler = DynamicLossScaler(init_scale=S, found_inf_everywhere=hook)
    state = scaler.state_dict()
    assert set(state) == {"scale", "growth_tracker", "hysteresis_tracker", "growth_factor", "backoff_factor",
                          "growth_interval", "hysteresis", "min_scale", "enabled"}
    scaler.load_state_dict({**state, "scale": 8.0})
    assert scaler.found_inf_everywhere is hook and scaler.scale_value == 8.0


def test_parallel_found_inf_anywhere_alone_is_the_own_verdict():
    par = Parallel(ParallelDims())  # one process: no collective (no process group exists)
    assert par.found_inf_anywhere(True) is True and par.found_inf_anywhere(False) is False
