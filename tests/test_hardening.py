"""Issue 15's repros, one test each: every bad input gets a clear error, no silent NaN, exact resume, no lost log
lines, corruption detected. Each failed on the main branch before the fix (the note per test says what it did).
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minite import ops
from minite.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from minite.config import ConfigError, make_config
from minite.formats import E4M3, DelayedScaling, DynamicLossScaler, encode, fp8_autocast, quantize
from minite.kernels.cross_entropy import cross_entropy, cross_entropy_ref, linear_cross_entropy
from minite.kernels.rope import RotaryEmbedding
from minite.layers.linear import fp8_linear
from minite.train import main, train

BOTH = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
INF = float("inf")


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------------------------- cross-entropy and -inf logits
@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_with_a_masked_column_is_finite(backend, device):
    # was: nan on the Triton path (smoothing * sum_x / V = 0 * -inf)
    x = _randn(4, 10, device=device)
    x[:, 0] = -INF
    t = torch.tensor([1, 2, 3, 4], device=device)
    xr = x.clone().requires_grad_()
    loss = cross_entropy(xr, t, backend=backend)
    loss.backward()
    want = F.cross_entropy(x.cpu().double(), t.cpu()).float()
    assert torch.isfinite(loss) and abs(loss.item() - want.item()) < 1e-5
    assert torch.isfinite(xr.grad).all() and (xr.grad[:, 0] == 0).all()


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_with_a_whole_block_of_minus_inf(backend, device):
    # was: loss and all 18,000 gradients NaN on the Triton path (the running max starts at -inf - -inf)
    x = _randn(2, 9000, seed=1, device=device)
    x[:, :8192] = -INF
    t = torch.tensor([8500, 8999], device=device)
    xr = x.clone().requires_grad_()
    loss = cross_entropy(xr, t, reduction="none", backend=backend)
    loss.sum().backward()
    want = F.cross_entropy(x.cpu().double(), t.cpu(), reduction="none").float()
    assert torch.isfinite(loss).all() and torch.allclose(loss.cpu(), want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(xr.grad).all()
    want_grad = torch.softmax(x.cpu().double(), -1) - F.one_hot(t.cpu(), 9000)
    assert torch.allclose(xr.grad.cpu().double(), want_grad, atol=1e-6)


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_masked_logits_with_smoothing_matches_torch(backend, device):
    x = _randn(3, 40, seed=2, device=device)
    x[:, 5:9] = -INF
    t = torch.tensor([0, 10, 39], device=device)
    got = cross_entropy(x, t, label_smoothing=0.1, reduction="none", backend=backend)
    want = F.cross_entropy(x.cpu().double(), t.cpu(), label_smoothing=0.1, reduction="none").float()
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(want))   # eps * mean(-inf): +inf, as torch says
    assert not torch.isnan(got).any()


# ------------------------------------------------------------------------------------- empty and 0-d inputs
@pytest.mark.parametrize("backend", BOTH)
def test_empty_and_zero_dim_inputs_return_what_torch_returns(backend, device):
    # was: crashes in softmax (5, 0) on both paths, rmsnorm (3, 0), rope D=0, swiglu 0-d under the interpreter
    e = torch.empty(5, 0, device=device)
    assert ops.softmax(e, backend=backend).shape == (5, 0)
    assert ops.rmsnorm(torch.empty(3, 0, device=device), torch.empty(0, device=device), backend=backend).shape \
        == (3, 0)
    assert ops.layernorm(torch.empty(3, 0, device=device), torch.empty(0, device=device),
                         torch.empty(0, device=device), backend=backend).shape == (3, 0)
    cs = torch.empty(4, 0, device=device)
    assert ops.rope(torch.empty(1, 2, 4, 0, device=device), cs, cs, backend=backend).shape == (1, 2, 4, 0)
    g, u = torch.tensor(1.5, device=device, requires_grad=True), torch.tensor(-2.0, device=device)
    y = ops.swiglu(g, u, backend=backend)
    assert y.shape == () and abs(y.item() - (F.silu(torch.tensor(1.5)) * -2.0).item()) < 1e-6
    y.backward()
    assert g.grad.shape == ()


@pytest.mark.parametrize("backend", BOTH)
def test_cross_entropy_of_zero_classes_all_ignored(backend, device):
    # was: the reference path crashed (gather on an empty dim); torch returns nan for a mean over 0 rows
    x, t = torch.empty(4, 0, device=device), torch.full((4,), -100, device=device)
    assert torch.isnan(cross_entropy(x, t, backend=backend))
    assert cross_entropy(x, t, reduction="sum", backend=backend).item() == 0.0
    assert cross_entropy(x, t, reduction="none", backend=backend).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match=r"target\[0\] = 0 is out of range \[0, 0\)"):
        cross_entropy(torch.empty(2, 0), torch.zeros(2, dtype=torch.long))


def test_cross_entropy_reference_is_the_spec_for_masked_rows():
    x = torch.full((2, 5), -INF)
    x[1, 2] = 0.0
    got = cross_entropy_ref(x, torch.tensor([-100, 2]), reduction="none")
    assert got.tolist() == [0.0, 0.0]                     # the ignored all -inf row is 0, not nan


# ---------------------------------------------------------------------------------------- the 8 unclear errors
@pytest.mark.parametrize("call, err, match", [
    (lambda: ops.rmsnorm(torch.randn(2, 4), None), TypeError, r"rmsnorm: weight must be a torch.Tensor, got None"),
    (lambda: ops.rmsnorm(torch.randn(2, 4), torch.ones(4), eps="1e-6"), TypeError,
     r"rmsnorm: eps must be a real number, got str '1e-6'"),
    (lambda: linear_cross_entropy([[1.0]], torch.ones(3, 1), torch.zeros(1, dtype=torch.long)), TypeError,
     r"linear_cross_entropy: x must be a torch.Tensor, got list"),
    (lambda: quantize(torch.randn(4), torch.tensor(2.0, device="meta")), ValueError,
     r"quantize: scale is on meta but x is on cpu"),
    (lambda: quantize(torch.randn(4), "2.0"), TypeError, r"quantize: scale must be a number or a scalar tensor, "
                                                         r"got str '2.0'"),
    (lambda: fp8_linear(torch.randn(2, 8), torch.randn(4, 8), states={}), ValueError,
     r"fp8_linear: states must hold 'input', 'weight' and 'grad_output'.*missing \['input', 'weight', "
     r"'grad_output'\]"),
    (lambda: DynamicLossScaler(hysteresis="2"), TypeError, r"DynamicLossScaler: hysteresis must be an int, got str"),
    (lambda: RotaryEmbedding(8, 16)(torch.randn(1, 1, 4, 8), offset=1.5), TypeError,
     r"RotaryEmbedding: offset must be an int, got float 1.5"),
], ids=["rmsnorm-None", "eps-str", "lce-list", "scale-meta", "scale-str", "states-empty", "hysteresis-str",
        "offset-float"])
def test_unclear_errors_name_the_argument_and_value(call, err, match):
    with pytest.raises(err, match=match):
        call()


# ------------------------------------------------------------------------------------ the 12 silently accepted
@pytest.mark.parametrize("call, err, match", [
    (lambda: quantize(torch.randn(4), 0.0), ValueError, r"quantize: scale must be finite and > 0, got 0.0"),
    (lambda: quantize(torch.randn(4), float("nan")), ValueError, r"quantize: scale must be finite and > 0, got nan"),
    (lambda: quantize(torch.randn(4), INF), ValueError, r"quantize: scale must be finite and > 0, got inf"),
    (lambda: encode(torch.randn(4), E4M3, saturate="no"), TypeError, r"encode: saturate must be a bool or None, "
                                                                     r"got str 'no'"),
    (lambda: fp8_autocast(enabled="false"), TypeError, r"fp8_autocast: enabled must be a bool, got str 'false'"),
    (lambda: DynamicLossScaler(enabled="no"), TypeError, r"DynamicLossScaler: enabled must be a bool, got str 'no'"),
    (lambda: DynamicLossScaler(growth_factor=float("nan")), ValueError, r"growth_factor must be finite and > 1, "
                                                                        r"got nan"),
    (lambda: DynamicLossScaler(growth_factor=INF), ValueError, r"growth_factor must be finite and > 1, got inf"),
    (lambda: DynamicLossScaler(growth_interval=1.5), TypeError, r"growth_interval must be an int, got float 1.5"),
    (lambda: DynamicLossScaler().load_state_dict({"scale": float("nan"), "growth_tracker": 0, "hysteresis_tracker": 1}),
     ValueError,
     r"load_state_dict: scale must be finite and > 0, got nan"),
    (lambda: DynamicLossScaler().load_state_dict({"scale": -4.0, "growth_tracker": 0, "hysteresis_tracker": 1}),
     ValueError,
     r"load_state_dict: scale must be finite and > 0, got -4.0"),
    (lambda: DelayedScaling(margin=-200), ValueError, r"DelayedScaling: margin must be an int in \[0, 64\], "
                                                      r"got -200"),
], ids=["scale-0", "scale-nan", "scale-inf", "saturate-str", "autocast-str", "scaler-enabled-str",
        "growth-nan", "growth-inf", "interval-float", "state-nan", "state-negative", "margin-negative"])
def test_silently_accepted_inputs_now_raise(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_validation_keeps_the_valid_spellings():
    assert DynamicLossScaler(growth_interval=3, hysteresis=2, enabled=False).scale_value == 1.0
    assert quantize(torch.ones(3), torch.tensor(2.0)).scale_inv.item() == 0.5
    assert quantize(torch.ones(3), 4).scale_inv.item() == 0.25           # an int scale is a number too
    assert ops.rmsnorm(torch.ones(2, 4), torch.ones(4), eps=1).shape == (2, 4)
    assert DelayedScaling(margin=0).margin == 0 and fp8_autocast(enabled=False).enabled is False
    assert math.isclose(DelayedScaling(margin=3).margin, 3)


# ============================================================================================ training runs
class Crash(Exception):
    pass


def _crash_at(n):
    def cb(step, loss):
        if step == n:
            raise Crash
    return cb


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_resume_is_bit_exact_in_every_precision(run_cfg, tmp_path, precision):
    # was: fp8 diverged from step 31 on (amax histories and scales were not in the checkpoint); the FP8 states
    # now travel as each Linear's module extra state.
    over = {"train.precision": precision, "train.device": "cpu", "train.max_iters": 8}
    full = train(run_cfg(**over, **{"train.out_dir": str(tmp_path / "full")}))
    cut = run_cfg(**over, **{"train.out_dir": str(tmp_path / "cut")})
    with pytest.raises(Crash):
        train(cut, callback=_crash_at(6))              # the checkpoint at step 4 is the last one
    resumed = train(cut, resume=True, resume_overrides={"train.out_dir": str(tmp_path / "cut")})
    assert resumed["losses"] == {k: v for k, v in full["losses"].items() if k > 4}   # bit for bit
    a, b = load_checkpoint(tmp_path / "full" / "ckpt.pt"), load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b["model"][k]), k
        elif v is not None:                            # FP8 extra state: amax histories and scales
            for role, st in v["states"].items():
                assert torch.equal(st["amax_history"], b["model"][k]["states"][role]["amax_history"]), (k, role)
                assert torch.equal(st["scale"], b["model"][k]["states"][role]["scale"]), (k, role)
    if precision == "fp8":
        assert any(k.endswith("_extra_state") and v is not None for k, v in a["model"].items())


_KILLER = """
import os, signal, sys
from minite.config import make_config
from minite.train import train
cfg = make_config("cpu", dict(a.split("=", 1) for a in sys.argv[1:]))
def cb(step, loss):
    if step == 6:
        os.kill(os.getpid(), signal.SIGKILL)           # kill -9: no finally, no atexit, buffers lost
