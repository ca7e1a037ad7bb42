"""minite.train / minite.sample: configs and their errors, exact resume, atomic checkpoints, precisions, the CLI."""
import json
import re
from pathlib import Path

import pytest
import torch

from minite import sample as msample
from minite.config import ConfigError, make_config, valid_keys
from minite.resources import pick_threads
from minite.train import CheckpointError, default_preset, load_checkpoint, main, parse_cli, save_checkpoint, train

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, tiny ops on shared cores


# ------------------------------------------------------------------------------------------------ configs
def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_iter'\. Did you mean train\.max_iters") as e:
        make_config("cpu", {"train.max_iter": "5"})
    assert all(k in str(e.value) for k in valid_keys())
    with pytest.raises(ConfigError, match="unknown config key 'nosection'"):
        make_config("cpu", {"nosection": "1"})
    with pytest.raises(ConfigError, match=r"unknown config key 'compile'\. Did you mean --train\.compile=\.\.\.\?"):
        make_config("cpu", {"compile": "default"})  # issue 37: a field without its section gets the full key


@pytest.mark.parametrize("gpus, local_world, device, want", [
    (0, 1, "auto", "cpu"), (1, 1, "auto", "gpu"), (1, 1, "cpu", "cpu"),
    (1, 2, "auto", "cpu"),   # 2 torchrun ranks on 1 GPU: they train on gloo on the CPU, so the CPU preset
    (2, 2, "auto", "gpu"), (1, 2, "cuda", "gpu")])  # cuda with too few GPUs: the run's own error, on gpu
def test_default_preset_follows_the_ranks_device(monkeypatch, gpus, local_world, device, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert default_preset({} if device == "auto" else {"train.device": device}) == want


def test_expert_options_on_a_dense_model_are_refused():
    with pytest.raises(ConfigError, match=r"model.moe.top_k given, but the model has no experts"):
        make_config("cpu", {"model.moe.top_k": "4"})
    assert make_config("cpu", {"model.moe.top_k": "4", "model.moe.num_experts": "8"}).model.moe_top_k == 4
    assert make_config("cpu", {"model.moe.top_k": "4"}, new_run=False)  # resuming: the checkpoint has the model


def test_bad_type_and_preset():
    with pytest.raises(ConfigError, match=r"--train.lr: expected float, got 'fast'"):
        make_config("cpu", {"train.lr": "fast"})
    with pytest.raises(ConfigError, match=r"--model.n_layer: expected int, got '2.5'"):
        make_config("cpu", {"model.n_layer": "2.5"})
    with pytest.raises(ConfigError, match="--train.progress: expected bool"):
        make_config("cpu", {"train.progress": "maybe"})
    with pytest.raises(ConfigError, match="n_head=4 must be divisible by n_kv_head=3"):
        make_config("cpu", {"model.n_kv_head": "3"})
    with pytest.raises(ConfigError, match="unknown preset 'tpu'; valid: cpu, gpu"):
        make_config("tpu", {})
    c = make_config("gpu", {"model.n_embd": "192", "train.progress": "false"})
    assert c.model.n_embd == 192 and c.model.mlp_hidden == 512 and c.train.progress is False  # derived after overrides


def test_parse_cli():
    preset, over, resume = parse_cli(["--preset", "cpu", "--data", "a.txt", "--out_dir=o", "--train.lr=0.1",
                                      "--precision", "fp8", "--resume"])
    assert (preset, resume) == ("cpu", True)
    assert over == {"data.path": "a.txt", "train.out_dir": "o", "train.lr": "0.1", "train.precision": "fp8"}
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["stray"])


