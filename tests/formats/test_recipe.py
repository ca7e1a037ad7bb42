"""Chapter 02: Format, DelayedScaling / CurrentScaling scale updates, fp8_autocast state handling."""
import math

import pytest
import torch

from minite.formats import CurrentScaling, DelayedScaling, Format, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from minite.formats.recipe import ScalingState, compute_scale


def test_format_dtypes_and_max():
    assert Format.HYBRID.fwd == torch.float8_e4m3fn and Format.HYBRID.bwd == torch.float8_e5m2
    assert Format.E4M3.bwd == torch.float8_e4m3fn and Format.E5M2.fwd == torch.float8_e5m2
    # independent: E4M3fn max = 1.75 * 2^8, E5M2 max = 1.75 * 2^15
    assert Format.HYBRID.max_fwd == 1.75 * 2 ** 8 == 448.0
    assert Format.HYBRID.max_bwd == 1.75 * 2 ** 15 == 57344.0


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_compute_scale_formula(margin):
    amax = torch.tensor(3.5)
    got = compute_scale(amax, 448.0, margin, torch.tensor(7.0))
    assert math.isclose(got.item(), 448.0 / 3.5 / 2 ** margin, rel_tol=1e-6)


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_compute_scale_keeps_previous_when_amax_zero_or_not_finite(bad):
    got = compute_scale(torch.tensor(bad), 448.0, 0, torch.tensor(7.0))
    assert got.item() == 7.0


def test_delayed_scaling_history_rolls_and_max():
    r = DelayedScaling(amax_history_len=3, amax_compute_algo="max")
    s = r.new_state(torch.float8_e4m3fn)
    assert s.scale.item() == 1.0                          # no history yet: scale 1 (TransformerEngine's start)
    for a in [1.0, 2.0, 8.0, 4.0]:
        r.update(s, torch.tensor(a))
    assert s.amax_history.tolist() == [4.0, 8.0, 2.0]     # newest first, the oldest (1.0) rolled off
    assert math.isclose(s.scale.item(), 448.0 / 8.0)      # max over the window
    r.update(s, torch.tensor(1.0))                        # [1, 4, 8]: 8.0 is still in the window ...
    assert math.isclose(s.scale.item(), 448.0 / 8.0)
    r.update(s, torch.tensor(1.0))                        # [1, 1, 4]: ... and now it is gone
    assert math.isclose(s.scale.item(), 448.0 / 4.0)
    r.update(s, torch.tensor(1.0))
    assert s.amax_history.tolist() == [1.0, 1.0, 1.0]
    assert math.isclose(s.scale.item(), 448.0)


def test_delayed_scaling_most_recent_and_margin():
    r = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=2)
    s = r.new_state(torch.float8_e5m2)
    for a in [100.0, 1.0]:
        r.update(s, torch.tensor(a))
    assert math.isclose(s.scale.item(), 57344.0 / 1.0 / 4)


def test_delayed_scaling_keeps_scale_on_overflowed_amax():
    r = DelayedScaling(amax_history_len=2)
    s = r.new_state(torch.float8_e4m3fn)
    r.update(s, torch.tensor(2.0))
    r.update(s, torch.tensor(float("inf")))
    assert math.isclose(s.scale.item(), 224.0)            # not 0: the previous scale survives an inf
    assert s.amax_history[0].item() == float("inf")       # but the history records what happened


def test_delayed_scaling_scale_for_does_not_read_x():
    r = DelayedScaling(amax_history_len=2)
    s = r.new_state(torch.float8_e4m3fn)
    r.update(s, torch.tensor(4.0))
    assert r.scale_for(s, torch.full((3,), 1000.0)).item() == 112.0   # from history, not from x


def test_current_scaling_uses_this_tensor():
    r = CurrentScaling()
    s = r.new_state(torch.float8_e4m3fn)
    x = torch.tensor([0.5, -2.0, 1.0])
    assert math.isclose(r.scale_for(s, x).item(), 448.0 / 2.0)
    assert r.scale_for(s, torch.zeros(3)).item() == 224.0            # all-zero x keeps the previous scale


def test_recipe_bad_arguments():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="fp8_format"):
        DelayedScaling(fp8_format="hybrid")
    with pytest.raises(ValueError, match="unsupported fp8 dtype"):
        ScalingState(torch.float16)


def test_autocast_enables_and_restores():
    assert not is_fp8_enabled() and get_fp8_recipe() is None
    r = DelayedScaling(margin=1)
    with fp8_autocast(recipe=r) as ctx:
        assert is_fp8_enabled() and get_fp8_recipe() is r and ctx.recipe is r
    assert not is_fp8_enabled() and get_fp8_recipe() is None


def test_autocast_default_recipe_is_delayed_hybrid():
    with fp8_autocast():
        r = get_fp8_recipe()
        assert isinstance(r, DelayedScaling) and r.fp8_format == Format.HYBRID and r.amax_history_len == 1024


def test_autocast_restores_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast():
            raise RuntimeError("boom")
    assert not is_fp8_enabled() and get_fp8_recipe() is None


def test_autocast_nested_and_disabled_inner():
    outer, inner = DelayedScaling(), CurrentScaling()
    with fp8_autocast(recipe=outer):
        with fp8_autocast(recipe=inner):
            assert get_fp8_recipe() is inner
            with fp8_autocast(enabled=False):
                assert not is_fp8_enabled() and get_fp8_recipe() is None
            assert get_fp8_recipe() is inner
        assert get_fp8_recipe() is outer
        with pytest.raises(ValueError):
            with fp8_autocast(recipe=inner):
                raise ValueError("inner failure")
        assert get_fp8_recipe() is outer and is_fp8_enabled()
    assert not is_fp8_enabled()


def test_autocast_same_instance_reentrant_and_decorator():
    ac = fp8_autocast()
    with ac:
        with ac:
            assert is_fp8_enabled()
        assert is_fp8_enabled()
    assert not is_fp8_enabled()

    @fp8_autocast(recipe=CurrentScaling())
    def f():
        return type(get_fp8_recipe()).__name__
    assert f() == "CurrentScaling" and not is_fp8_enabled()


def test_autocast_bad_recipe():
    with pytest.raises(ValueError, match="recipe must be"):
        fp8_autocast(recipe="delayed")
