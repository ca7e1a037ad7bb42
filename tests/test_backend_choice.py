"""backend="auto" on a GPU follows the recorded benchmarks (minite/choices.py), checked on the CPU with a fake GPU."""
import json
import types

import pytest
import torch

from minite import backend, choices
from minite.backend import resolve_backend, use_backend
from tools import derive_choices

RATIO = {"peer": "SDPA", "best": "sdpa flash", "ratio": 0.5, "points": 2, "winner": "peer"}
FAKE = {"hopper": {
    "attention": {"file": "attention_x.json", "device": "X", "mode": "fwd+bwd", "peer_path": True,
                  "eager": RATIO, "compile": RATIO},
    "swiglu": {"file": "swiglu_x.json", "device": "X", "mode": "fwd+bwd", "peer_path": True,
               "eager": {"peer": "eager torch", "best": "torch eager", "ratio": 1.6, "points": 3, "winner": "minite"},
               "compile": {"peer": "Inductor", "best": "torch.compile", "ratio": 0.9, "points": 3, "winner": "peer"}},
    "grouped_gemm": {"file": "grouped_gemm_x.json", "device": "X", "mode": "fwd+bwd", "peer_path": False,
                     "eager": dict(RATIO, peer="torch._grouped_mm", winner="minite"), "compile": None}}}


def test_the_shipped_table_is_what_the_committed_results_give():
    derived = derive_choices.derive()
    assert derived == choices.TABLE, "minite/choices.py is stale: run python tools/derive_choices.py"
    assert derive_choices.render(derived) in open(choices.__file__).read()
    att = choices.TABLE["hopper"]["attention"]  # the H200 record: minite's attention loses to SDPA fwd+bwd
    assert att["file"] == "attention_nvidia-h200.json" and att["compile"]["winner"] == "peer"


def test_the_tool_derives_winner_and_ratio_from_the_rows(tmp_path):
    # T=1: minite 2 ms, the best SDPA 1 ms; T=2: both 1 ms; T=3 has no peer row; the fwd row is not a training step
    rows = [{"impl": i, "T": t, "mode": "fwd+bwd", "ms": ms} for t, i, ms in
            [(1, "minite triton", 2.0), (1, "sdpa flash", 1.0), (1, "sdpa cudnn", 1.5), (2, "minite triton", 1.0),
             (2, "sdpa cudnn", 1.0), (3, "minite triton", 9.0)]] + [{"impl": "sdpa flash", "T": 1, "mode": "fwd",
                                                                     "ms": 0.01}]
    (tmp_path / "attention_nvidia-h200.json").write_text(json.dumps({"device": "NVIDIA H200", "results": rows}))
    e = derive_choices.derive(tmp_path)["hopper"]["attention"]  # geometric mean of 0.5 and 1
    assert e["eager"] == {"peer": "SDPA", "best": "sdpa cudnn", "ratio": 0.71, "points": 2, "winner": "peer"}
    assert e["file"] == "attention_nvidia-h200.json" and e["mode"] == "fwd+bwd"
    rows[0]["ms"] = 1.0  # minite as fast as the peer at every point: minite's
    (tmp_path / "attention_nvidia-h200.json").write_text(json.dumps({"device": "NVIDIA H200", "results": rows}))
    assert derive_choices.derive(tmp_path)["hopper"]["attention"]["compile"]["winner"] == "minite"


def test_family_by_name_or_capability():
    assert choices.family("NVIDIA H100 80GB HBM3") == choices.family("nvidia-h200") == "hopper"
    assert choices.family("NVIDIA A100-SXM4-80GB") == "ampere"
    assert choices.family("Some New GPU") is None
    assert choices.family("Some New GPU", (9, 0)) == choices.family("NVIDIA A100", (9, 0)) == "hopper"  # exact


def test_choose_follows_the_table_per_regime():
    assert choices.choose("attention", "NVIDIA H100 PCIe", table=FAKE) == \
        ("peer", "minite 0.50x SDPA, attention_x.json")
    assert choices.choose("swiglu", "NVIDIA H200", table=FAKE)[0] == "minite"  # eagerly the peer is unfused
    assert choices.choose("swiglu", "NVIDIA H200", compiling=True, table=FAKE)[0] == "peer"  # Inductor's fusion
    who, why = choices.choose("grouped_gemm", "NVIDIA H200", table=FAKE)  # slower, but torch runs an fp32 spec
    assert who == "minite" and "fp32 spec" in why
    assert choices.choose("rmsnorm", "NVIDIA H200", table=FAKE) == \
        ("minite", "no recorded benchmark of rmsnorm for NVIDIA H200")
    assert choices.choose("attention", "NVIDIA L4", table=FAKE)[0] == "minite"  # no record for the family


