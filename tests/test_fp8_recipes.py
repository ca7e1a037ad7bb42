"""FP8 recipes in the training run (chapter 15): --precision fp8 --fp8.recipe=delayed|current|blockwise|mxfp8, the
small-layer rule (--fp8.min_dim), each recipe's loss next to fp32's at equal steps, and exact resume under each."""
import pytest
import torch
import torch.nn.functional as F

import minite
from minite.checkpoint import load_checkpoint
from minite.config import ConfigError
from minite.formats import BlockwiseScaling, CurrentScaling, DelayedScaling, MXFP8Scaling, fp8_autocast
from minite.train import parse_cli, train

RECIPES = ["delayed", "current", "blockwise", "mxfp8"]
# A width-128 GPT (every GEMM dimension a multiple of 128: one 1x128 block per row), 20 steps on the CPU. The
# linear layers run the torch reference path (the same quantization math as the kernels, tests/kernels/
# test_fp8_block.py): the attention's Linears have no backend of their own, and interpreted FP8 GEMMs take minutes.
# Measured (this set-up, val loss minus fp32's): at 20 steps delayed +0.015, current +0.005, blockwise +0.003,
# mxfp8 -0.002 (bf16 +0.0002); the per-tensor recipes drift further with more steps at this size (at 30 steps
# delayed is +0.027, at 60 +0.055; blockwise +0.010 and +0.026).
WIDE = {"model.n_embd": 128, "model.n_head": 2, "train.max_iters": 20, "train.eval_interval": 10,
        "train.warmup_iters": 5, "train.lr": 3e-3}


class Interrupt(Exception):
    pass



def test_the_cli_and_the_config_take_the_recipe(run_cfg):
    _, over, _ = parse_cli(["--precision", "fp8", "--fp8.recipe=mxfp8", "--fp8.min_dim=256"])
    cfg = run_cfg(**over)
    assert (cfg.train.precision, cfg.train.fp8_recipe, cfg.train.fp8_min_dim) == ("fp8", "mxfp8", 256)
    assert run_cfg().train.fp8_recipe == "delayed"
    with pytest.raises(ConfigError, match=r"--train.fp8_recipe='tensorwise': must be delayed, current, blockwise "
                                          r"or mxfp8"):
        run_cfg(**{"train.precision": "fp8", "fp8.recipe": "tensorwise"})
    with pytest.raises(ConfigError, match=r"--fp8.recipe='blockwise' / --fp8.min_dim=0 need --precision fp8"):
        run_cfg(**{"fp8.recipe": "blockwise"})
    with pytest.raises(ConfigError, match=r"--train.fp8_min_dim=-1: must be an int >= 0"):
        run_cfg(**{"train.precision": "fp8", "fp8.min_dim": -1})


@pytest.mark.parametrize("recipe", [DelayedScaling(min_dim=64), CurrentScaling(min_dim=64),
                                    BlockwiseScaling(min_dim=64), MXFP8Scaling(min_dim=64)], ids=RECIPES)
def test_small_layers_stay_unquantized(recipe):
    # min(in, out) < min_dim: exactly F.linear, no FP8 state; the 64 x 160 layer is quantized (and differs).
    small, big = minite.nn.Linear(160, 32), minite.nn.Linear(160, 64)
    x = torch.randn(8, 160, generator=torch.Generator().manual_seed(0))
    with fp8_autocast(recipe=recipe), minite.use_backend("torch"):
        ys, yb = small(x), big(x)
    assert torch.equal(ys, F.linear(x, small.weight, small.bias)) and small.fp8_states is None
    assert not torch.equal(yb, F.linear(x, big.weight, big.bias)) and big.fp8_states is not None


def _losses(s):
    return [s["losses"][k] for k in sorted(s["losses"])]


def _train(cfg, **kw):
    with minite.use_backend("torch"):
        return train(cfg, **kw)


def test_every_recipe_trains_like_fp32_and_resumes_exactly(run_cfg, tmp_path):
    base = _train(run_cfg(**WIDE, **{"train.out_dir": str(tmp_path / "fp32")}))
    assert _losses(base)[0] - base["val_loss"] > 1.0  # it learns: a broken FP8 path could not follow it
    for recipe in RECIPES:
        over = {**WIDE, "train.precision": "fp8", "fp8.recipe": recipe}
        full = _train(run_cfg(**over, **{"train.out_dir": str(tmp_path / recipe)}))
        assert abs(full["val_loss"] - base["val_loss"]) < 0.02, (recipe, full["val_loss"], base["val_loss"])

        def crash(step, loss):
            if step == 12:  # two steps past the checkpoint at step 10
                raise Interrupt
        cut = run_cfg(**over, **{"train.out_dir": str(tmp_path / f"{recipe}-cut")})
        with pytest.raises(Interrupt):
            _train(cut, callback=crash)
        state = load_checkpoint(tmp_path / f"{recipe}-cut" / "ckpt.pt")
        assert state["step"] == 10
        extra = [v for k, v in state["model"].items() if k.endswith("_extra_state")]
        kind = {"delayed": "DelayedScaling", "current": "CurrentScaling", "blockwise": "BlockwiseScaling",
                "mxfp8": "MXFP8Scaling"}[recipe]
        assert extra and all(e["recipe"] == kind for e in extra)        # the FP8 state went into the checkpoint
        resumed = _train(cut, resume=True, resume_overrides={"train.out_dir": str(tmp_path / f"{recipe}-cut")})
        assert sorted(resumed["losses"]) == list(range(11, 21))
        for step, loss in resumed["losses"].items():
            assert loss == full["losses"][step], (recipe, step, loss, full["losses"][step])   # bit for bit
        assert resumed["val_loss"] == full["val_loss"]