train(cfg, callback=cb)
"""


@pytest.mark.skipif(not hasattr(os, "kill") or sys.platform == "win32", reason="needs POSIX signals")
def test_kill_9_then_resume_leaves_a_complete_duplicate_free_log(tmp_path, make_corpus, tiny_run):
    # was: the loss lines written since the last val line were still in Python's buffer when the checkpoint
    # claimed their steps; kill -9 lost them for good.
    make_corpus(tmp_path / "c.txt", n_chars=6000, marks=".")
    out = tmp_path / "out"
    over = {**tiny_run, "train.max_iters": 8, "data.path": str(tmp_path / "c.txt"),
            "data.data_dir": str(tmp_path / "data"), "train.out_dir": str(out), "train.eval_interval": 8,
            "train.ckpt_interval": 4}
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _KILLER, *(f"{k}={v}" for k, v in over.items())], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    assert load_checkpoint(out / "ckpt.pt")["step"] == 4
    train(make_config("cpu", over), resume=True, resume_overrides={"train.out_dir": str(out)})
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))   # complete, each step once
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 8]


def test_orphan_tmp_files_are_removed_at_start_and_reported(run_cfg, tmp_path, capsys):
    # was: each kill during a write left a .ckpt.pt.tmp<pid> of the checkpoint's size, forever
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = out / f".ckpt.pt.tmp{int(dead.stdout)}"                    # a pid that has exited
    orphan.write_bytes(b"x" * 3000)
    live = out / f".ckpt.pt.tmp{os.getppid()}"                          # a live writer's file stays
    live.write_bytes(b"y")
    train(run_cfg(**{"train.max_iters": 1}))
    assert not orphan.exists() and live.exists()
    assert f"removed {orphan.name}" in capsys.readouterr().out


def _ckpt(run_cfg):
    cfg = run_cfg(**{"train.max_iters": 4})
    train(cfg)
    return cfg, cfg.train.out_dir + "/ckpt.pt"


def test_resume_drops_a_log_line_cut_short_by_a_kill(run_cfg):
    cfg, _ = _ckpt(run_cfg)
    log = cfg.train.out_dir + "/log.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 5, "loss": 3.1')                             # the process died mid-write
    train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "train.max_iters": "5"})
    rows = [json.loads(r) for r in open(log).read().splitlines()]     # every line parses
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]


def test_flipped_bytes_in_a_checkpoint_are_refused(run_cfg):
    # was: 64 flipped bytes loaded and resumed with exit 0 (one exp_avg went from -0.005 to 886.7)
    cfg, path = _ckpt(run_cfg)
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    open(path, "wb").write(data)
    with pytest.raises(CheckpointError, match=r"ckpt.pt is corrupt: its SHA-256 is .*, the one stored"):
        load_checkpoint(path)
    assert main(["--resume", "--out_dir", cfg.train.out_dir, "--data", cfg.data.path,
                 "--data.data_dir=" + cfg.data.data_dir]) == 2


@pytest.mark.parametrize("damage, match", [
    (lambda s: s["model"].__setitem__("wte.weight", torch.zeros(3, 5)),
     r"does not fit the model \(wrong shapes: wte.weight: checkpoint \(3, 5\), model \(\d+, 16\)\)"),
    (lambda s: s.pop("optimizer"), r"not a complete minite.train checkpoint \(missing \['optimizer'\]\)"),
    (lambda s: s.__setitem__("step", "4"), r"'step' must be an int >= 0, got str '4'"),
], ids=["wrong-shape", "no-optimizer", "step-str"])
def test_damaged_checkpoints_give_clear_errors(run_cfg, damage, match):
    # was: raw tracebacks (size mismatch from load_state_dict, KeyError 'optimizer', TypeError on the step)
    cfg, path = _ckpt(run_cfg)
    state = load_checkpoint(path)
    damage(state)
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=match):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "train.max_iters": "8"})


def test_resume_with_an_invalid_model_value_names_the_value_not_a_change(run_cfg):
    # was: "cannot change model fields ['n_embd']" for a value that is invalid in any run
    cfg, _ = _ckpt(run_cfg)
    with pytest.raises(ConfigError, match=r"n_embd=15 must be divisible by n_head=2"):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "model.n_embd": "15"})
    with pytest.raises(ConfigError, match=r"n_embd: 16 in the checkpoint, 32 requested"):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "model.n_embd": "32"})


BAD_CLI = [("--train.batch_size=0", "--train.batch_size=0: must be an int >= 1"),
           ("--train.batch_size=-1", "--train.batch_size=-1: must be an int >= 1"),
           ("--train.lr=-1", "--train.lr=-1.0: must be a finite number > 0"),
           ("--train.lr=nan", "--train.lr=nan: must be a finite number > 0"),
           ("--train.eval_interval=0", "--train.eval_interval=0: must be an int >= 1"),
           ("--train.log_interval=0", "--train.log_interval=0: must be an int >= 1"),
           ("--train.grad_accum=0", "--train.grad_accum=0: must be an int >= 1"),
           ("--train.threads=-1", "--train.threads=-1: must be an int >= 0"),
           ("--train.seed=-1", "--train.seed=-1: must be an int in [0, 2**32)"),
           ("--train.device=tpu", "--train.device='tpu': must be auto, cpu, cuda or cuda:N"),
           ("--data.tokenizer=word", "--data.tokenizer='word': must be char or byte"),
           ("OUT_IS_FILE", "--train.out_dir="),
           ("ONE_BYTE", "--data.path="),
           ("--train.max_iters=0", "--train.max_iters=0: must be an int >= 1"),
           ("--train.max_iters=-5", "--train.max_iters=-5: must be an int >= 1"),
           ("--train.eval_iters=0", "--train.eval_iters=0: must be an int >= 1"),
           ("--train.ckpt_interval=-1", "--train.ckpt_interval=-1: must be an int >= 0"),
           # issue 25: these trained to "val loss nan" with exit 0, or raised a traceback
           ("--model.rope_base=0", "GPTConfig.rope_base must be a finite number > 0, got 0.0"),
           ("--model.rope_base=nan", "GPTConfig.rope_base must be a finite number > 0, got nan"),
           ("--model.norm_eps=-1", "GPTConfig.norm_eps must be a finite number > 0, got -1.0"),
           ("--model.norm_eps=nan", "GPTConfig.norm_eps must be a finite number > 0, got nan"),
           ("--model.mlp_hidden=-5", "GPTConfig.mlp_hidden must be positive, got -5")]


@pytest.mark.parametrize("arg, message", BAD_CLI, ids=[a for a, _ in BAD_CLI])
def test_bad_command_lines_are_rejected_at_parse_time(arg, message, tmp_path, make_corpus, monkeypatch, capsys):
    # was: 13 tracebacks (ZeroDivisionError, UnboundLocalError, ...) and 4 runs that "succeeded" with exit 0
    import minite.train as T
    monkeypatch.setattr(T, "prepare", lambda *a, **k: pytest.fail("reached data preparation: not parse time"))
    make_corpus(tmp_path / "c.txt", n_chars=3000)
    argv = ["--data", str(tmp_path / "c.txt"), "--out_dir", str(tmp_path / "out")]
    if arg == "OUT_IS_FILE":
        (tmp_path / "f").write_text("x")
        arg = f"--out_dir={tmp_path / 'f'}"
    elif arg == "ONE_BYTE":
        (tmp_path / "one.txt").write_text("a")
        arg = f"--data={tmp_path / 'one.txt'}"
    assert main([*argv, arg]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_non_utf8_data_suggests_the_real_flag(tmp_path, capsys):
    # was: "use --tokenizer byte", a flag minite.train does not have
    (tmp_path / "latin1.txt").write_bytes(("caf\xe9 au lait. " * 400).encode("latin-1"))
    assert main(["--data", str(tmp_path / "latin1.txt"), "--out_dir", str(tmp_path / "o"),
                 "--data.data_dir=" + str(tmp_path / "d"), "--train.threads=1"]) == 2
    assert "--data.tokenizer=byte" in capsys.readouterr().err


# ============================================================================== issue 25: no silent NaN run, tools
def _args(cfg) -> list[str]:
    """The command line of a run_cfg() config (the tiny model's flags included)."""
    t = cfg.train
    m = cfg.model
    return ["--preset", "cpu", "--data", cfg.data.path, "--data.data_dir", cfg.data.data_dir, "--out_dir",
            t.out_dir, "--train.batch_size=4", "--train.eval_iters=2", "--train.warmup_iters=2",
            "--train.threads=1", "--train.progress=false", "--train.sample_tokens=0",
            f"--model.n_layer={m.n_layer}", f"--model.n_head={m.n_head}", f"--model.n_embd={m.n_embd}",
            f"--model.block_size={m.block_size}", f"--model.n_kv_head={m.n_kv_head}", "--model.backend=torch"]


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(run_cfg, monkeypatch, capsys):
    # was: --model.rope_base=nan trained to "val loss nan" and exited 0, writing NaN weights into ckpt.pt
    import minite.train as T
    real = T.train_step

    def poisoned(run):
        loss = real(run)
        return float("nan") if run.step == 6 else loss
    monkeypatch.setattr(T, "train_step", poisoned)
    cfg = run_cfg(**{"train.max_iters": 12})
    assert main([*_args(cfg), "--train.max_iters=12", "--train.eval_interval=4"]) == 1
    err = capsys.readouterr().err
    assert "the loss is nan at step 6: training diverged" in err, err
    assert load_checkpoint(Path(cfg.train.out_dir) / "ckpt.pt")["step"] == 4   # the last good one, untouched
    rows = [json.loads(r) for r in (Path(cfg.train.out_dir) / "log.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for r in rows for k, v in r.items() if k in ("loss", "val_loss"))


def test_resuming_non_finite_weights_is_refused(run_cfg):
    cfg = run_cfg(**{"train.max_iters": 8, "train.stop_at": 4})
    train(cfg)
    path = Path(cfg.train.out_dir) / "ckpt.pt"
    state = load_checkpoint(path)
    state["model"]["wte.weight"][0, :3] = float("nan")
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=r"non-finite weights: wte.weight \(3 of \d+\)"):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir})


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("rng"), r"random-number state \('rng'\) is missing or malformed"),
    (lambda s: s["rng"].update(sampler={"bad": 1}), r"random-number state \('rng'\) is missing or malformed"),
    (lambda s: s.update(optimizer={"state": {}, "param_groups": s["optimizer"].get("param_groups", [])}),
     r"is at step 4 but its optimizer state is empty"),
], ids=["no-rng", "rng-sampler", "empty-optimizer"])
def test_malformed_states_give_clear_errors(run_cfg, damage, message):
    # was: KeyError 'rng' / 'sampler', and an empty optimizer state resumed silently with fresh moments
    cfg = run_cfg(**{"train.max_iters": 8, "train.stop_at": 4})
    train(cfg)
    path = Path(cfg.train.out_dir) / "ckpt.pt"
    state = load_checkpoint(path)
    damage(state)
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=message):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir})