def test_start_line_says_who_runs_each_op_and_why(tiny_gpt):
    ops = choices.model_ops(tiny_gpt, compiled=True)
    assert ops == [("attention", True), ("rmsnorm", True), ("swiglu", True), ("cross_entropy", False)]
    line = choices.start_line("NVIDIA H200", ops, table=FAKE)
    assert line.startswith("kernels on NVIDIA H200 (hopper record, backend=auto): SDPA runs attention (minite 0.50x "
                           "SDPA, attention_x.json); Inductor runs swiglu (minite 0.90x Inductor, swiglu_x.json); "
                           "minite runs rmsnorm (no recorded benchmark of rmsnorm for NVIDIA H200), cross_entropy")
    assert choices.start_line("NVIDIA L4", ops, table=FAKE) == \
        "kernels: minite everywhere (backend=auto): no recorded benchmark for NVIDIA L4"
    assert choices.start_line("NVIDIA H200", ops, requested="triton", table=FAKE) == \
        "kernels: minite everywhere (backend=triton)"


@pytest.fixture
def tiny_gpt():
    from minite.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8))


@pytest.fixture
def fake_gpu(monkeypatch):
    """resolve_backend sees a CUDA tensor on an "NVIDIA H200" whose Triton can run; the table is FAKE."""
    monkeypatch.setattr(backend, "triton_available_for", lambda x: (True, ""))
    monkeypatch.setattr(choices, "TABLE", FAKE)
    monkeypatch.setattr(choices, "_DECIDED", {})
    monkeypatch.setattr(choices, "KERNELS_ONLY", False)  # the suite runs with MINITE_AUTO=kernels (conftest)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.delenv("MINITE_BACKEND", raising=False)
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def test_auto_on_a_gpu_follows_the_table_and_triton_forces_minite(fake_gpu):
    x = fake_gpu
    assert resolve_backend(x, op="attention") == "torch"  # SDPA
    assert resolve_backend(x, "auto", op="swiglu") == "triton"  # eagerly
    assert resolve_backend(x, op="grouped_gemm") == resolve_backend(x) == "triton"  # no peer path; no op named
    assert resolve_backend(x, "triton", op="attention") == "triton"  # --model.backend=triton
    with use_backend("triton"):
        assert resolve_backend(x, op="attention") == "triton"
    assert resolve_backend(x, "torch", op="rmsnorm") == "torch"


def test_minite_auto_kernels_turns_the_table_off(fake_gpu, monkeypatch, tiny_gpt):
    # MINITE_AUTO=kernels (the suite's setting, so GPU tests test minite's kernels): auto runs them everywhere
    monkeypatch.setattr(choices, "KERNELS_ONLY", True)
    assert resolve_backend(fake_gpu, op="attention") == "triton"
    assert "MINITE_AUTO=kernels" in choices.run_line(tiny_gpt, torch.device("cuda", 0), compiled=False)
    monkeypatch.setattr(choices, "KERNELS_ONLY", False)
    assert resolve_backend(fake_gpu, op="attention") == "torch"


def test_auto_under_torch_compile_takes_inductors_fusion(fake_gpu):
    # Dynamo traces the choice (the device's name a constant): fullgraph, so any graph break fails the test
    def f(t):
        return t + 1 if resolve_backend(fake_gpu, op="swiglu") == "torch" else t - 1
    assert f(torch.zeros(1)).item() == -1  # eagerly: minite
    assert torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 1  # compiled: Inductor


def test_auto_on_the_cpu_ignores_the_table():
    x = torch.zeros(2)
    assert resolve_backend(x, op="attention") == resolve_backend(x)
    assert resolve_backend(x, op="swiglu") == resolve_backend(x)


def test_the_training_runs_line_only_under_auto_on_a_gpu(fake_gpu, tiny_gpt):
    gpu = torch.device("cuda", 0)
    line = choices.run_line(tiny_gpt, gpu, compiled=True)
    assert line.startswith("kernels on NVIDIA H200 (hopper record, backend=auto): SDPA runs attention"), line
    assert choices.run_line(tiny_gpt, gpu, compiled=True, context="triton") is None  # use_backend / $MINITE_BACKEND
    assert choices.run_line(tiny_gpt, torch.device("cpu"), compiled=False) is None  # the CPU's lines are unchanged
    tiny_gpt.config.backend = "triton"  # --model.backend=triton: minite's kernels, as asked; nothing to explain
    assert choices.run_line(tiny_gpt, gpu, compiled=True) is None
