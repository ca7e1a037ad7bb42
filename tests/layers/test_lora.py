"""LoRA (chapter 09): the fused kernel against the reference, the PEFT-shaped API, adapters on disk, the CLI."""
import math

import pytest
import torch
import torch.nn.functional as F

from minite.formats import DelayedScaling, Format, fp8_autocast
from minite.kernels.lora import GPU_TILES, GPU_TILES_F32, LoRALinearFunction, lora_linear, lora_linear_ref, lora_tiles
from minite.layers.linear import Linear, fp8_linear
from minite.layers.lora import (
    LoRAConfig,
    LoRAError,
    LoRALinear,
    apply_lora,
    load_lora,
    lora_layers,
    lora_state_dict,
    merge_lora,
    print_trainable_parameters,
    save_lora,
    unmerge_lora,
)
from minite.models.gpt import GPT, GPTConfig
from minite.testing import assert_close, dtype_tols

pytestmark = pytest.mark.usefixtures("one_thread")


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32, device="cpu"):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(device=device, dtype=dtype)


def tiny_gpt(device="cpu", seed=0, **over):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, backend="torch")
    return GPT(GPTConfig(**{**cfg, **over})).to(device)


# --------------------------------------------------------------------------------------------- the kernel
def _operands(N, K, O, r, dtype, device, seed=0):
    return (rand(N, K, seed=seed, dtype=dtype, device=device), rand(O, K, seed=seed + 1, scale=0.2, dtype=dtype,
            device=device), rand(r, K, seed=seed + 2, scale=0.2, dtype=dtype, device=device),
            rand(O, r, seed=seed + 3, scale=0.2, dtype=dtype, device=device),
            rand(N, O, seed=seed + 4, dtype=dtype, device=device))


def _compare(x, W, A, B, dy, s, blocks=None):
    """Fused forward + backward vs autograd of the fp32 reference: y, dx, dA, dB (W frozen: no dW)."""
    got = [t.clone().requires_grad_(True) for t in (x, A, B)]
    y = LoRALinearFunction.apply(got[0], W, got[1], got[2], s, blocks)
    y.backward(dy)
    ref = [t.clone().requires_grad_(True) for t in (x, A, B)]
    y_ref = lora_linear_ref(ref[0], W, ref[1], ref[2], s)
    y_ref.backward(dy)
    tol = dtype_tols(x.dtype)
    # Each entry is a sum of K (or N) products whose terms are far larger than a cancelled result: the rounding
    # error scales with the tensor's magnitude, so atol is the dtype's tolerance relative to max|reference|.
    for name, a, b in (("y", y, y_ref), *zip(("dx", "dA", "dB"), (t.grad for t in got), (t.grad for t in ref))):
        big = b.abs().max().item() if b.numel() else 0.0
        assert_close(a, b, name=name, atol=tol["atol"] + tol["rtol"] * big, rtol=tol["rtol"])
    assert W.grad is None