def test_resuming_a_finished_run_says_so_and_leaves_the_log_alone(run_cfg, capsys):
    # was: every --resume of a finished run appended another final val_loss row; step=999 was accepted
    cfg = run_cfg(**{"train.max_iters": 4})
    train(cfg)
    log = Path(cfg.train.out_dir) / "log.jsonl"
    before = log.read_text()
    assert main([*_args(cfg), "--train.max_iters=4", "--resume"]) == 2
    assert "has finished: its checkpoint is at step 4 and --train.max_iters=4" in capsys.readouterr().err
    assert log.read_text() == before
    path = Path(cfg.train.out_dir) / "ckpt.pt"
    state = load_checkpoint(path)
    state["step"] = 999
    save_checkpoint(path, state)
    with pytest.raises(ConfigError, match="checkpoint is at step 999 and --train.max_iters=4"):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir})


@pytest.mark.parametrize("flags, message", [
    ({"parallel.sp": "true"}, "--parallel.sp=True shards the sequence over the tensor-parallel group, but "
                              "--parallel.tp=1"),
    ({"parallel.microbatches": "4"}, "--parallel.microbatches=4 splits the batch between pipeline stages, but "
                                     "--parallel.pp=1"),
    ({"data.unknown_chars": "drop"}, "--data.unknown_chars='drop' only applies when fine-tuning"),
    ({"data.unknown_chars": "xyz"}, "--data.unknown_chars='xyz': must be error, drop or one character"),
], ids=["sp-without-tp", "microbatches-without-pp", "unknown-chars-without-base", "unknown-chars-xyz"])
def test_flags_that_would_be_ignored_are_refused(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config("cpu", flags)


def test_an_impossible_batch_says_what_it_needs_before_allocating(run_cfg):
    # was: --train.batch_size=100000 was OOM-killed with no message. The run's device is the one the memory is
    # counted on: the GPU's free memory on a CUDA machine (issue 32: this test expected "cpu" there)
    where = "cuda" if torch.cuda.is_available() else "cpu"
    with pytest.raises(ConfigError, match=rf"--train.batch_size=50000000 x 16 tokens needs at least [\d.]+ GiB of "
                                          rf"activations per rank, more than the [\d.]+ GiB free on {where}(:\d+)?; "):
        train(run_cfg(**{"train.batch_size": 50_000_000}))


@pytest.fixture
def lora_run(run_cfg, tmp_path):
    """(base config, LoRA run config): a tiny base, then a LoRA fine-tune of it (adapters-only checkpoint)."""
    base = run_cfg(**{"train.max_iters": 4, "train.out_dir": str(tmp_path / "base")})
    train(base)
    ft = run_cfg(**{"train.max_iters": 4, "train.out_dir": str(tmp_path / "lora"), "lora.r": 2,
                    "train.init_from": str(tmp_path / "base" / "ckpt.pt")})
    train(ft)
    return base, ft


def test_sample_and_init_from_take_a_lora_runs_checkpoint(lora_run, tmp_path, capsys):
    # was: minite.sample --ckpt <LoRA run>/ckpt.pt crashed with missing base keys; so did --init_from
    from minite import sample as msample
    from minite.finetune import lora_config
    from minite.layers.lora import apply_lora, load_lora, merge_lora
    from minite.models.gpt import GPT, GPTConfig
    base, ft = lora_run
    ckpt = Path(ft.train.out_dir) / "ckpt.pt"
    model, _ = msample.load_model(str(ckpt))
    # independent: the base's weights, the adapters loaded and merged by hand
    expect = GPT(GPTConfig(**load_checkpoint(ckpt)["config"]["model"]))
    expect.load_state_dict(load_checkpoint(Path(base.train.out_dir) / "ckpt.pt")["model"])
    apply_lora(expect, lora_config(ft.lora))
    load_lora(expect, load_checkpoint(ckpt)["model"])
    merge_lora(expect)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expect.state_dict()[k]), k
    assert msample.main(["--ckpt", str(ckpt), "--max_new_tokens", "5"]) == 0
    again = train(make_config("cpu", {
        **{f"model.{k}": v for k, v in vars(ft.model).items() if k in ("n_layer", "n_head", "n_embd")},
        "data.path": ft.data.path, "data.data_dir": ft.data.data_dir, "train.out_dir": str(tmp_path / "again"),
        "train.init_from": str(ckpt), "train.max_iters": 2, "train.eval_iters": 1, "train.batch_size": 4,
        "train.threads": 1, "train.progress": False, "train.sample_tokens": 0, "model.backend": "torch"}))
    assert again["steps"] == 2 and math.isfinite(again["val_loss"])


