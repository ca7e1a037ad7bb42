"""Build notebooks/01_floating_point.ipynb and solutions/01_floating_point.ipynb (then execute them with nbtool)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.nbtool import check, code, md, write  # noqa: E402

SETUP = '''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # run Triton kernels on the CPU interpreter
torch.set_num_threads(1)                      # tiny shapes: threads only add overhead
'''

# ============================================================================================== lesson
lesson = [
    md(r'''
# 01 · Floating point from the bits

Every tensor in an LLM is a pile of bit patterns. How many bits, and how they are split, decides
**memory traffic** (most kernels are bandwidth bound), **tensor-core speed** (each halving of the width doubles
peak FLOP/s on an H100: ~67 TF/s FP32, ~990 FP16/BF16, ~1980 FP8) and **what can go wrong** (overflow, underflow,
lost additions).

Memory arithmetic for a 7B-parameter model:

| format | bytes/param | weights | time to stream them once at 3.35 TB/s |
|---|---|---|---|
| FP32 | 4 | 28 GB | 8.4 ms |
| BF16 / FP16 | 2 | 14 GB | 4.2 ms |
| FP8 | 1 | 7 GB | 2.1 ms |

Decoding one token reads every weight once, so the format *is* the speed. This chapter builds the formats from
their bits (`minite/formats/specs.py`), writes the rounding in a Triton kernel with integer operations, and
ends with FP16 mixed-precision training and dynamic loss scaling (`minite/formats/fp16.py`).
'''),
    code(SETUP),
    code('''
import inspect, math
import numpy as np
import matplotlib.pyplot as plt
from minite.formats.specs import (FP32, FP16, BF16, E4M3, E5M2, FORMATS, encode, decode, round_to_format,
                                  bit_string, encode_bits_tl)
from minite.formats import DynamicLossScaler
from minite.testing import check_op
'''),
    md(r'''
## 1. Sign, exponent, mantissa

A format with $E$ exponent bits, $M$ mantissa bits and bias $b = 2^{E-1}-1$ reads a pattern $s\,|\,e\,|\,m$ as

$$
v = \begin{cases}
(-1)^s \; 2^{\,e-b} \left(1 + \frac{m}{2^M}\right) & 1 \le e \le e_{top} \quad\text{(normal: a hidden leading 1)}\\[2pt]
(-1)^s \; 2^{\,1-b} \; \frac{m}{2^M} & e = 0 \quad\text{(subnormal, and } \pm 0\text{)}
\end{cases}
$$

IEEE formats reserve $e = 2^E-1$ for $\pm\infty$ ($m=0$) and NaN. E4M3 ("fn" = finite) has no infinity and
only `S.1111.111` is NaN, which buys one more binade: max $= 1.75 \cdot 2^8 = 448$ instead of 240.
From $(E, M, b)$ everything follows: max, smallest normal $2^{1-b}$, smallest subnormal $2^{1-b-M}$ and the
machine epsilon $2^{-M}$ (gap after 1). `FormatSpec` derives them; torch agrees:
'''),
    code('''
print(f"{'format':6} {'E':>2} {'M':>2} {'bias':>4} {'max':>12} {'min normal':>11} {'min subnorm':>11} {'eps':>9}")
for s in FORMATS:
    fi = torch.finfo(s.torch_dtype)
    assert (s.max, s.min_normal, s.eps) == (fi.max, fi.smallest_normal, fi.eps)
    print(f"{s.name:6} {s.exp_bits:2} {s.man_bits:2} {s.bias:4} {s.max:12.5g} {s.min_normal:11.3g} "
          f"{s.min_subnormal:11.3g} {s.eps:9.3g}")
''', tags=["nbval-check-output"]),
    md(r'''
Drawn to scale, one box per bit: BF16's exponent field is exactly FP32's (same range), FP16 trades 3 of those
exponent bits for mantissa bits (more precision, less range), and the two FP8 formats split 7 bits either way.
'''),
    code('''
from matplotlib.patches import Patch, Rectangle
FIELD_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}
LABELS = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16", "e4m3": "FP8 E4M3", "e5m2": "FP8 E5M2"}

def draw_bits(ax, y, spec, digits=None):
    \"\"\"One row of boxes at height y, sign | exponent | mantissa; digits: optional '0'/'1' string, MSB first.\"\"\"
    fields = ["sign"] + ["exponent"] * spec.exp_bits + ["mantissa"] * spec.man_bits
    for i, field in enumerate(fields):
        ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor=FIELD_COLORS[field], edgecolor="white", lw=1.5))
        if digits is not None:
            ax.text(i + 0.5, y + 0.4, digits[i], ha="center", va="center", color="white", fontsize=11,
                    fontweight="bold")

fig, ax = plt.subplots(figsize=(11, 3.6))
for row, s in enumerate(FORMATS):
    y = -row
    draw_bits(ax, y, s)
    ax.text(-0.6, y + 0.4, f"{LABELS[s.name]}  (E={s.exp_bits}, M={s.man_bits})", ha="right", va="center",
            fontsize=10)
    ax.text(s.bits + 0.6, y + 0.4, f"bias {s.bias}, max {s.max:.5g}", ha="left", va="center", fontsize=9)
ax.set_xlim(-13, 41); ax.set_ylim(-len(FORMATS) + 0.6, 1.3); ax.axis("off")
ax.legend(handles=[Patch(color=c, label=f) for f, c in FIELD_COLORS.items()], loc="upper center", ncol=3,
          frameon=False, bbox_to_anchor=(0.5, 1.08))
ax.set_title("Bit layouts, one box per bit (to scale)", y=1.1)
plt.show()
'''),
    md(r'''
A worked example: $-6.5 = -1.625 \cdot 2^2$ in FP16. Sign 1; stored exponent $2 + 15 = 17$ = `10001`;
mantissa $0.625 \cdot 2^{10} = 640$ = `1010000000`. `encode` gives the same pattern:
'''),
    code('''
v = -6.5
pattern = encode(torch.tensor([v]), FP16).item()                   # the 16-bit pattern as an int
digits = format(pattern, f"0{FP16.bits}b")                         # MSB (sign) first
e_field, m_field = int(digits[1:1 + FP16.exp_bits], 2), int(digits[1 + FP16.exp_bits:], 2)
fig, ax = plt.subplots(figsize=(8, 1.6))
draw_bits(ax, 0, FP16, digits)
ax.set_xlim(-0.2, FP16.bits + 0.2); ax.set_ylim(-0.1, 0.9); ax.axis("off")
ax.set_title(f"{v} in FP16: (-1)^{digits[0]} * 2^({e_field}-{FP16.bias}) * (1 + {m_field}/2^{FP16.man_bits})"
             f" = {decode(torch.tensor([pattern]), FP16).item()}")
ax.legend(handles=[Patch(color=c, label=f) for f, c in FIELD_COLORS.items()], loc="lower center", ncol=3,
          frameon=False, bbox_to_anchor=(0.5, -0.3))
plt.show()
'''),
    md('The same numbers as bit strings (`sign exponent mantissa`); watch 0.1 being rounded differently by each:'),
    code('''
for v in [1.0, -2.5, 0.1, 448.0, 65504.0, 1e-7, 3e38]:
    x = torch.tensor([v])
    row = [f"{s.name}: {bit_string(encode(x, s).item(), s):<18} = {decode(encode(x, s), s).item():<11.6g}"
           for s in (FP16, BF16, E4M3)]
    print(f"{v:>8g} | " + " | ".join(row))
''', tags=["nbval-check-output"]),
    md(r'''
## 2. Why BF16 keeps FP32's range

BF16 is the top half of an FP32: the same sign and **8 exponent bits**, only 7 of the 23 mantissa bits. So it
covers $10^{-38}\dots3\cdot10^{38}$ like FP32 (no overflow, no underflow in practice) with ~2-3 significant
digits. FP16 spends its bits the other way: 10 mantissa bits (more precision) but 5 exponent bits, so it
overflows above 65504 and flushes to zero below $6\cdot10^{-8}$. Large activations and tiny gradients are
exactly what an LLM produces, which is why BF16 trains without the loss scaling of section 6.
'''),
    code('''
for v in [3e38, 70000.0, 1e-10, 1e-38]:
    x = torch.tensor([v])
    print(f"{v:>8g}  fp32 {bit_string(encode(x, FP32).item(), FP32)}  bf16 {bit_string(encode(x, BF16).item(), BF16)}"
          f" -> {decode(encode(x, BF16), BF16).item():<10.4g} fp16 -> {decode(encode(x, FP16), FP16).item():.4g}")
''', tags=["nbval-check-output"]),
    md(r'''
## 3. Rounding: nearest, ties to even, with integer operations

Rounding $x$ to a format keeps the value on the grid $q\,\mathbb{Z}$ where the quantum is
$q = 2^{\max(e_x,\,e_{min}) - M}$ ($e_x = \lfloor\log_2|x|\rfloor$). In bits: take FP32's 24-bit significand,
drop `shift` low bits, and round up when the dropped part is more than half a quantum, or exactly half and the
kept part is odd (ties to even: no bias when many values are rounded). A carry out of the mantissa moves into
the exponent field by itself, because patterns of positive floats are ordered like integers. Overflow has a rule
per format: FP16/BF16/E5M2 go to $\pm\infty$, E4M3 saturates to $\pm448$ (`saturate=` switches).

On a GPU, `x.to(tl.float8e4nv)` does this in hardware; the CPU interpreter gets it wrong on a few % of values
(lost carries, no saturation), so minite writes it with integer operations. This Triton helper is what chapter 02's
FP8 kernels call:
'''),
    code('print(inspect.getsource(encode_bits_tl.fn if hasattr(encode_bits_tl, "fn") else encode_bits_tl))'),
    md('Check it bit for bit against torch\'s casts, and the round-trip values with `check_op`:'),
    code('''
g = torch.Generator().manual_seed(0)
x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-20, 20, (100_000,), generator=g).float())
for s, view in [(FP16, torch.int16), (BF16, torch.int16), (E4M3, torch.uint8), (E5M2, torch.uint8)]:
    xs = x.clamp(-s.max, s.max)                       # in range: torch's overflow rule differs across versions
    want = xs.to(s.torch_dtype).view(view).to(torch.int32) & ((1 << s.bits) - 1)
    assert torch.equal(encode(xs, s, backend="triton"), want)
    assert check_op(f"round to {s.name}", lambda t: round_to_format(t, s, backend="triton"),
                    lambda t: t.to(s.torch_dtype).float(), xs, grad=False, atol=0, rtol=0)
''', tags=["nbval-check-output"]),
    md(r'''
Relative rounding error is at most $\varepsilon/2 = 2^{-M-1}$ across the normal range (a flat band), and grows in
the subnormal range where the quantum stays fixed while $|x|$ shrinks, until everything flushes to 0
(relative error 1). Each format's curve ends at its max:
'''),
    code('''
x64 = torch.logspace(-50, 39, 6000, base=10, dtype=torch.float64)
fig, ax = plt.subplots(figsize=(9, 4))
for s in FORMATS:
    xs = x64[x64 <= s.max]
    err = ((round_to_format(xs.float(), s).double() - xs).abs() / xs).clamp(min=1e-12)
    line, = ax.loglog(xs, err, lw=0.7, label=s.name)
    ax.axhline(s.eps / 2, color=line.get_color(), ls=":", lw=0.8)
ax.set(xlabel="|x|", ylabel="relative error of rounding", ylim=(1e-9, 2),
       title="Rounding error vs magnitude (dotted: eps/2)")
ax.legend(); plt.show()
'''),
    md(r'''
## 4. All 256 FP8 values

FP8 is small enough to list. Each binade $[2^k, 2^{k+1})$ holds $2^M$ values: 8 for E4M3, 4 for E5M2, so the
numbers are dense near 0 and sparse near the max, evenly on a log scale. E4M3 has more precision, E5M2 more range
(used for gradients in chapter 02).
'''),
    code('''
fig, axes = plt.subplots(2, 1, figsize=(9, 4.5))
for ax, s in zip(axes, (E4M3, E5M2)):
    v = decode(torch.arange(256, dtype=torch.int32), s)
    fin = v[v.isfinite()]
    pos = fin[fin > 0]
    print(f"{s.name}: {v.isnan().sum().item()} NaN patterns, {v.isinf().sum().item()} inf, {(fin == 0).sum().item()} "
          f"zeros, {pos.numel()} positive finite from {pos.min().item():.3g} to {pos.max().item():g}")
    ax.hist(pos.log2().numpy(), bins=np.arange(-17, 17), color="C0" if s is E4M3 else "C1")
    ax.plot(pos.log2().numpy(), np.zeros(pos.numel()) - 0.5, "|k", ms=8)
    ax.set(title=f"{s.name}: positive values per binade (ticks: each value)", xlabel="log2(value)", xlim=(-17, 17))
plt.tight_layout(); plt.show()
'''),
    md(r'''
## 5. Catastrophic cases, and why accumulation is in FP32

Adding $a + b$ with $|b| < \tfrac12\,\mathrm{ulp}(a)$ returns $a$: the small number is rounded away. FP16's
ulp at 2048 is 2, BF16's at 256 is 2. A running sum in low precision therefore **stalls**: summing 0.1 ten
thousand times in FP16 stops growing at 256, where half an ulp (0.125) exceeds 0.1.
'''),
    code('''
print("fp16: 2048 + 1 =", (torch.tensor(2048.0, dtype=torch.float16) + 1).item())
print("bf16:  256 + 1 =", (torch.tensor(256.0, dtype=torch.bfloat16) + 1).item())
print("fp32: 2^24 + 1 =", int((torch.tensor(2.0 ** 24) + 1).item()), "(2^24 =", 2 ** 24, ")")
vals = np.full(10_000, 0.1, dtype=np.float16)
run16, acc = np.empty(10_000), np.float16(0)
for i, v in enumerate(vals):
    acc = np.float16(acc + v); run16[i] = acc            # fp16 accumulator
run32 = np.cumsum(vals.astype(np.float32))              # fp16 inputs, fp32 accumulator
print(f"sum of 10,000 x fp16(0.1): fp16 accumulator {run16[-1]:g}, fp32 accumulator {run32[-1]:.2f},"
      f" torch.sum on fp16 {torch.from_numpy(vals).sum().item():.2f}")
plt.figure(figsize=(7, 3))
plt.plot(run16, label="fp16 accumulator"); plt.plot(run32, label="fp32 accumulator")
plt.xlabel("terms added"); plt.ylabel("running sum"); plt.legend(); plt.title("Summing 0.1 in fp16"); plt.show()
''', tags=["nbval-check-output"]),
    md(r'''
So every serious kernel keeps **inputs** narrow (bandwidth) but **accumulates in FP32**: tensor cores multiply
FP16/BF16/FP8 and add into FP32 (`tl.dot(a, b, acc)` with an FP32 `acc`), `torch.sum` of an FP16 tensor
accumulates in FP32 and rounds once at the end (1000.00 above: the FP16 nearest to 999.76), and
the minite kernels load then `.to(tl.float32)` at once. The same goes for weights: an update of $10^{-4}$ to
a weight of 1.0 is below half an FP16 ulp ($2^{-11}$) and is lost, which is why optimizers keep **FP32 master weights**:
'''),
    code('''
w16, w32 = torch.tensor(1.0, dtype=torch.float16), torch.tensor(1.0)
for _ in range(100):
    w16 -= 1e-4; w32 -= 1e-4
print(f"100 updates of -1e-4: fp16 weight {w16.item():.4f}, fp32 master {w32.item():.4f}")
''', tags=["nbval-check-output"]),
    md(r'''
## 6. Mixed precision: FP16 with master weights and dynamic loss scaling

The recipe (Micikevicius et al., 2018): forward and backward in FP16, weights kept in FP32 and rounded to FP16
for each step, the update applied to the FP32 master. The danger is in the backward: activation gradients are
tiny (a loss averaged over many tokens, divided again by the number of micro-batches of gradient accumulation)
and FP16 flushes everything below $2^{-24} \approx 6\cdot10^{-8}$ to zero.

Our toy: a 3-layer MLP classifier, 512 tokens per micro-batch, loss divided by 4096 micro-batches. Histogram of
the activation gradients (computed in FP32), against FP16's limits:
'''),
    code('''
import copy
import torch.nn.functional as F
torch.manual_seed(0)
N, D, H, V, ACCUM = 512, 16, 64, 64, 4096
X = torch.randn(N, D)
Y = (X @ torch.randn(D, V)).argmax(-1)                  # labels of a random linear teacher: learnable

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H), torch.nn.Tanh(),
                               torch.nn.Linear(H, V))

def activation_grads(dtype, scale=1.0):
    model, h, acts = make_model().to(dtype), X.to(dtype), []
    for layer in model:
        h = layer(h); h.retain_grad(); acts.append(h)
    (F.cross_entropy(h.float(), Y) / ACCUM * scale).backward()
    return torch.cat([a.grad.float().flatten() for a in acts]) / scale

g32 = activation_grads(torch.float32)
print(f"activation grads below 2^-24: {(g32.abs() < 2 ** -24).float().mean().item():.0%} (fp32 run)")
print(f"exactly zero in an fp16 backward: {(activation_grads(torch.float16) == 0).float().mean().item():.0%}; "
      f"with the loss scaled by 2^16: {(activation_grads(torch.float16, 2.0 ** 16) == 0).float().mean().item():.1%}")
plt.figure(figsize=(7, 3))
plt.hist(g32.abs().clamp(min=2 ** -40).log2().numpy(), bins=60, color="C0", label="|grad| (fp32)")
plt.hist((g32.abs() * 2 ** 16).log2().numpy(), bins=60, color="C2", alpha=0.5, label="|grad| x 2^16")
for v, t in [(-24, "fp16 min subnormal"), (-14, "fp16 min normal"), (math.log2(65504), "fp16 max")]:
    plt.axvline(v, color="k", ls="--", lw=0.8); plt.text(v + 0.3, 10, t, rotation=90, fontsize=8)
plt.xlabel("log2 |activation gradient|"); plt.legend(); plt.title("Gradients underflow in fp16"); plt.show()
'''),
    md(r'''
Scaling the loss by $S$ scales every gradient by $S$ (the backward is linear in the upstream gradient), shifting
the histogram into FP16's range. Divide by $S$ (in FP32) before the optimizer step and nothing else changes.
$S$ is picked **dynamically**: start high ($2^{16}$ by default; $2^{34}$ here, to watch it work); if any
gradient is inf/NaN, skip the step and halve $S$; after `growth_interval` clean steps, double it.
`DynamicLossScaler` follows Megatron-LM and `torch.amp.GradScaler`:
'''),
    code('print(inspect.getsource(DynamicLossScaler.update))'),
    md('Training for 40 steps (Adam) in FP32, FP16 without scaling, FP16 with the scaler, and BF16 without one:'),
    code('''
def train(dtype, scaler=None, steps=40):
    master = make_model()                                    # fp32 master weights, owned by the optimizer
    model = copy.deepcopy(master).to(dtype)                  # the low-precision copy that runs fwd/bwd
    opt = torch.optim.Adam(master.parameters(), lr=1e-2)
    scaler = scaler or DynamicLossScaler(enabled=False)
    losses, scales = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(X.to(dtype)).float(), Y)   # loss in fp32
        model.zero_grad(set_to_none=True)
        scaler.scale(loss / ACCUM).backward()                    # low-precision backward
        for pm, p in zip(master.parameters(), model.parameters()):
            pm.grad = p.grad.float()                             # grads to the fp32 master
        scaler.step(opt)                                         # unscale, check inf, step (or skip)
        scaler.update()
        with torch.no_grad():
            for pm, p in zip(master.parameters(), model.parameters()):
                p.copy_(pm)                                      # round the master to the working dtype
        losses.append(loss.item()); scales.append(scaler.scale_value)
    return losses, scales

runs = {"fp32": train(torch.float32), "fp16, no scaling": train(torch.float16),
        "fp16 + loss scaler": train(torch.float16, DynamicLossScaler(init_scale=2.0 ** 34, growth_interval=10)),
        "bf16, no scaling": train(torch.bfloat16)}
for name, (losses, _) in runs.items():
    print(f"{name:20} loss {losses[0]:.2f} -> {losses[-1]:.2f}")
scales = runs["fp16 + loss scaler"][1]
print("loss scale, log2, every 4 steps:", [int(math.log2(s)) for s in scales[::4]])
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, (losses, _) in runs.items():
    a1.plot(losses, label=name, ls="--" if "bf16" in name else "-")
a1.set(xlabel="step", ylabel="loss", title="Training loss"); a1.legend()
a2.plot(np.log2(scales)); a2.set(xlabel="step", ylabel="log2 scale", title="Dynamic loss scale (fp16)")
plt.tight_layout(); plt.show()
'''),
    md(r'''
FP16 without scaling learns slowly (most gradients are zero); with the scaler it follows FP32: the first steps
overflow and are skipped while $S$ backs off from $2^{34}$, then $S$ doubles every 10 clean steps. BF16 needs none
of this: its exponent range is FP32's. That is why BF16 is the default for LLM training, and FP16 + a loss
scaler the fallback on GPUs without BF16.

## 7. Benchmark (GPU only)

The encode kernel is a pure map (4 bytes in, 4 out per value): it should run near memory bandwidth.
'''),
    code('''
if torch.cuda.is_available():
    import triton.testing
    x = torch.randn(1 << 26, device="cuda")
    for s in (BF16, E4M3):
        ms = triton.testing.do_bench(lambda: encode(x, s, backend="triton"))
        ms_t = triton.testing.do_bench(lambda: x.to(s.torch_dtype))
        print(f"{s.name}: minite encode {ms:.3f} ms ({8 * x.numel() / ms / 1e9:.0f} GB/s), torch cast {ms_t:.3f} ms")
else:
    print("no GPU here: benchmark skipped")
'''),
    md(r'''
## 8. Where this is used

* `minite/formats/specs.py`: `FormatSpec`, `encode`/`decode`, and the Triton helpers `encode_bits_tl` /
  `decode_bits_tl` that chapter 02's FP8 quantization kernels (`minite/formats/fp8.py`) call to round to
  E4M3/E5M2 with saturation.
* `minite/formats/fp16.py`: `DynamicLossScaler`, used by the training script (`python -m minite.train`) when
  it trains in FP16; in BF16 it is disabled.
* Every minite kernel loads its inputs in FP16/BF16 and accumulates in FP32 (section 5).
'''),
]

# ============================================================================================== solutions
solutions = [
    md(r'''
# 01 · Floating point from the bits — exercises

Four graded tasks. Fill in each region between `### BEGIN SOLUTION` and `### END SOLUTION`, run the check cell
below it. Grade with `python -m minite.grading grade exercises/01_floating_point.ipynb`.
'''),
    code(SETUP),
    code('''
import torch
from minite._triton import triton, tl
from minite.formats.specs import BF16, encode
from minite.formats import DynamicLossScaler

def torch_bf16_bits(x):
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF

def bf16_is_nan(b):
    return ((b >> 7) & 0xFF == 0xFF) & (b & 0x7F != 0)

g = torch.Generator().manual_seed(0)
# fp32 test values: random magnitudes, exact bf16 ties and their neighbours, specials
X = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-130, 128, (100_000,), generator=g).float())
ties = (torch.randint(0, 1 << 16, (20_000,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
X = torch.cat([X, ties, torch.nextafter(ties, 2 * ties), torch.nextafter(ties, 0 * ties),
               torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, 1e-45])])
'''),
    md(r'''
## Task 1 — decode an FP16 bit pattern by hand

FP16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. Return the Python float of a 16-bit pattern
`bits` (0 ≤ bits < 65536): normal numbers $(-1)^s 2^{e-15}(1 + m/1024)$, subnormals $(-1)^s 2^{-14} m/1024$,
$\pm 0$, $\pm\infty$ ($e = 31, m = 0$), NaN ($e = 31, m \ne 0$). Use only integer operations and `2.0 ** k`.
'''),
    code('''
def decode_fp16(bits: int) -> float:
    ### BEGIN SOLUTION
    s, e, m = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 0x1F:
        v = float("inf") if m == 0 else float("nan")
    elif e == 0:
        v = 2.0 ** -14 * (m / 1024)
    else:
        v = 2.0 ** (e - 15) * (1 + m / 1024)
    return -v if s else v
    ### END SOLUTION
'''),
    check("decode_fp16", '''
import math
patterns = torch.arange(1 << 16, dtype=torch.int32)
want = patterns.to(torch.int16).view(torch.float16).float().tolist()
bad = [p for p, w in zip(range(1 << 16), want)
       if not ((math.isnan(w) and math.isnan(decode_fp16(p))) or (decode_fp16(p) == w
               and math.copysign(1, decode_fp16(p)) == math.copysign(1, w)))]
assert not bad, f"{len(bad)} patterns wrong, e.g. {hex(bad[0])}: got {decode_fp16(bad[0])}"
print("PASS: decode_fp16 on all 65536 patterns")
'''),
    md(r'''
## Task 2 — round FP32 to BF16 with integer operations

BF16 is the top 16 bits of an FP32. Truncating would always round toward zero; round-to-nearest-even instead:
add `0x7FFF` plus the lowest kept bit (bit 16) to the FP32 bits, then shift right by 16. Ties (low half exactly
`0x8000`) then round up only when the kept part is odd. The carry ripples into the exponent by itself, and the
largest FP32 values correctly round to inf. NaN must stay NaN (return `0x7FC0` with the sign bit). Return the
int32 tensor of 16-bit patterns (0 ≤ b < 65536).
'''),
    code('''
def fp32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    u = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF     # the fp32 bits, as a non-negative int64
    ### BEGIN SOLUTION
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = torch.where(nan, (u >> 16) & 0x8000 | 0x7FC0, rounded)
    ### END SOLUTION
    return out.to(torch.int32)
'''),
    check("fp32_to_bf16_bits", '''
got, want = fp32_to_bf16_bits(X), torch_bf16_bits(X)
assert got.dtype == torch.int32 and got.shape == X.shape
nan = bf16_is_nan(want)
assert torch.equal(bf16_is_nan(got), nan), "NaN must stay NaN (and nothing else may become NaN)"
assert torch.equal(got[~nan], want[~nan]), f"{int((got != want)[~nan].sum())} of {X.numel()} values rounded wrong"
print(f"PASS: fp32_to_bf16_bits bit-exact on {X.numel()} values incl. ties")
'''),
    md(r'''
## Task 3 — the same rounding as a Triton kernel body

Write the body of a kernel that rounds a block of `BLOCK_SIZE` FP32 values to BF16 bit patterns (int32) with the
same trick. In Triton: `x.to(tl.int32, bitcast=True)` reinterprets the bits; `>>` on int32 is an arithmetic
shift, so mask after shifting (`(u >> 16) & 0xFFFF`). Here you may ignore NaN inputs (the check leaves them out).
'''),
    code('''
@triton.jit
def round_bf16_kernel(X_ptr, Y_ptr, N, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    x = tl.load(X_ptr + offs, mask=mask, other=0.0)
    ### BEGIN SOLUTION
    u = x.to(tl.int32, bitcast=True)
    y = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    tl.store(Y_ptr + offs, y, mask=mask)
    ### END SOLUTION

def round_bf16_triton(x):
    y = torch.zeros(x.shape, dtype=torch.int32)
    round_bf16_kernel[(triton.cdiv(x.numel(), 16384),)](x, y, x.numel(), BLOCK_SIZE=16384)
    return y
'''),
    check("round_bf16_kernel", '''
xs = X[~X.isnan()].contiguous()
got, want = round_bf16_triton(xs), torch_bf16_bits(xs)
assert torch.equal(got, want), f"{int((got != want).sum())} of {xs.numel()} values rounded wrong"
assert torch.equal(got, encode(xs, BF16, backend="torch"))
print(f"PASS: round_bf16_kernel bit-exact on {xs.numel()} values")
'''),
    md(r'''
## Task 4 — the dynamic loss-scale update rule

Given this step's verdict `found_inf`, return the new `(scale, growth_tracker, hysteresis_tracker)`:

* overflow: `growth_tracker = 0`, `hysteresis_tracker -= 1`, and once it is ≤ 0 the scale backs off:
  `scale = max(scale * backoff_factor, min_scale)`;
* clean step: `growth_tracker += 1`; when it reaches `growth_interval`: `scale *= growth_factor`, reset
  `growth_tracker = 0` and `hysteresis_tracker = hysteresis`.
'''),
    code('''
def update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=1, min_scale=1.0):
    ### BEGIN SOLUTION
    if found_inf:
        growth_tracker = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            scale, growth_tracker, hysteresis_tracker = scale * growth_factor, 0, hysteresis
    return scale, growth_tracker, hysteresis_tracker
    ### END SOLUTION
'''),
    check("update_scale", '''
import random
rng = random.Random(0)
for cfg in [dict(growth_interval=3), dict(growth_interval=5, hysteresis=2, min_scale=4.0),
            dict(growth_interval=2, growth_factor=4.0, backoff_factor=0.25, hysteresis=3)]:
    ref = DynamicLossScaler(init_scale=256.0, **cfg)
    state = (256.0, 0, cfg.get("hysteresis", 1))
    for step in range(200):
        bad = rng.random() < 0.3
        p = torch.nn.Parameter(torch.zeros(1)); p.grad = torch.tensor([float("inf") if bad else 1.0])
        ref.step(torch.optim.SGD([p], lr=0.1)); ref.update()
        state = update_scale(*state, bad, **cfg)
        sd = ref.state_dict()
        assert state == (sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]), (cfg, step, state, sd)
print("PASS: update_scale matches DynamicLossScaler on 600 random steps")
'''),
]

if __name__ == "__main__":
    # `build_nb_01.py lesson` or `build_nb_01.py solutions` writes only that notebook; no argument writes both.
    which = set(sys.argv[1:]) or {"lesson", "solutions"}
    root = Path(__file__).resolve().parent.parent
    if "lesson" in which:
        print(write(root / "notebooks/01_floating_point.ipynb", lesson))
    if "solutions" in which:
        print(write(root / "solutions/01_floating_point.ipynb", solutions))