def test_help_lists_every_field(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in valid_keys():
        assert f"--{key}=" in out, key
    assert "peak learning rate" in out and "preset cpu:" in out


def test_cli_errors(tmp_path, capsys):
    assert main(["--data", str(tmp_path / "nope.txt"), "--train.threads=1"]) == 2
    assert "--data.path=" in (err := capsys.readouterr().err) and "must be an existing text file" in err
    assert main(["--model.n_layers=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'model.n_layers'" in err and "model.n_layer" in err


def test_block_size_larger_than_model(run_cfg):
    with pytest.raises(ConfigError, match="data.block_size=32 is larger than the model's block_size=16"):
        train(run_cfg(**{"data.block_size": 32}))


# ------------------------------------------------------------------------------------------------ training
def test_train_writes_log_plot_checkpoint_and_samples(run_cfg, tmp_path, capsys):
    s = train(run_cfg(**{"train.sample_tokens": 20, "train.max_iters": 8}))
    out = tmp_path / "out"
    assert s["steps"] == 8 and len(s["losses"]) == 8 and len(s["sample"]) >= 20
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 4, 8]
    assert val[-1] == pytest.approx(s["val_loss"], abs=1e-5) and val[-1] < val[0] - 0.3  # it learns
    assert {"loss", "lr", "tokens_per_s"} <= set(rows[1])
    assert (out / "loss.png").stat().st_size > 1000
    ck = load_checkpoint(out / "ckpt.pt")
    assert ck["step"] == 8 and ck["config"]["model"]["vocab_size"] == s["config"].model.vocab_size
    assert msample.main(["--ckpt", str(out / "ckpt.pt"), "--prompt", "The king", "--max_new_tokens", "15",
                         "--num_samples", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("The king") == 2
    if not torch.cuda.is_available():  # CUDA graphs need CUDA: a clear refusal (minite/decoding.py)
        assert msample.main(["--ckpt", str(out / "ckpt.pt"), "--compile", "reduce-overhead"]) == 2
        assert "is for a GPU; the model is on cpu" in capsys.readouterr().err


def test_end_of_run_sample_runs_in_eval_mode(run_cfg, monkeypatch):
    # It ran in training mode: dropout on, and a MoE's capacity limit cut the sample's routing.
    from minite.models.gpt import GPT
    seen, generate = [], GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda self, *a, **k: seen.append(self.training) or generate(self, *a, **k))
    train(run_cfg(**{"train.sample_tokens": 5, "train.max_iters": 2}))
    assert seen == [False]


class Interrupt(Exception):
    pass


def test_resume_reproduces_the_uninterrupted_run_exactly(run_cfg, tmp_path):
    over = {"model.dropout": 0.1}  # dropout draws from torch's RNG: its state must be restored too
    full = train(run_cfg(**over, **{"train.out_dir": str(tmp_path / "full")}))

    def crash(step, loss):
        if step == 6:  # two steps past the checkpoint at step 4: those are lost and redone
            raise Interrupt
    cfg = run_cfg(**over, **{"train.out_dir": str(tmp_path / "cut")})
    with pytest.raises(Interrupt):
        train(cfg, callback=crash)
    assert load_checkpoint(tmp_path / "cut" / "ckpt.pt")["step"] == 4
    resumed = train(cfg, resume=True, resume_overrides={"train.out_dir": str(tmp_path / "cut")})
    assert sorted(resumed["losses"]) == list(range(5, 13))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], (step, loss, full["losses"][step])  # bit-for-bit
    assert resumed["val_loss"] == full["val_loss"]
    a, b = load_checkpoint(tmp_path / "full" / "ckpt.pt"), load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    rows = [json.loads(r) for r in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))  # no duplicated lines from steps 5-6
    # elapsed_s carries across the resume: it keeps counting from the checkpoint's time instead of restarting
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and b["elapsed_s"] >= elapsed[0] > 0


def test_resume_refuses_model_changes_and_missing_checkpoint(run_cfg, tmp_path):
    cfg = run_cfg(**{"train.max_iters": 4})
    with pytest.raises(CheckpointError, match="checkpoint not found: .*ckpt.pt"):
        train(cfg, resume=True)
    train(cfg)
    with pytest.raises(ConfigError, match=r"cannot change model fields .*\(n_layer: 1 in the checkpoint, 2 requested"):
        train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "model.n_layer": "2"})