def test_init_from_refuses_model_flags_that_disagree_with_the_base(lora_run, capsys):
    # was: --init_from CKPT --model.n_layer=3 silently dropped the flag
    base, _ = lora_run
    args = _args(base)
    args[args.index("--out_dir") + 1] += "_ft"
    assert main([*args, "--init_from", str(Path(base.train.out_dir) / "ckpt.pt"), "--model.n_layer=3"]) == 2
    assert "fixes the model's shape; drop --model.n_layer=3 (the base has 1)" in capsys.readouterr().err


# ============================================================ issue 36: a tiny corpus, minite.sample's inputs
def test_prepare_refuses_a_corpus_too_small_to_split(tmp_path):
    # was: a 10-byte corpus prepared into 9 train / 1 val tokens
    from minite.data import DataError, prepare
    (tmp_path / "ten.txt").write_text("abcdefghi\n")
    with pytest.raises(DataError, match=r"too small: 10 tokens \(9 train / 1 val\); a corpus needs at least 100 "
                                        r"tokens \(10 for val"):
        prepare(tmp_path / "ten.txt", data_dir=tmp_path / "data", verbose=False)
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.bin"))
    (tmp_path / "hundred.txt").write_text("to be or not to be.\n" * 5)  # exactly 100: 90 / 10
    d = prepare(tmp_path / "hundred.txt", data_dir=tmp_path / "data", verbose=False)
    assert (len(d.split("train")), len(d.split("val"))) == (90, 10)