@pytest.mark.triton
@pytest.mark.parametrize("r", [1, 4, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernel_matches_reference(device, r, dtype):
    # odd shapes: N, K, O not multiples of any tile; one tile per program on the CPU (fast)
    _compare(*_operands(37, 45, 51, r, dtype, device, seed=r), s=16 / r)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty filled with NaN: the kernels must store every element of y, g, dx and the dA / dB partials."""
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


def _small_tiles(splits=None):
    # 16-wide tiles: several programs per axis, K/O/row loops with ragged last steps, the rank padded to >= 16 and
    # (r > 16) looped over in the GEMM's adapter step; `splits` row chunks for dA / dB
    return {"gemm": (16, 16, 16, 2, 4, 1), "down": (16, 16, 4, 1), "wgrad": (16, 16, 4, 1), "sms": 4,
            "splits": splits}


@pytest.mark.triton
@pytest.mark.parametrize("r", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_kernel_small_tiles_and_loops(device, r, splits, nan_empty):
    x, W, A, B, dy = _operands(37, 45, 51, r, torch.float32, device, seed=7)
    _compare(x, W, A, B, dy, s=2.0, blocks=_small_tiles(splits))


@pytest.mark.triton
@pytest.mark.parametrize("r", [3, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_kernel_gpu_tiles(device, monkeypatch, r, dtype, nan_empty):
    # The GPU's own launch configuration (what lora_tiles picks on CUDA, 132 SMs for the row split), run here:
    # 128 x 256 x 64 GEMM tiles in grouped order (fp16), loops over K and O, the dA / dB rows split in chunks.
    from minite.kernels import _common
    monkeypatch.setattr(_common.CAPTURE_GPU, "on", True, raising=False)
    x, W, A, B, dy = _operands(150, 70, 300, r, dtype, device, seed=8)
    t = lora_tiles(x, 150, 70, 300)
    assert t["gemm"] == (GPU_TILES if dtype == torch.float16 else GPU_TILES_F32)["gemm"] and t["sms"] == 132
    _compare(x, W, A, B, dy, s=2.0)


@pytest.mark.triton
@pytest.mark.parametrize("N, K, O", [(0, 20, 30), (3, 16, 0), (4, 0, 6)], ids=["no rows", "no outputs", "no inputs"])
def test_fused_kernel_empty_dims(device, N, K, O, nan_empty):
    # every kernel's grid or loop is empty somewhere: y, dx, dA, dB still come out (zeros where the sum is empty);
    # O = 0 used to fail in the backward's reshape of dy (2, 3, 0) -> (-1, 0)
    x, W, A, B, dy = _operands(N, K, O, 3, torch.float32, device, seed=5)
    _compare(x.view(1, N, K), W, A, B, dy.view(1, N, O), s=2.0)


@pytest.mark.triton
def test_fused_kernel_bf16_interpreter_or_gpu(device):
    # bf16: upcast to fp32 before tl.dot on the interpreter (which cannot multiply bf16), native on a GPU
    _compare(*_operands(19, 33, 40, 8, torch.bfloat16, device, seed=3), s=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [8, 64])
def test_fused_kernel_bf16_gpu_large(device, r):
    x, W, A, B, dy = _operands(1000, 512, 768, r, torch.bfloat16, device, seed=4)
    _compare(x, W, A, B, dy, s=2.0)


@pytest.mark.triton
def test_fused_strided_input_and_batch_dims(device):
    x, W, A, B, _ = _operands(2 * 9, 2 * 24, 30, 4, torch.float32, device)
    x3 = x.view(2, 9, 48)[..., :24]  # (2, 9, 24) with row stride 48
    y = lora_linear(x3, W[:, :24].contiguous(), A[:, :24].contiguous(), B, scaling=0.5, backend="triton")
    assert y.shape == (2, 9, 30)
    assert_close(y, lora_linear_ref(x3, W[:, :24], A[:, :24], B, 0.5), name="strided y")


def test_lora_linear_bad_inputs():
    x = rand(4, 8)
    W = rand(6, 8)
    A = rand(2, 8)
    B = rand(6, 2)
    with pytest.raises(ValueError, match=r"lora_A \(2, 7\) \(r, K\)"):
        lora_linear(x, W, A[:, :7], B)
    with pytest.raises(ValueError, match="share dtype"):
        lora_linear(x, W, A.half(), B)


# ----------------------------------------------------------------------------------------------- the layer
def test_step0_equals_base_and_only_adapters_train():
    model = tiny_gpt()
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    base_logits, _ = model(idx, idx)
    apply_lora(model, LoRAConfig(r=4, alpha=8))
    logits, _ = model(idx, idx)
    assert torch.equal(logits, base_logits)  # B = 0: the adapted model is the base at step 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == 2 * 4 * 2  # qkv, proj, gate_up, down in each of 2 blocks
    m = model.blocks[0].attn.qkv
    assert isinstance(m, LoRALinear) and m.lora_A.shape == (4, 32) and m.lora_B.shape == (m.out_features, 4)
    assert m.lora_A.abs().sum() > 0 and m.lora_B.abs().sum() == 0
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) on fan_in=32
    assert m.lora_A.abs().max() <= bound and m.lora_A.abs().max() > 0.8 * bound
    assert set(model.state_dict()) >= set(tiny_gpt().state_dict())  # the base's keys are unchanged


def test_adapter_grads_match_autograd_of_reference(device):
    torch.manual_seed(0)
    base = Linear(24, 20, bias=True).to(device)
    layer = LoRALinear.from_linear(base, LoRAConfig(r=3, alpha=6), backend="torch")
    with torch.no_grad():
        layer.lora_B.copy_(rand(20, 3, seed=5, device=device))
    x = rand(2, 5, 24, seed=1, device=device)
    dy = rand(2, 5, 20, seed=2, device=device)
    layer(x).backward(dy)
    W, b = base.weight.detach(), base.bias.detach()
    A, B = (layer.lora_A.detach().clone().requires_grad_(True), layer.lora_B.detach().clone().requires_grad_(True))
    (F.linear(x, W, b) + 2.0 * (x @ A.t()) @ B.t()).backward(dy)  # the spec, written out: s = 6 / 3
    assert_close(layer.lora_A.grad, A.grad, name="dA")
    assert_close(layer.lora_B.grad, B.grad, name="dB")
    assert base.weight.grad is None and base.bias.grad is None


@pytest.mark.triton
def test_layer_triton_backend_matches_torch(device):
    torch.manual_seed(0)
    layers = {}
    for be in ("torch", "triton"):
        base = Linear(24, 20, bias=True).to(device)
        with torch.no_grad():
            base.weight.copy_(rand(20, 24, seed=0, scale=0.2, device=device))
            base.bias.copy_(rand(20, seed=1, device=device))
        layers[be] = LoRALinear.from_linear(base, LoRAConfig(r=4), backend=be)
        with torch.no_grad():
            layers[be].lora_A.copy_(rand(4, 24, seed=2, device=device))
            layers[be].lora_B.copy_(rand(20, 4, seed=3, device=device))
    x = rand(7, 24, seed=4, device=device)
    ys = {be: m(x) for be, m in layers.items()}
    assert_close(ys["triton"], ys["torch"], name="y")
    for be in ys:
        ys[be].square().sum().backward()
    for n in ("lora_A", "lora_B"):
        ref = getattr(layers["torch"], n).grad  # sums of 7 large products: tolerance relative to max|ref|
        assert_close(getattr(layers["triton"], n).grad, ref, name=n, atol=1e-5 * ref.abs().max().item())


@pytest.mark.triton
def test_layer_triton_backend_under_autocast(device):
    # torch.autocast does not cast a custom Function's inputs: the layer casts them (fp32 params, bf16 compute)
    torch.manual_seed(0)
    base = Linear(24, 20, bias=True).to(device)
    outs = {}
    for be in ("torch", "triton"):
        layer = LoRALinear.from_linear(base, LoRAConfig(r=4), backend=be)
        with torch.no_grad():
            layer.lora_A.copy_(rand(4, 24, seed=2, device=device))
            layer.lora_B.copy_(rand(20, 4, seed=3, device=device))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            outs[be] = layer(rand(7, 24, seed=4, device=device))
        outs[be].float().sum().backward()
        assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_A.grad.abs().sum() > 0
    assert outs["triton"].dtype == outs["torch"].dtype == torch.bfloat16
    assert_close(outs["triton"], outs["torch"], name="autocast y", atol=0.05, rtol=0.02)  # bf16 roundings differ


def test_frozen_base_unchanged_after_steps():
    model = tiny_gpt()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRAConfig(r=4, target_modules=["qkv", "down"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        idx = torch.randint(0, 40, (4, 16), generator=g)
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for k, v in base.items():
        assert torch.equal(after[k], v), f"frozen {k} changed"
    assert model.blocks[0].attn.qkv.lora_B.abs().sum() > 0  # the adapter did train
    assert not isinstance(model.blocks[0].attn.proj, LoRALinear)


def test_merge_unmerge_round_trip():
    model = tiny_gpt()
    apply_lora(model, LoRAConfig(r=4, use_rslora=True))
    for m in lora_layers(model).values():
        with torch.no_grad():
            m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=torch.Generator().manual_seed(0)))
    assert model.blocks[0].mlp.down.scaling == pytest.approx(16 / 2)  # rsLoRA: alpha / sqrt(r)
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(2))
    w0 = model.blocks[1].mlp.gate_up.weight.clone()
    with torch.no_grad():
        y = model(idx)[0]
        merge_lora(model)
        assert not torch.equal(model.blocks[1].mlp.gate_up.weight, w0)
        y_merged = model(idx)[0]
    assert_close(y_merged, y, name="merged logits")
    logits, loss = model(idx, idx)  # grad enabled: the adapter is skipped (PEFT), not added to W + s B A again
    assert_close(logits[:, -1:], y_merged, name="merged logits, grad enabled")
    unmerge_lora(model)
    assert_close(model.blocks[1].mlp.gate_up.weight, w0, name="unmerged weight")
    with torch.no_grad():
        assert_close(model(idx)[0], y, name="unmerged logits")


def test_training_a_merged_model_is_refused_at_backward():
    # Issue 36: the loss of a merged model (grad enabled) had no grad_fn and .backward() raised torch's "does not
    # require grad". Now the forward is unchanged and the backward names the fix; unmerged, the same step trains.
    model = tiny_gpt()
    apply_lora(model, LoRAConfig(r=4))
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(idx, idx)[1]
    merge_lora(model)
    logits, loss = model(idx, idx)
    assert_close(loss, want, name="merged loss")
    with pytest.raises(LoRAError, match=r"backward through a merged LoRA layer.*unmerge_lora\(model\) first"):
        loss.backward()
    with torch.no_grad():
        assert not model(idx, idx)[1].requires_grad  # inference: no guard, nothing extra
    for m in lora_layers(model).values():  # adapters frozen on purpose: nothing to train, no guard either
        m.lora_A.requires_grad_(False)
        m.lora_B.requires_grad_(False)
    assert not model(idx, idx)[1].requires_grad
    for m in lora_layers(model).values():
        m.lora_A.requires_grad_(True)
        m.lora_B.requires_grad_(True)
    unmerge_lora(model)
    model(idx, idx)[1].backward()
    assert model.blocks[0].attn.qkv.lora_B.grad.abs().sum() > 0


def test_adapter_checkpoint_round_trip(tmp_path):
    model = tiny_gpt()
    apply_lora(model, LoRAConfig(r=2, alpha=4, target_modules=r"blocks\.\d+\.attn\.(qkv|proj)"))
    for m in lora_layers(model).values():
        with torch.no_grad():
            m.lora_B.normal_(generator=torch.Generator().manual_seed(3))
    path = save_lora(model, tmp_path / "adapter.pt")
    assert path.stat().st_size < 0.25 * sum(p.numel() * 4 for p in model.parameters())  # adapters only
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(2))
    fresh = tiny_gpt()  # same seed: same base weights
    load_lora(fresh, path)  # applies the saved config, then loads
    assert sorted(lora_layers(fresh)) == sorted(lora_layers(model))
    with torch.no_grad():
        assert torch.equal(fresh(idx)[0], model(idx)[0])
    assert all(torch.equal(lora_state_dict(fresh)[k], v) for k, v in lora_state_dict(model).items())


def test_loading_into_another_base_names_keys_and_shapes(tmp_path):
    model = tiny_gpt()
    apply_lora(model, LoRAConfig(r=2))
    path = save_lora(model, tmp_path / "a.pt")
    with pytest.raises(LoRAError, match=r"blocks.0.attn.qkv.lora_A: adapter \(2, 32\) vs model \(2, 48\)"):
        load_lora(tiny_gpt(n_embd=48, n_head=2), path)
    with pytest.raises(LoRAError, match=r"not in the model: \['blocks.1.attn.proj.lora_A'"):
        load_lora(tiny_gpt(n_layer=1), path)


@pytest.mark.parametrize("kwargs, match", [
    (dict(r=0), r"r must be a positive int, got r=0"),
    (dict(r=-2), r"r=-2"),
    (dict(alpha=float("nan")), r"alpha must be a finite positive number, got alpha=nan"),
    (dict(alpha=float("inf")), r"alpha=inf"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got dropout=1.0"),
    (dict(target_modules=[]), r"target_modules must be non-empty names"),
    (dict(target_modules="qkv(("), r"target_modules='qkv\(\(' is not a valid regex"),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(LoRAError, match=match):
        LoRAConfig(**kwargs)


def test_bad_targets_name_the_target():
    with pytest.raises(LoRAError, match=r"entry 'q_proj' matches no module of GPT; linear layers are: blocks.0"):
        apply_lora(tiny_gpt(), LoRAConfig(target_modules=["qkv", "q_proj"]))
    with pytest.raises(LoRAError, match=r"entry 'nothing.*here' matches no module"):
        apply_lora(tiny_gpt(), LoRAConfig(target_modules=r"nothing\.here"))
    with pytest.raises(LoRAError, match=r"not linear layers: blocks.0.attn \(CausalSelfAttention\)"):
        apply_lora(tiny_gpt(), LoRAConfig(target_modules=["attn"]))
    m = apply_lora(tiny_gpt(), LoRAConfig())
    with pytest.raises(LoRAError, match="already has LoRA layers"):
        apply_lora(m, LoRAConfig())


def test_all_linear_leaves_out_the_lm_head():
    net = torch.nn.Sequential()
    net.add_module("emb", torch.nn.Embedding(10, 8))
    net.add_module("body", Linear(8, 8))
    net.add_module("lm_head", Linear(8, 10))
    tied = torch.nn.Module()
    tied.emb, tied.out = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)
    tied.out.weight = tied.emb.weight
    apply_lora(net, LoRAConfig(r=2))
    assert isinstance(net.body, LoRALinear) and not isinstance(net.lm_head, LoRALinear)
    with pytest.raises(LoRAError, match="matches no linear layer"):
        apply_lora(tied, LoRAConfig(r=2))


def test_print_trainable_parameters(capsys):
    model = apply_lora(tiny_gpt(), LoRAConfig(r=4, target_modules=["qkv"]))
    t, n = print_trainable_parameters(model)
    assert t == 2 * (4 * 32 + 64 * 4)  # qkv: (H + 2 KVH) * D = 64 outputs, in 2 blocks
    assert n == sum(p.numel() for p in model.parameters())
    assert capsys.readouterr().out.strip() == (f"trainable params: {t:,} || all params: {n:,} || "
                                               f"trainable%: {100 * t / n:.4f}")


def test_fp8_composition(device, ft_cfg, tiny_run):
    # Inside fp8_autocast the base GEMMs run in FP8 (bit-identical to fp8_linear with the same states) and the
    # adapter in bf16; gradients reach only lora_A / lora_B.
    torch.manual_seed(0)
    base = Linear(32, 48, bias=False, backend="torch").to(device=device, dtype=torch.bfloat16)
    layer = LoRALinear.from_linear(base, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        layer.lora_B.copy_(rand(48, 4, seed=1, scale=0.5, dtype=torch.bfloat16, device=device))
    x = rand(2, 8, 32, seed=2, dtype=torch.bfloat16, device=device).requires_grad_(True)
    with fp8_autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID)):
        y = layer(x)
    assert layer.fp8_states is not None  # the FP8 path ran and keeps its scaling states
    with torch.no_grad():  # the same first step of a fresh recipe, written out: FP8 base + bf16 adapter
        base_fp8 = fp8_linear(x, base.weight, recipe=DelayedScaling(fp8_format=Format.HYBRID), backend="torch")
        adapter = F.linear(F.linear(x, layer.lora_A), layer.lora_B)
        base_bf16 = F.linear(x, base.weight)
    assert y.dtype == torch.bfloat16 and adapter.dtype == torch.bfloat16
    assert torch.equal(y, base_fp8 + 2.0 * adapter)
    assert not torch.equal(base_fp8, base_bf16)  # the FP8 rounding is there: the base did run in FP8
    y.float().square().sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_B.grad is not None and base.weight.grad is None
    assert layer.lora_A.grad.dtype == torch.bfloat16 and torch.isfinite(layer.lora_A.grad.float()).all()


# ----------------------------------------------------------------------------------------- the CLI fine-tune
@pytest.fixture
def base_ckpt(tmp_path, make_corpus, tiny_run):
    """A tiny char-level base trained on one generated corpus; returns the path of its checkpoint."""
    from minite.config import make_config
    from minite.train import train
    make_corpus(tmp_path / "base.txt", n_chars=6000, seed=0, marks=".")
    train(make_config("cpu", {**tiny_run, "data.path": str(tmp_path / "base.txt"), "data.data_dir": str(tmp_path / "d"),
                              "train.out_dir": str(tmp_path / "base")}))
    return tmp_path / "base" / "ckpt.pt"


@pytest.fixture
def ft_cfg(tmp_path, tiny_run):
    """``ft_cfg(base, data, out, **overrides)``: a LoRA fine-tune of `base` on `data` into tmp_path/out."""
    from minite.config import make_config

    def build(base, data, out, **over):
        o = {**tiny_run, "train.init_from": str(base), "data.path": str(data), "data.data_dir": str(tmp_path / "d"),
             "train.out_dir": str(tmp_path / out), "lora.r": 4, "train.max_iters": 10, "train.eval_interval": 5,
             "model.n_layer": 3, **over}  # model.* is taken from the base (the API has no flags to refuse)
        return make_config("cpu", o)
    return build


def test_cli_lora_finetune_saves_adapters_only(tmp_path, make_corpus, base_ckpt, capsys, tiny_run):
    from minite.train import load_checkpoint, main
    make_corpus(tmp_path / "new.txt", n_chars=6000, seed=5, marks=".")  # the same characters, another text
    base_before = {k: v.clone() for k, v in load_checkpoint(base_ckpt)["model"].items()}
    args = [f"--{k}={v}" for k, v in tiny_run.items()] + [
        "--init_from", str(base_ckpt), "--lora.r=4", "--lora.target_modules=qkv,down", "--data",
        str(tmp_path / "new.txt"), "--data.data_dir", str(tmp_path / "d"), "--out_dir", str(tmp_path / "ft"),
        "--train.max_iters=10", "--train.eval_interval=5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # r * (in + out): qkv 16 -> 48 and down 256 -> 16 (the cpu preset's mlp_hidden), in the base's one block
    assert "LoRA r=4 alpha=16 on qkv,down: trainable params: 1,344 || all params:" in out
    ck = load_checkpoint(tmp_path / "ft" / "ckpt.pt")
    assert sorted(ck["model"]) == ["blocks.0.attn.qkv.lora_A", "blocks.0.attn.qkv.lora_B",
                                   "blocks.0.mlp.down.lora_A", "blocks.0.mlp.down.lora_B"]
    assert ck["config"]["lora"]["r"] == 4 and ck["config"]["model"]["n_layer"] == 1
    assert ck["model"]["blocks.0.attn.qkv.lora_B"].abs().sum() > 0  # the adapter trained
    base_after = load_checkpoint(base_ckpt)["model"]
    assert all(torch.equal(base_after[k], v) for k, v in base_before.items())
    rows = [__import__("json").loads(r) for r in (tmp_path / "ft" / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0]  # better than the base on the new text's val split


def test_cli_lora_finetune_resumes_exactly(tmp_path, make_corpus, base_ckpt, ft_cfg):
    from minite.train import load_checkpoint, train

    class Interrupt(Exception):
        pass
    make_corpus(tmp_path / "new.txt", n_chars=6000, seed=5, marks=".")
    full = train(ft_cfg(base_ckpt, tmp_path / "new.txt", "full", **{"lora.dropout": 0.1}))

    def crash(step, loss):
        if step == 7:
            raise Interrupt
    cfg = ft_cfg(base_ckpt, tmp_path / "new.txt", "cut", **{"lora.dropout": 0.1})
    with pytest.raises(Interrupt):
        train(cfg, callback=crash)
    resumed = train(cfg, resume=True, resume_overrides={"train.out_dir": str(tmp_path / "cut")})
    assert sorted(resumed["losses"]) == list(range(6, 11))
    assert all(resumed["losses"][s] == full["losses"][s] for s in resumed["losses"])  # bit-for-bit
    assert resumed["val_loss"] == full["val_loss"]
    a, b = load_checkpoint(tmp_path / "full" / "ckpt.pt"), load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_cli_finetune_vocab_errors(tmp_path, make_corpus, base_ckpt, ft_cfg):
    from minite.config import ConfigError
    from minite.data import DataError
    from minite.train import train
    make_corpus(tmp_path / "other.txt", n_chars=3000, seed=1, marks="!?")  # '!' and '?' are not in the base vocab
    with pytest.raises(DataError, match=r"has 2 characters that the base model's char vocabulary \(\d+ symbols\) "
                       r"has no id for: '!\?' .*use a byte-level base"):
        train(ft_cfg(base_ckpt, tmp_path / "other.txt", "x"))
    s = train(ft_cfg(base_ckpt, tmp_path / "other.txt", "y", **{"data.unknown_chars": ".",
                                                                            "train.max_iters": 2}))
    assert s["steps"] == 2  # '!' and '?' became '.'
    with pytest.raises(ConfigError, match=r"--lora.r > 0 adapts a trained model: give its checkpoint with "
                       r"--init_from"):
        train(ft_cfg("", tmp_path / "other.txt", "z"))
    with pytest.raises(ConfigError, match=r"entry 'wq' matches no module of GPT"):
        train(ft_cfg(base_ckpt, tmp_path / "other.txt", "z", **{"data.unknown_chars": "drop",
                                                                           "lora.target_modules": "wq"}))


def test_pydoc_topics_named_source(tmp_path):
    from minite.data import prepare
    d = prepare("pydoc-topics", data_dir=tmp_path, tokenizer="byte", verbose=False)
    assert d.meta["chars"] > 100_000 and d.meta["vocab_size"] == 256
    assert "def" in d.tokenizer.decode(d.split("train")[:20000])


def test_cli_target_modules_parsing():
    from minite.config import ConfigError, LoRASection
    from minite.finetune import lora_config
    assert lora_config(LoRASection(r=4)).target_modules == "all-linear"
    assert lora_config(LoRASection(r=4, target_modules="qkv, mlp.down")).target_modules == ["qkv", "mlp.down"]
    assert lora_config(LoRASection(r=4, target_modules=r"blocks\.0\..*")).target_modules == r"blocks\.0\..*"
    with pytest.raises(ConfigError, match=r"--lora.alpha=-1.0: must be a finite number > 0"):  # at parse time
        lora_config(LoRASection(r=4, alpha=-1.0))