def test_resume_refuses_data_with_another_vocab(run_cfg, tmp_path, make_corpus):
    # Another character set with the same padded vocabulary (64) would load fine and silently train with the
    # wrong tokenizer: the resume must compare the data's tokenizer with the checkpoint's.
    make_corpus(tmp_path / "other.txt", n_chars=6000, marks=".,;!?")
    cfg = run_cfg(**{"train.max_iters": 4})
    train(cfg)
    over = {"train.out_dir": cfg.train.out_dir, "data.path": str(tmp_path / "other.txt")}
    with pytest.raises(ConfigError, match=r"checkpoint .*ckpt.pt was trained with a char vocab of \d+ symbols from "
                       r".*corpus.txt; --data .*other.txt has a different vocab \(\d+ symbols\); resume with the "
                       r"same data or start a new --out_dir"):
        train(cfg, resume=True, resume_overrides=over)
    assert load_checkpoint(tmp_path / "out" / "ckpt.pt")["step"] == 4  # nothing was overwritten
    s = train(cfg, resume=True, resume_overrides={"train.out_dir": cfg.train.out_dir, "train.max_iters": "5"})
    assert s["steps"] == 5  # the same data resumes fine


# ------------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    good = {"model": {"w": torch.ones(3)}, "optimizer": {}, "config": {}, "step": 1}
    save_checkpoint(path, good)
    real_save = torch.save

    def dying_save(obj, f, *a, **k):  # writes part of the new checkpoint, then the process "dies"
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("killed mid-write")
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="killed mid-write"):
        save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "optimizer": {}, "config": {}, "step": 2})
    monkeypatch.setattr(torch, "save", real_save)
    ck = load_checkpoint(path)  # the previous checkpoint is intact
    assert ck["step"] == 1 and torch.equal(ck["model"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # the temp file was cleaned up


def test_corrupt_or_truncated_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"model": {"w": torch.randn(1000)}, "optimizer": {}, "config": {}, "step": 3})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"checkpoint .*ckpt.pt is corrupt or truncated"):
        load_checkpoint(path)
    torch.save({"weights": 1}, path)
    with pytest.raises(CheckpointError, match="not a minite.train checkpoint"):
        load_checkpoint(path)
    assert msample.main(["--ckpt", str(path)]) == 2


# ------------------------------------------------------------------------------------------------ precisions
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_reduced_precision_trains(run_cfg, precision):
    s = train(run_cfg(**{"train.precision": precision, "train.max_iters": 4, "train.eval_interval": 4}))
    losses = list(s["losses"].values())
    assert all(torch.isfinite(torch.tensor(losses))) and s["val_loss"] < 4.0, losses


def test_pick_threads_leaves_the_rng_alone(run_cfg):
    from minite.models.gpt import GPT, GPTConfig
    cfg = run_cfg()
    model = GPT(GPTConfig(**{**cfg.model.to_dict(), "vocab_size": 40}))
    state = torch.get_rng_state()
    n = pick_threads(model, cfg.train.batch_size, 16)
    assert n >= 1 and torch.equal(state, torch.get_rng_state())  # timing must not change the run