@pytest.fixture
def sample_ckpt(run_cfg):
    _, path = _ckpt(run_cfg)
    return path


@pytest.mark.parametrize("args, message", [
    (["--num_samples", "-1"], "--num_samples=-1: must be an int >= 1"),
    (["--num_samples", "0"], "--num_samples=0: must be an int >= 1"),
    (["--max_new_tokens", str(10**12)], "--max_new_tokens=1000000000000: must be an int from 0 to 100,000"),
    (["--max_new_tokens", "-1"], "--max_new_tokens=-1: must be an int from 0 to 100,000"),
    (["--device", "cuda"], "--device=cuda: no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu"),
    (["--device", "tpu"], "--device='tpu'"),
], ids=["samples-negative", "samples-zero", "tokens-huge", "tokens-negative", "cuda-without-gpu", "unknown-device"])
def test_sample_refuses_bad_counts_and_devices_at_parse_time(sample_ckpt, args, message, monkeypatch, capsys):
    # was: tracebacks (zeros: Dimension size must be non-negative; Torch not compiled with CUDA enabled; a KV cache
    # message for 0), and --max_new_tokens 10**12 ran with no output and no end
    from minite import sample as msample
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "without a GPU", on any machine
    monkeypatch.setattr(msample, "load_model", lambda *a, **k: pytest.fail("loaded the model: not parse time"))
    with pytest.raises(SystemExit) as e:
        msample.main(["--ckpt", sample_ckpt, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err


def _damage_tokenizer(shrink: bool):
    def damage(s):
        chars = list(s["tokenizer"]["chars"])
        s["tokenizer"] = {"kind": "char", "vocab_size": len(chars) - shrink,
                          "chars": chars[:-1] if shrink else [chars[1]] + chars[1:]}
    return damage


@pytest.mark.parametrize("damage, match", [
    (lambda s: s["model"].__setitem__("wte.weight", torch.zeros(3, 5)),
     r"does not fit the model \(wrong shapes: wte.weight: checkpoint \(3, 5\), model \(\d+, 16\)\)"),
    (lambda s: s["config"]["model"].__setitem__("n_layer", 2), r"does not fit the model \(missing: \['blocks.1."),
    (lambda s: s["model"]["wte.weight"].__setitem__((0, slice(0, 3)), float("nan")),
     r"non-finite weights: wte.weight \(3 of \d+\)"),
    (lambda s: s["config"]["model"].__setitem__("n_head", 3), r"its model configuration builds no model"),
    (_damage_tokenizer(True), r"its tokenizer has \d+ symbols \(it says \d+\), its model a vocabulary of \d+"),
    (_damage_tokenizer(False), r"its char tokenizer's symbols are not distinct single characters"),
], ids=["wrong-shape", "config-tensor-mismatch", "nan-weights", "config-builds-no-model", "tokenizer-shrunk",
        "tokenizer-duplicate"])
def test_sample_refuses_the_checkpoints_resume_refuses(sample_ckpt, damage, match, capsys):
    # was: tracebacks (size mismatch; missing keys; "probability tensor contains either inf, nan"), and a
    # checkpoint with an altered tokenizer sampled with exit 0
    from minite import sample as msample
    state = load_checkpoint(sample_ckpt)
    damage(state)
    save_checkpoint(sample_ckpt, state)
    assert msample.main(["--ckpt", sample_ckpt, "--max_new_tokens", "5", "--device", "cpu", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err, err


def test_sample_streams_its_tokens_over_a_sliding_context(sample_ckpt, monkeypatch, capsys):
    # was: model.generate(idx, max_new_tokens) returned all tokens at the end, its context growing with them
    monkeypatch.setenv("MINITE_BACKEND", "torch")  # streaming is the question, not the kernels (41 s interpreted)
    from minite import sample as msample
    from minite.models.gpt import GPT
    model, tok = msample.load_model(sample_ckpt)
    n = 3 * msample.STREAM_CHUNK + 5
    greedy = dict(max_new_tokens=n, temperature=0.0, use_cache=False)
    one_shot = tok.decode(model.generate(torch.tensor([tok.encode("\n")]), n, temperature=0.0, use_cache=False)[0]
                          .tolist())
    contexts, real = [], GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda self, idx, *a, **k: contexts.append(idx.shape[1]) or
                        real(self, idx, *a, **k))
    pieces = [p for (p,) in msample.stream(model, tok, "\n", **greedy)]
    assert [len(p) for p in pieces] == [msample.STREAM_CHUNK] * 3 + [5]  # printed a chunk at a time
    assert max(contexts) <= model.config.block_size  # the context slides: memory and time per token stay flat
    assert "\n" + "".join(pieces) == one_shot == msample.sample(model, tok, "\n", **greedy)[0]
    contexts.clear()
    assert msample.main(["--ckpt", sample_ckpt, "--max_new_tokens", str(n), "--device", "cpu", "--threads", "1",
                         "--temperature", "0", "--no_cache"]) == 0
    assert capsys.readouterr().out == one_shot + "\n" and len(contexts) == 4
