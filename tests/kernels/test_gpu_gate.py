"""The sm_90 / sm_80 compile gate (minite/gpu_compile.py), checked on a machine with no GPU.

`make test` records every launch of a minite kernel while the suite runs under the interpreter, captures the
launches the GPU makes at the benchmarks' shapes (minite/gpu_examples.py), and compiles them at the end. This file
checks the gate on planted kernels, each a mistake it must catch, and runs it over the shipped GPU tiles:
- specialisation: a launch is compiled with the JIT's own specialisation (the TTGIR equals what Triton's
  ``kernel.warmup`` builds for the same arguments, through a stand-in sm_90 driver), and that specialisation
  changes the code (cp.async pipelining needs 16-byte-aligned pointers and strides);
- an fp64 float scalar (the H100 crash of 2026-11-25), a float leaking into fp32 math, shared memory over a
  block's limit (sm_90 and sm_80);
- on a GPU tile for sm_90: a dot of 64+ rows on mma.sync (2 warps), a 32-row tile on mma.sync with no stated
  reason (today's attention dQ at D = 128 was one), a wgmma layout whose warpgroups compute the same rows (a
  chained dot of 64 rows on 8 warps), an fp8 dot that accumulates past its stated promotion interval or states
  none, register spills;
- every family's GPU tiles pass all of it.
Subprocesses: the capture runs interpreted (TRITON_INTERPRET=1), the compiles with the interpreter off.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLANTED = textwrap.dedent('''
    import triton
    import triton.language as tl

    PROMOTION_INTERVAL = {"_fp8_loop_kernel": "BLOCK_K", "_fp8_fresh_kernel": 128}
    MMA_SYNC_OK = {"_small_ok_kernel": "M is a handful of rows by the problem, not by the tile"}

    @triton.jit
    def _loop_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        # the attention bug in small: a running max seeded fp32 and updated with `x * scale`
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, n, BLOCK):
            x = tl.load(X + i + offs, mask=i + offs < n, other=0.0)
            m = tl.maximum(m, x * scale)
        tl.store(O + offs, m)

    @triton.jit
    def _leak_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        # no loop: compiles, but multiplies in fp64 (slow on every GPU, and not what the fp32 kernel means)
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(O + offs, x * scale, mask=offs < n)

    @triton.jit
    def _fixed_kernel(X, O, n, scale, BLOCK: tl.constexpr):
        scale = tl.cast(scale, tl.float32)  # the fix minite's kernels use
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, n, BLOCK):
            x = tl.load(X + i + offs, mask=i + offs < n, other=0.0)
            m = tl.maximum(m, x * scale)
        tl.store(O + offs, m)

    @triton.jit
    def _gemm(A, B, C, M, N, K, s_am, s_ak, s_bk, s_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(A + rm[:, None] * s_am + k[None, :] * s_ak, mask=(rm[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            b = tl.load(B + k[:, None] * s_bk + rn[None, :], mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(C + rm[:, None] * s_cm + rn[None, :], acc.to(C.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _gemm_kernel(A, B, C, M, N, K, s_am, s_ak, s_bk, s_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        _gemm(A, B, C, M, N, K, s_am, s_ak, s_bk, s_cm, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _small_ok_kernel(A, B, C, M, N, K, s_am, s_ak, s_bk, s_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        _gemm(A, B, C, M, N, K, s_am, s_ak, s_bk, s_cm, BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _chain_kernel(Q, K, V, O, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        # attention in small: S = Q K^T, then O = S V (chained dots: Triton puts every warp along M)
        rm, rn, rd = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
        s = tl.dot(tl.load(Q + rm[:, None] * D + rd[None, :]), tl.trans(tl.load(K + rn[:, None] * D + rd[None, :])))
        o = tl.dot(s.to(Q.dtype.element_ty), tl.load(V + rn[:, None] * D + rd[None, :]))
        tl.store(O + rm[:, None] * D + rd[None, :], o.to(O.dtype.element_ty))

    @triton.jit
    def _fp8_loop_kernel(A, B, C, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IMPRECISE: tl.constexpr):
        # the accumulator runs through the K loop: without max_num_imprecise_acc it is never promoted
        rm, rn, rk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(A + rm[:, None] * K + (k0 + rk)[None, :])
            b = tl.load(B + rn[None, :] * K + (k0 + rk)[:, None])
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
        tl.store(C + rm[:, None] * BLOCK_N + rn[None, :], acc)

    @triton.jit
    def _fp8_fresh_kernel(A, B, C, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # a fresh dot per K-block, added in fp32 (block-scaled GEMMs): promoted every BLOCK_K products
        rm, rn, rk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(A + rm[:, None] * K + (k0 + rk)[None, :])
            b = tl.load(B + rn[None, :] * K + (k0 + rk)[:, None])
            acc += tl.dot(a, b) * 0.5
        tl.store(C + rm[:, None] * BLOCK_N + rn[None, :], acc)

    @triton.jit
    def _fp8_unstated_kernel(A, B, C, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        _fp8_fresh_kernel(A, B, C, K, BLOCK_M, BLOCK_N, BLOCK_K)
''')

# Interpreted: record launches of the planted GEMM as the suite's recorder does, the JIT's specialisation
# included: aligned pointers and strides (cp.async-able), one pointer 2 bytes off and odd sizes, a unit stride.
RECORD = textwrap.dedent('''
    import json, sys, torch
    import planted_kernels as P
    from minite.gpu_compile import _rule_specialise, launch_record
    x, w, y = (torch.empty(256 * 256, dtype=torch.bfloat16) for _ in range(3))
    launches = {"aligned": (x, w, y, 256, 256, 256, 256, 1, 256, 256),
                "odd": (x[1:], w, y, 250, 256, 250, 250, 1, 256, 256),
                "strided": (x, w, y, 128, 256, 128, 1, 128, 256, 256)}
    meta = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3)
    out = {k: launch_record(P._gemm_kernel.fn, a, meta, P._gemm_kernel.kwargs) for k, a in launches.items()}
    # the fallback for a Triton whose binder differs (the H100 runs 3.6): the same rule, written out
    out.update({k + "/rule": _rule_specialise(P._gemm_kernel.fn, a, meta) for k, a in launches.items()})
    print("RECORDS " + json.dumps(out))
''')

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    import planted_kernels as P
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from minite.gpu_compile import build, compile_record, gate

    out = {}
    def rec(kernel, sig, consts, warps=4, stages=3, gpu=True, attrs=()):
        return dict({"module": "planted_kernels", "kernel": kernel, "signature": sig, "constexprs": consts,
                     "num_warps": warps, "num_stages": stages,
                     "attrs": {n: [["tt.divisibility", 16]] for n in attrs}}, **({"tiles": "gpu"} if gpu else {}))

    # 1. specialisation: the recorded launches against Triton's own JIT (warmup through a stand-in sm_90 driver)
    recorded = json.loads(sys.argv[1])
    class Sm90Driver:  # what JITFunction.run asks of a driver before it compiles; nothing is launched
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
    driver.set_active(Sm90Driver())
    x, w, y = (torch.empty(256 * 256, dtype=torch.bfloat16) for _ in range(3))
    launches = {"aligned": (x, w, y, 256, 256, 256, 256, 1, 256, 256),
                "odd": (x[1:], w, y, 250, 256, 250, 250, 1, 256, 256),
                "strided": (x, w, y, 128, 256, 128, 1, 128, 256, 256)}
    for name, args in launches.items():
        jit = P._gemm_kernel.warmup(*args, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3,
                                    grid=(1,))
        ours = build(recorded[name])
        out[f"spec/{name}/rule"] = recorded[name + "/rule"]
        out[f"spec/{name}"] = {"same": ours.asm["ttgir"] == jit.asm["ttgir"], "attrs": recorded[name]["attrs"],
                               "consts": recorded[name]["constexprs"],
                               "cp_async": ours.asm["ttgir"].count("async_copy_global_to_local")}
    driver.set_active(None)  # back to no driver (this machine has none)
    bare = dict(recorded["aligned"], attrs={})  # what the gate compiled before: no specialisation at all
    out["spec/bare_cp_async"] = build(bare).asm["ttgir"].count("async_copy_global_to_local")

    # 2. planted fp64 scalars and a float leak, on launches the suite recorded (interpreter tiles)
    sig = {"X": "*fp32", "O": "*fp32", "n": "i32", "scale": "float"}
    for name in ("_loop_kernel", "_leak_kernel", "_fixed_kernel"):
        for ft in ("fp32", "fp64"):
            out[f"{name}/{ft}"] = compile_record(rec(name, sig, {"BLOCK": 128}, gpu=False), 90, ft)

    # 3. GPU tiles of the planted GEMM and chain on sm_90
    g = {n: "*bf16" for n in "ABC"}
    g.update({n: "i32" for n in ("M", "N", "K", "s_am", "s_ak", "s_bk", "s_cm")})
    al = list(g)
    def gemm(bm, bn, bk, warps, kernel="_gemm_kernel", stages=3):
        return rec(kernel, g, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), warps, stages, attrs=al)
    c = {n: "*bf16" for n in "QKVO"}
    f8 = {"A": "*fp8e4nv", "B": "*fp8e4nv", "C": "*fp32", "K": "i32"}
    planted = {
        "good": gemm(128, 64, 32, 8),
        "mma_sync_64": gemm(64, 64, 32, 2),                    # 2 warps: no warpgroup, 64 rows on mma.sync
        "mma_sync_32": gemm(32, 64, 32, 8),                    # a 32-row tile (attention dQ at D = 128 had it)
        "mma_sync_32_stated": gemm(32, 64, 32, 8, "_small_ok_kernel"),
        "replicated": rec("_chain_kernel", c, dict(BLOCK_M=64, BLOCK_N=64, D=64), 8, attrs=list(c)),
        "chain_128": rec("_chain_kernel", c, dict(BLOCK_M=128, BLOCK_N=64, D=64), 8, attrs=list(c)),
        "fp8_unbounded": rec("_fp8_loop_kernel", f8, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, IMPRECISE=None),
                             attrs=list(f8)),
        "fp8_128": rec("_fp8_loop_kernel", f8, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, IMPRECISE=128),
                       attrs=list(f8)),
        "fp8_fresh": rec("_fp8_fresh_kernel", f8, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128), attrs=list(f8)),
        "fp8_fresh_256": rec("_fp8_fresh_kernel", f8, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256), attrs=list(f8)),
        "fp8_unstated": rec("_fp8_unstated_kernel", f8, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128), attrs=list(f8)),
        "smem": gemm(256, 256, 128, 8, stages=4),              # 4 stages of 256 x 128 + 128 x 256 bf16: 512 KiB
    }
    for name, r in planted.items():
        out[name] = compile_record(r, 90, "fp32")
    out["smem/sm80"] = compile_record(planted["smem"], 80, "fp32")
    out["good/sm80"] = compile_record(planted["good"], 80, "fp32")
    print("RESULT " + json.dumps(out))
''')

EXAMPLES = textwrap.dedent('''
    import json, sys
    from minite.gpu_compile import _examples, gate
    from minite.gpu_examples import SPILL_BUDGET
    records = _examples(None)
    lines = []
    # under `make test` the gate that runs right after pytest compiles these same launches (--examples): capture
    # only here, so the suite does not compile every GPU tile twice (~1 min of 2 cores, cold)
    fails = 0 if sys.argv[1:] == ["capture"] else gate(records, archs=(90, 80), jobs=2, spill_budget=SPILL_BUDGET,
                                                      log=lines.append)
    print("\\n".join(lines))
    upcast = sorted({r["constexprs"].get("UPCAST") for r in records if r.get("kernel") == "_attn_fwd_kernel"})
    print("RESULT " + json.dumps({"n": len(records), "fails": fails, "upcast": upcast,
                                  "families": sorted({r["family"] for r in records})}))
''')


def _run(args, env_update, tmp_path, timeout=1200):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("triton's ptxas is not available here")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    tmp = tmp_path_factory.mktemp("gate")
    (tmp / "planted_kernels.py").write_text(PLANTED)
    recorded = _run(["-c", RECORD], {"TRITON_INTERPRET": "1"}, tmp).split("RECORDS ", 1)[1].splitlines()[0]
    # Triton's own cache (as the gate after pytest): a failed compile is never cached, a repeated one is quick
    text = _run(["-c", SCRIPT, recorded], {}, tmp)
    return json.loads(text.split("RESULT ", 1)[1])


def test_launches_compile_with_the_jits_specialisation(gate_run):
    out = gate_run
    for name in ("aligned", "odd", "strided"):
        assert out[f"spec/{name}"]["same"], f"{name}: the gate's TTGIR differs from the JIT's ({out[f'spec/{name}']})"
    aligned, odd, strided = out["spec/aligned"], out["spec/odd"], out["spec/strided"]
    assert {"A", "B", "C", "M", "N", "K", "s_am", "s_bk", "s_cm"} <= set(aligned["attrs"]), aligned
    assert aligned["consts"]["s_ak"] == 1 and strided["consts"]["s_am"] == 1, (aligned, strided)  # ints == 1
    assert "s_ak" in strided["attrs"] and "s_ak" not in aligned["attrs"], (aligned, strided)
    assert "A" not in odd["attrs"] and "M" not in odd["attrs"] and "B" in odd["attrs"], odd
    for name in ("aligned", "odd", "strided"):  # the fallback rule agrees with Triton's binder
        sig, consts, attrs = out[f"spec/{name}/rule"]
        assert (attrs, consts) == (out[f"spec/{name}"]["attrs"], out[f"spec/{name}"]["consts"]), name
    # the specialisation is what pipelines the loads: without it the same launch has no cp.async at all
    assert aligned["cp_async"] > 0 and out["spec/bare_cp_async"] == 0, (aligned, out["spec/bare_cp_async"])


def test_gate_fails_on_a_planted_fp64_scalar(gate_run):
    out = gate_run
    assert out["_loop_kernel/fp32"]["ok"], out["_loop_kernel/fp32"]  # an eager launch types the float fp32
    bad = out["_loop_kernel/fp64"]  # Inductor's typing: the H100's error, here on the CPU
    assert not bad["ok"] and "Loop-carried variable m" in bad["why"] and "fp64" in bad["why"], bad
    leak = out["_leak_kernel/fp64"]  # compiles, but computes in fp64: caught in the TTIR
    assert not leak["ok"] and "leaks" in leak["why"], leak
    assert out["_fixed_kernel/fp64"]["ok"] and out["_fixed_kernel/fp32"]["ok"], out


def test_gate_fails_on_shared_memory_over_the_block_limit(gate_run):
    out = gate_run
    for key, limit in (("smem", 232448), ("smem/sm80", 166912)):
        assert not out[key]["ok"] and "shared memory" in out[key]["why"] and out[key]["shared"] > limit, out[key]
    assert out["good/sm80"]["ok"] and out["good/sm80"]["shared"] <= 166912, out["good/sm80"]


def test_a_good_gpu_tile_passes(gate_run):
    good = gate_run["good"]
    assert good["ok"] and good["wgmma"] > 0 and good["mma_sync"] == 0 and not good["replicated"], good
    assert good["n_spills"] == 0 and good["n_regs"] > 0, good
    assert gate_run["chain_128"]["ok"], gate_run["chain_128"]


def test_gate_fails_on_a_dot_off_wgmma(gate_run):
    out = gate_run
    for key in ("mma_sync_64", "mma_sync_32"):
        assert not out[key]["ok"] and "mma.sync" in out[key]["why"] and out[key]["wgmma"] == 0, out[key]
        assert out[key]["mma_sync"] > 0, out[key]
    assert "M-tile 32 < 64" in out["mma_sync_32"]["why"], out["mma_sync_32"]
    assert out["mma_sync_32_stated"]["ok"], out["mma_sync_32_stated"]  # MMA_SYNC_OK states why
    assert "MMA_SYNC_OK" not in out["mma_sync_64"]["why"], out["mma_sync_64"]  # 64+ rows: no excuse


def test_gate_fails_on_a_replicated_mma_layout(gate_run):
    bad = gate_run["replicated"]
    assert not bad["ok"] and bad["replicated"] and "the warpgroups compute the same rows" in bad["why"], bad
    assert "[8, 1]" in bad["why"], bad


def test_gate_fails_on_an_fp8_dot_past_its_promotion_interval(gate_run):
    out = gate_run
    bad = out["fp8_unbounded"]  # stated BLOCK_K = 128, the accumulator is never promoted
    assert not bad["ok"] and "more than the stated 128" in bad["why"] and bad["interval"] == 2**30, bad
    assert out["fp8_128"]["ok"] and out["fp8_128"]["interval"] == 128, out["fp8_128"]
    assert out["fp8_fresh"]["ok"] and out["fp8_fresh"]["interval"] == 128, out["fp8_fresh"]
    long = out["fp8_fresh_256"]  # a fresh dot over 256 products, stated 128
    assert not long["ok"] and long["interval"] == 256 and "more than the stated 128" in long["why"], long
    none = out["fp8_unstated"]
    assert not none["ok"] and "no PROMOTION_INTERVAL" in none["why"], none


@pytest.fixture(scope="module")
def examples_run(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    capture = ["capture"] if os.environ.get("MINITE_RECORD_LAUNCHES") else []  # make test: the gate compiles them
    text = _run(["-c", EXAMPLES, *capture], {}, tmp_path_factory.mktemp("examples"), timeout=1800)
    return text, json.loads(text.split("RESULT ", 1)[1])


def test_every_familys_gpu_tiles_pass_the_gate(examples_run):
    text, out = examples_run
    from minite.gpu_examples import FAMILIES
    assert out["families"] == sorted(FAMILIES), out  # every family captured something
    assert out["n"] >= 60, out
    assert out["upcast"] == [False], out  # the flags a GPU sets, not the interpreter's (bf16 upcast)
    failures = "\n".join(ln for ln in text.splitlines() if ln.startswith("FAIL"))
    assert out["fails"] == 0, failures[-6000:]