@pytest.mark.parametrize("slow", [1, 2])
def test_sample_picks_its_threads_like_train(run_cfg, monkeypatch, capsys, slow):
    # was (issue 26): minite.sample always ran one thread (train times all cores against one). Here two cores and
    # a clock on which decoding is slow under `slow` threads: the CLI must time both and keep the other.
    import types

    from minite import resources
    from minite.models.gpt import GPT
    cfg = run_cfg(**{"train.max_iters": 1, "train.eval_interval": 1})
    train(cfg)
    ckpt = str(Path(cfg.train.out_dir) / "ckpt.pt")
    monkeypatch.setenv("MINITE_BACKEND", "torch")  # the checkpoint samples with backend auto: not interpreted here
    monkeypatch.setattr(resources, "_cores", lambda: 2)
    clock, real, calls = [0.0], GPT.generate, []
    monkeypatch.setattr(resources, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def generate(self, *a, **k):
        calls.append(torch.get_num_threads())
        clock[0] += 1.0 if torch.get_num_threads() == slow else 0.1
        return real(self, *a, **k)
    monkeypatch.setattr(GPT, "generate", generate)
    # --device cpu: threads are a CPU's (on a CUDA machine the default device is the GPU, where nothing is timed)
    assert msample.main(["--ckpt", ckpt, "--max_new_tokens", "3", "--device", "cpu"]) == 0
    assert sorted(set(calls)) == [1, 2] and torch.get_num_threads() == 3 - slow  # timed both, kept the faster
    assert calls[-1] == 3 - slow  # and sampled with it
    calls.clear()
    assert msample.main(["--ckpt", ckpt, "--max_new_tokens", "3", "--threads", "3", "--device", "cpu"]) == 0
    assert calls == [3] and torch.get_num_threads() == 3  # told: no timing
    with pytest.raises(SystemExit):
        msample.main(["--ckpt", ckpt, "--threads", "-1"])
    assert "--threads=-1: must be >= 0" in capsys.readouterr().err


def test_pick_decode_threads_leaves_the_rng_alone(run_cfg):
    from minite.models.gpt import GPT, GPTConfig
    from minite.resources import pick_decode_threads
    model = GPT(GPTConfig(**{**run_cfg().model.to_dict(), "vocab_size": 40, "dropout": 0.1}))  # train mode: dropout
    state = torch.get_rng_state()
    assert pick_decode_threads(model, 2, 5, new_tokens=2) >= 1 and torch.equal(state, torch.get_rng_state())


def test_pick_decode_threads_does_not_time_the_triton_interpreter(run_cfg, monkeypatch):
    # an interpreted sample took 11 s on 1 thread and 137 s with the 2-thread probe: there it is 1, untimed
    from minite import resources
    from minite._triton import interpreting
    from minite.backend import resolve_backend
    from minite.models.gpt import GPT, GPTConfig
    if not interpreting():  # a CUDA machine (tests/conftest.py sets TRITON_INTERPRET=1 only without one): the
        # interpreter is chosen at import, so play it: interpreting, and Triton for an auto/triton model on the CPU
        monkeypatch.setattr(resources, "interpreting", lambda: True)
        monkeypatch.setattr(resources, "resolve_backend",
                            lambda x, backend=None: "torch" if backend == "torch" else "triton")
    assert resources.interpreting() and resources.resolve_backend(torch.zeros(1), "auto") == "triton"
    assert resolve_backend(torch.zeros(1), "torch") == "torch"
    monkeypatch.setattr(resources, "_cores", lambda: 2)
    model = GPT(GPTConfig(**{**run_cfg().model.to_dict(), "vocab_size": 40, "backend": "auto"}))

    def timed(*a, **k):
        raise Interrupt("timed")
    monkeypatch.setattr(model, "generate", timed)
    assert resources.pick_decode_threads(model, 2, 5) == 1
    with pytest.raises(Interrupt, match="timed"):  # the torch backend is timed
        model.backend = "torch"
        resources.pick_decode_threads(model, 2, 5)


# ------------------------------------------------------------------------------------------ runs never clobber
def test_a_new_run_refuses_an_out_dir_holding_another_run(run_cfg, capsys):
    # was (issue 26): a quick --train.max_iters 10 silently replaced a 1500-step out/ckpt.pt
    cfg = run_cfg(**{"train.max_iters": 4})
    train(cfg)
    ckpt = Path(cfg.train.out_dir) / "ckpt.pt"
    before = ckpt.read_bytes()
    with pytest.raises(ConfigError, match=r"ckpt.pt holds another run's checkpoint; continue it with --resume, "
                                          r"start this run in another --out_dir, or replace it with "
                                          r"--train.overwrite=True"):
        train(run_cfg(**{"train.max_iters": 2}))
    assert ckpt.read_bytes() == before
    s = train(run_cfg(**{"train.max_iters": 2, "train.overwrite": True}))
    assert s["steps"] == 2 and load_checkpoint(ckpt)["step"] == 2


def test_the_best_checkpoint_is_kept_beside_the_last(run_cfg):
    cfg = run_cfg(**{"train.max_iters": 12, "train.eval_interval": 4})
    s = train(cfg)
    out = Path(cfg.train.out_dir)
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r and r["step"] > 0}
    best_step = min(vals, key=vals.get)
    best = load_checkpoint(out / "ckpt_best.pt")
    assert best["step"] == best_step and best["best_val"] == pytest.approx(vals[best_step], abs=1e-6)
    assert s["best_val_loss"] == pytest.approx(min(vals.values()), abs=1e-6)
    model, tok = msample.load_model(str(out / "ckpt_best.pt"))
    assert torch.equal(model.state_dict()["wte.weight"], best["model"]["wte.weight"])


# ------------------------------------------------------------------------------------------------ TensorBoard
def _scalars(out: Path) -> dict:
    """{tag: [(step, value), ...]} read back from out's event files by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(out))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_tensorboard_writes_the_logged_scalars(run_cfg, tmp_path):
    over = {"train.tensorboard": True, "train.max_iters": 8, "train.eval_interval": 4, "train.log_interval": 1}
    s = train(run_cfg(**over))
    out = tmp_path / "out"
    sc = _scalars(out)
    # issue 37: tags grouped as torchtitan's (train/..., val/..., perf/...), not flat
    assert {"train/loss", "val/loss", "train/lr", "perf/tokens_per_s", "train/grad_norm"} <= set(sc), set(sc)
    assert [st for st, _ in sc["train/loss"]] == list(range(1, 9))
    for st, v in sc["train/loss"]:
        assert v == pytest.approx(s["losses"][st], rel=1e-6, abs=1e-6), st  # fp32 events of the rounded loss
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    assert sc["val/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in rows if "val_loss" in r]
    assert [st for st, _ in sc["val/loss"]] == [0, 4, 8]
    assert all(v > 0 for _, v in sc["train/grad_norm"]) and len(sc["train/grad_norm"]) == 8
    assert sc["train/lr"][0][1] == pytest.approx(rows[1]["lr"], rel=1e-6)
    # a resumed run drops the events after its checkpoint: each step once, as in the uninterrupted run
    cut = run_cfg(**over, **{"train.out_dir": str(tmp_path / "cut")})

    def crash(step, loss):
        if step == 6:
            raise Interrupt
    with pytest.raises(Interrupt):
        train(cut, callback=crash)
    train(cut, resume=True, resume_overrides={"train.out_dir": str(tmp_path / "cut")})
    again = _scalars(tmp_path / "cut")
    assert [st for st, _ in again["train/loss"]] == list(range(1, 9))
    assert [v for _, v in again["train/loss"]] == [v for _, v in sc["train/loss"]]
    assert [st for st, _ in again["val/loss"]] == [0, 4, 8]
    # a new run replacing this one (--train.overwrite) starts its events anew
    train(run_cfg(**{**over, "train.max_iters": 2, "train.overwrite": True}))
    assert [st for st, _ in _scalars(out)["train/loss"]] == [1, 2]


def test_tensorboard_measures_the_grad_norm_without_clipping(run_cfg, tmp_path):
    # grad_clip=0: the norm is measured with max_norm=inf, which must leave the run bit for bit as it was
    over = {"train.grad_clip": 0.0, "train.max_iters": 4, "train.eval_interval": 4, "train.log_interval": 1}
    plain = train(run_cfg(**over, **{"train.out_dir": str(tmp_path / "plain")}))
    tb = train(run_cfg(**over, **{"train.out_dir": str(tmp_path / "tb"), "train.tensorboard": True}))
    assert tb["losses"] == plain["losses"]
    norms = _scalars(tmp_path / "tb")["train/grad_norm"]
    assert [st for st, _ in norms] == [1, 2, 3, 4] and all(v > 0.1 for _, v in norms)
    assert "grad_norm" not in json.loads((tmp_path / "plain" / "log.jsonl").read_text().splitlines()[1])


def test_tensorboard_missing_is_a_clear_error(run_cfg, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ConfigError, match=r"--train.tensorboard=True needs the tensorboard package, which is not "
                                          r"installed here: pip install tensorboard \(or pip install 'minite\[tb\]'\)"):
        train(run_cfg(**{"train.tensorboard": True}))
    assert not (tmp_path / "out").exists()  # refused before anything was written


# ------------------------------------------------------------------------- compiling: regional, said, timed apart
def _counting_backend():
    """(backend, seen): an aot_eager-like torch.compile backend that counts the graphs Dynamo hands it (seen["dynamo"]),
    the forward and backward graphs AOTAutograd makes of them (seen["fw"], seen["bw"]) and the calls of every
    compiled forward (seen["calls"])."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    seen = {"dynamo": 0, "fw": 0, "bw": 0, "calls": 0}

    def compiler(kind):
        def build(gm, example_inputs):
            seen[kind] += 1

            def run(*args):
                seen["calls"] += kind == "fw"
                return gm(*args)
            return make_boxed_func(run)
        return build
    aot = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))

    def backend(gm, example_inputs):
        seen["dynamo"] += 1
        return aot(gm, example_inputs)
    return backend, seen


def test_regional_compile_builds_one_block_graph_that_every_block_runs():
    import torch._dynamo
    from torch._dynamo.utils import counters

    from minite.compile import compile_regions
    from minite.models.gpt import GPT, GPTConfig
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=3, n_head=2, n_embd=16, backend="torch")
    eager, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(eager.state_dict())
    backend, seen = _counting_backend()
    frames = counters["frames"]["ok"]
    assert compile_regions(model, backend=backend) == 3  # a region per block
    assert set(model.state_dict()) == set(eager.state_dict())  # in place: checkpoints keep their keys
    x = torch.randint(0, 40, (2, 8))
    for _ in range(2):  # the second step recompiles nothing
        for m in (eager, model):
            m.zero_grad()
            m(x, x)[1].backward()
    assert (seen["dynamo"], seen["fw"], seen["bw"]) == (1, 1, 1)  # one block traced, one graph each way ...
    assert counters["frames"]["ok"] - frames == 1
    assert seen["calls"] == 2 * 3  # ... that all 3 blocks ran, at each of the 2 steps (the whole model: 2 calls)
    assert torch.allclose(model(x, x)[1], eager(x, x)[1], atol=1e-6)  # the same model
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    model.eval()
    with torch.no_grad():
        model(x, x)
    assert seen["dynamo"] == 2  # evaluation: one more graph (no grad, no dropout), again for every block


def test_a_model_without_blocks_is_compiled_whole():
    from minite.compile import compile_regions
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    backend, seen = _counting_backend()
    net = Net()
    assert compile_regions(net, backend=backend) == 1
    net(torch.randn(2, 4)).sum().backward()
    assert (seen["dynamo"], seen["fw"], seen["bw"], seen["calls"]) == (1, 1, 1, 1)


def _main_argv(tiny_run, tmp_path, make_corpus, **over):
    make_corpus(tmp_path / "corpus.txt", n_chars=6000, marks=".")
    o = {**tiny_run, "data.path": tmp_path / "corpus.txt", "data.data_dir": tmp_path / "data",
         "train.out_dir": tmp_path / "out", "model.n_layer": 2, "train.max_iters": 5, "train.eval_interval": 5,
         **over}
    return ["--preset", "cpu", *(f"--{k}={v}" for k, v in o.items())]


def test_a_compiled_run_says_it_compiles_and_reports_compile_time_and_steady_rate_apart(
        tiny_run, tmp_path, make_corpus, monkeypatch, capsys):
    import torch._dynamo

    import minite.compile as mc
    torch._dynamo.reset()
    monkeypatch.setattr(mc, "resolve_compile", lambda *a: "default")  # the CPU's interpreter resolves it to off
    monkeypatch.setattr(mc, "BACKEND", "eager")  # Dynamo's graphs, run as traced: no C++ build in the suite
    assert main(_main_argv(tiny_run, tmp_path, make_corpus, **{"train.compile": "default"})) == 0
    out = capsys.readouterr().out
    said = out.index("minite.train: compiling (torch.compile default, one graph for all 2 blocks): the first "
                     "evaluation and step wait for")
    done = re.search(r"minite.train: compiled in (\d+\.\d) s \((\d+) graphs\); first step done (\d+\.\d) s after "
                     r"the start", out)
    assert done and said < done.start()
    assert int(done[2]) == 2  # the evaluation's graph and the training step's
    closing = re.search(r"val loss \d\.\d{4} \(best \d\.\d{4}\) after 5 steps \| (\d+\.\d) s wall, first step at "
                        r"(\d+\.\d) s \| compile (\d+\.\d) s \(2 graphs, default\) \| ([\d,]+) tokens/s steady "
                        r"\((\d+) steps, (\d+\.\d) s\)", out)
    assert closing, out
    wall, first, comp, rate, steady, steady_s = closing.groups()
    assert int(steady) == 4  # step 1 compiled; steps 2-5 are the steady state
    assert float(comp) <= float(first) <= float(wall) and float(steady_s) <= float(wall)
    assert (comp, first) == (done[1], done[3])
    assert int(rate.replace(",", "")) > 0


def test_an_uncompiled_run_counts_every_step_as_steady_and_its_bar_updates(tiny_run, tmp_path, make_corpus,
                                                                           capsys):
    assert main(_main_argv(tiny_run, tmp_path, make_corpus, **{"train.progress": True})) == 0
    cap = capsys.readouterr()
    assert "compiling" not in cap.out + cap.err
    assert re.search(r"first step at \d+\.\d s \| compile off \| [\d,]+ tokens/s steady \(5 steps, \d+\.\d s\)",
                     cap.out), cap.out
    assert "5/5" in cap.err  # the bar reached the end


def test_the_bar_says_compiling_and_its_clock_ticks_until_the_first_step():
    import threading

    from minite.compile import CompileClock
    events = []
    ticked = threading.Event()

    class Bar:
        def set_description_str(self, s):
            events.append(("desc", s))

        def refresh(self):
            events.append("refresh")
            ticked.set()

        def write(self, msg):
            events.append(("write", msg))
    clock = CompileClock()
    clock.tick_s = 0.01
    clock.start("reduce-overhead", 6, Bar())
    assert events[:2] == [("write", events[0][1]), ("desc", "compiling")]
    assert "one graph for all 6 blocks" in events[0][1]
    assert ticked.wait(30)  # the clock moves while the main thread is busy compiling
    with clock.timed(steps=1):
        pass
    clock.first_step(t0=0.0)
    n = len(events)
    assert ("desc", "") in events and events[-1][0] == "write" and "compiled in 0.0 s (0 graphs)" in events[-1][1]
    ticked.clear()
    assert not ticked.wait(0.1) and len(events) == n  # stopped: no refresh after the first step
    assert clock.steady_steps == 1 and clock.rate(100, 1, 1.0) > 0


def test_help_shows_the_presets_values_and_a_bare_flag_gets_its_full_name(capsys):
    # issue 37: --help printed the field defaults (max_iters 2000) where the cpu preset runs 1500; a bare --compile
    # got no hint
    from minite.train import main
    assert main(["--preset", "cpu", "--help"]) == 0
    out = capsys.readouterr().out
    assert "as the cpu preset sets them" in out and "--train.max_iters=1500" in out and "field default 2000" in out
    assert main(["--preset=gpu", "--help"]) == 0
    assert "--train.max_iters=1000" in capsys.readouterr().out
    assert main(["--compile"]) == 2
    assert "--compile needs a value (did you mean --train.compile=...?)" in capsys.readouterr().err


def test_the_first_lines_name_what_changes_the_math_or_the_speed(run_cfg, tmp_path, capsys):
    # issue 37: MoE, the FP8 recipe (emulated on a CPU), recompute and TensorBoard's folder were not said
    from minite.train import tb_tag
    assert [tb_tag(k) for k in ("loss", "val_loss", "lr", "moe_dropped", "tokens_per_s")] == \
        ["train/loss", "val/loss", "train/lr", "moe/dropped", "perf/tokens_per_s"]
    train(run_cfg(**{"train.max_iters": 1, "train.eval_interval": 1, "train.sample_tokens": 0}))
    assert capsys.readouterr().out.count("minite.train: ") == 1  # a plain run: one line
    train(run_cfg(**{"train.max_iters": 1, "train.eval_interval": 1, "train.sample_tokens": 0,
                     "train.out_dir": str(tmp_path / "moe"), "model.moe_num_experts": 4, "model.moe_top_k": 2,
                     "train.precision": "fp8", "train.fp8_recipe": "current",
                     "train.tensorboard": True}))
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("minite.train: ")][1]
    for words in ("MoE 4 experts, top-2, balance aux", "fp8 recipe current", "emulated on cpu",
                  f"TensorBoard in {tmp_path / 'moe'}"):
        assert words in line, line


# ------------------------------------------------------------------------------------------ thread picking: cost
def _fake_clock(monkeypatch):
    """resources' perf_counter replaced by a clock that only work() advances: no real work is timed."""
    import types

    from minite import resources
    clock = [0.0]
    monkeypatch.setattr(resources, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(resources, "_cores", lambda: 2)
    return clock


@pytest.mark.parametrize("step_s", [0.05, 0.4, 10.0])
def test_thread_picking_stays_within_its_budget(monkeypatch, step_s):
    # was (issue 37): ~27 s of silence before the first line on 2 busy cores. A step of step_s seconds under 2
    # threads and 1/4 of that under 1: the picker must keep 1, and spend at most its budget plus one step of each
    # count (when steps are longer than the budget: 2 one-thread steps, one warm-up and one timed, and 1 step of 2).
    from minite import resources
    clock, steps = _fake_clock(monkeypatch), []

    def make_work():
        def work():
            steps.append(torch.get_num_threads())
            clock[0] += step_s if torch.get_num_threads() == 2 else step_s / 4
        return work
    assert resources._fastest(make_work, budget_s=3.0) == 1
    assert sorted(set(steps)) == [1, 2]
    assert clock[0] <= max(3.0, 2 * step_s / 4) + step_s, (clock[0], steps)
    if step_s == 10.0:
        assert steps == [1, 1, 2]
    assert len(steps) <= 2 * (2 + 3)  # never more than the old fixed 2 warm-up + 3 timed steps per count


def test_pick_threads_caches_per_machine_and_model_size(monkeypatch, tmp_path):
    from minite import resources
    from minite.models.gpt import GPT, GPTConfig
    monkeypatch.setenv("MINITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(resources, "_cores", lambda: 2)
    monkeypatch.setattr(resources, "_load", lambda: 0.5)  # a quiet machine: timed
    timed = []
    monkeypatch.setattr(resources, "_fastest", lambda make_work, **kw: timed.append(kw) or 1)  # no real timing
    model = GPT(GPTConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=16, block_size=16, backend="torch"))
    assert resources.pick_threads(model, 4, 16) == 1 and len(timed) == 1
    assert resources.last_pick.startswith("picked in ") and timed[0]["budget_s"] == resources.THREAD_BUDGET_S
    assert resources.cache_file() == tmp_path / "threads.json" and resources.cache_file().exists()
    assert resources.pick_threads(model, 4, 16) == 1 and len(timed) == 1 and resources.last_pick == "cached"
    resources.pick_threads(model, 8, 16)  # another batch: timed again
    bigger = GPT(GPTConfig(vocab_size=40, n_layer=2, n_head=2, n_embd=16, block_size=16, backend="torch"))
    resources.pick_threads(bigger, 4, 16)  # another model size: timed again
    assert len(timed) == 3
    entries = json.loads(resources.cache_file().read_text())
    assert len(entries) == 3 and all("cores=2|" in k for k in entries)
    for e in entries.values():  # older than a day: timed again
        e["at"] -= resources.CACHE_MAX_AGE_S + 1
    resources.cache_file().write_text(json.dumps(entries))
    resources.pick_threads(model, 4, 16)
    assert len(timed) == 4 and resources.last_pick.startswith("picked in ")
    resources.cache_file().write_text("{not json")  # a corrupt cache is timed again, not an error
    resources.pick_threads(model, 4, 16)
    assert len(timed) == 5
    assert resources.pick_threads(model, 4, 16, cache=False) == 1 and len(timed) == 6
    monkeypatch.setattr(resources, "_load", lambda: 3.2)  # busy: more runnable processes than cores: 1, untimed
    assert resources.pick_threads(model, 4, 16, cache=False) == 1 and len(timed) == 6
    assert resources.last_pick == "load 3.2 on 2 cores, not timed"


def test_the_first_line_says_how_threads_were_picked(run_cfg, monkeypatch, tmp_path, capsys):
    from minite import resources
    monkeypatch.setenv("MINITE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(resources, "_cores", lambda: 2)
    monkeypatch.setattr(resources, "_load", lambda: 0.5)
    monkeypatch.setattr(resources, "_fastest", lambda make_work, **kw: 1)
    for out, note in (("a", "picked in 0.0 s"), ("b", "cached")):
        train(run_cfg(**{"train.threads": 0, "train.max_iters": 1, "train.eval_interval": 1,
                         "train.out_dir": str(tmp_path / out)}))
        first = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("minite.train:"))
        assert f"threads 1 ({note})," in first, first
    train(run_cfg(**{"train.threads": 1, "train.max_iters": 1, "train.eval_interval": 1,
                     "train.out_dir": str(tmp_path / "c")}))
    first = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("minite.train:"))
    assert "threads 1," in first  # told: nothing picked, nothing said
