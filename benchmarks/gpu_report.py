"""``make gpu-report [OUT=DIR]``: everything measured on one GPU in at most 9 minutes (DESIGN.md section 10).

For a machine lent for a few minutes: a bare H100/H200 with torch and triton preinstalled and no network. Run from
the repository's root; it installs nothing from the network. Wheels carried beside the repository in ``.whl/``
(the notebook stack, Liger-Kernel: ``--fetch-wheels`` downloads them on a machine with a network) are installed
offline into a folder of its own; minite runs from the repository through PYTHONPATH, as after ``pip install -e .``,
with nothing installed (every subprocess, notebook kernel and torchrun rank inherits it).

Stages, in order, each under its own time limit (a stage that ends early leaves its time to the next; the last
ones are cut to keep the whole under 9 minutes); what finished is written even if a later stage fails:

    env       versions, the GPU, the carried wheels, what is importable
    main      the main job's default command (python -m minite.train): time to the first step, compile time,
              steady-state tokens/s, final val loss
    suite     pytest on CUDA over the cores: the library, the distributed tests (more ranks than GPUs), the
              notebooks (with nbval carried), the grading
    gpt_step  benchmarks/bench_gpt_step.py: minite's GPT step vs a nanoGPT-shaped model at the gpu preset (6x384)
              and at GPT-2 124M, with MFU
    bench     every other benchmark beside its peers, each under its own limit

Output: every benchmark's JSON and PNG in benchmarks/results/ (named by device), and in OUT (default out/gpu-report)
three files: summary.md (one page: every ratio against its peer, pass/fail counts, what timed out), summary.json,
and gpu-report-<device>.tgz with everything else (logs, the results, the suite's per-test lines).

    python benchmarks/gpu_report.py [--out DIR] [--stages main gpt_step] [--list] [--fetch-wheels]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TOTAL_S = 540  # 9 minutes, everything included
PACK_S = 10  # kept back for the summary and the archive
GRACE_S = 8  # a stage at its limit gets SIGINT (pytest writes what it has), then SIGKILL after this


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int
    what: str


STAGES = (
    Stage("env", 20, "versions, the GPU, carried wheels (.whl/) installed offline, what imports"),
    Stage("main", 75, "python -m minite.train (defaults): first step, compile time, steady tokens/s, final val"),
    Stage("suite", 145, "pytest on CUDA, one worker per core: library, distributed, notebooks, grading"),
    Stage("gpt_step", 100, "GPT step vs nanoGPT-shaped plain PyTorch: 6x384 (gpu preset) and GPT-2 124M, MFU"),
    Stage("bench", 190, "every other benchmark beside its peers, each under its own limit (below)"),
)
# (script, arguments, seconds): the issue-33 shapes, few enough to fit; the limits add up to the bench stage's
BENCHES = (
    ("bench_attention.py", ["--dims", "64", "128", "--seqlens", "4096"], 40),
    ("bench_attention.py", ["--decode", "--lengths", "256", "--n_layer", "12", "--n_embd", "768", "--n_head", "12",
                            "--n_kv_head", "4"], 45),  # two Inductor graphs now: minite's step and the peer's
    ("bench_lora.py", ["--ranks", "8", "64"], 18),
    ("bench_fp8_block.py", ["--sizes", "8192"], 12),
    ("bench_fp8_gemm.py", ["--sizes", "8192", "--error-ks", "4096", "--no-linear"], 12),
    ("bench_grouped_gemm.py", [], 12),
    ("bench_rmsnorm.py", ["--cols", "4096", "16384"], 15),
    ("bench_swiglu.py", ["--hidden", "4096", "14336"], 9),
    ("bench_cross_entropy.py", ["--vocab", "50304"], 10),
    ("bench_softmax.py", ["--cols", "4096", "16384"], 6),
    ("bench_rope.py", ["--head-dims", "128"], 6),
    ("bench_recompute.py", ["--device", "cuda"], 5),
)
NOT_RUN = {  # benchmarks this report leaves out, and why
    "bench_gpt_step.py": "its own stage (gpt_step)",
    "bench_scale.py": "chapter 14 on the CPU (make scale); nothing in it runs on a GPU",
    "bench_train.py": "a training run: the main stage runs the main job itself",
    "bench_pp_schedules.py": "chapter 12's schedules, simulated and measured on CPU ranks over gloo (no GPU part)",
}
# The notebook stack and Liger-Kernel, carried as wheels (python 3.12, manylinux x86-64) for a machine without them
WHEELS = ("nbval", "nbformat", "nbclient", "jupyter_client", "jupyter_core", "ipykernel", "ipython", "jupytext",
          "ipython_pygments_lexers", "traitlets", "pyzmq", "tornado", "comm", "debugpy", "matplotlib-inline",
          "mdit-py-plugins", "fastjsonschema", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
          "attrs", "nest-asyncio", "platformdirs", "pexpect", "ptyprocess", "prompt_toolkit", "jedi", "parso",
          "decorator", "stack-data", "executing", "asttokens", "pure_eval", "wcwidth", "liger-kernel")


def bench_name(script: str, args: list[str]) -> str:
    return script.removeprefix("bench_").removesuffix(".py") + ("_decode" if "--decode" in args else "")


def plan_text() -> str:
    lines = [f"  {s.name:9s} {s.limit_s:4d} s  {s.what}" for s in STAGES]
    lines += [f"     {bench_name(b[0], b[1]):17s} {b[2]:3d} s  {' '.join(b[1])}" for b in BENCHES]
    total = sum(s.limit_s for s in STAGES)
    return "\n".join(lines + [f"  total     {total} s of stages + {PACK_S} s for the report = at most {TOTAL_S} s "
                              "(9 minutes)"])


def cuda_device() -> str | None:
    """The GPU's name, or None where torch is missing or sees no CUDA device."""
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no torch, a broken driver: no GPU to measure on
        return None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ running
class Clock:
    """Stage i may run until start + the limits of stages 0..i (time a stage leaves goes to the next), never past
    the whole report's end."""

    def __init__(self, budget_s: float = TOTAL_S - PACK_S):
        self.start = time.monotonic()
        self.end = self.start + budget_s
        self.scheduled = self.start

    def window(self, limit_s: float) -> float:
        self.scheduled += limit_s
        return max(0.0, min(self.scheduled, self.end) - time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def run(cmd: list[str], limit_s: float, log: Path, env: dict) -> dict:
    """Run cmd (its own process group, output to log) for at most limit_s; then SIGINT, and SIGKILL GRACE_S later."""
    t0, timed_out = time.monotonic(), False
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, limit_s - min(GRACE_S, limit_s / 4)))
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal(p.pid, signal.SIGINT)
            try:
                rc = p.wait(timeout=min(GRACE_S, limit_s / 4))
            except subprocess.TimeoutExpired:
                _signal(p.pid, signal.SIGKILL)
                rc = p.wait()
        _signal(p.pid, signal.SIGKILL)  # whatever it left behind (pytest workers, torchrun ranks)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out, "limit_s": round(limit_s)}


def _signal(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, n: int = 3) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()] if path.exists() else []
    return " / ".join(x.strip()[:160] for x in lines[-n:])


# ------------------------------------------------------------------------------------------------ the stages
def stage_env(ctx: dict, limit: float) -> dict:
    env, work, py, t0 = ctx["env"], ctx["work"], sys.executable, time.monotonic()
    log, out = work / "env.log", {}
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if wheels:
        site = work / "site"
        r = run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                 "--target", str(site), *map(str, wheels)], limit * 2 / 3, log, env)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
        out["wheels"] = {"count": len(wheels), "rc": r["rc"], "seconds": r["seconds"]}
    probe = ("import json, importlib, importlib.metadata as md, torch, triton, platform\n"
             "mods = ['minite', 'pytest', 'xdist', 'pytest_timeout', 'nbval', 'ipykernel', 'jupytext', 'liger_kernel', "
             "'matplotlib']\n"
             "def has(m):\n    try:\n        importlib.import_module(m); return True\n    except Exception:\n"
             "        return False\n"
             "p = torch.cuda.get_device_properties(0)\n"
             "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
             "'triton': triton.__version__, 'cuda': torch.version.cuda, 'device': p.name, "
             "'capability': list(torch.cuda.get_device_capability(0)), 'sms': p.multi_processor_count, "
             "'memory_gib': round(p.total_memory / 2**30, 1), 'cpus': __import__('os').cpu_count(), "
             "'importable': {m: has(m) for m in mods}}))\n")
    res = subprocess.run([py, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=max(5.0, limit - (time.monotonic() - t0)))
    with open(log, "a") as f:
        f.write(res.stdout + res.stderr)
    out.update(json.loads(res.stdout.strip().splitlines()[-1]))
    smi = shutil.which("nvidia-smi")
    if smi:
        out["nvidia_smi"] = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout.strip()
    ctx["facts"] = out
    (work / "env.json").write_text(json.dumps(out, indent=1))
    missing = [m for m, ok in out["importable"].items() if not ok]
    return {"rc": 0, "seconds": round(time.monotonic() - t0, 1),
            "note": "not importable: " + ", ".join(missing) if missing else "everything importable"}


MAIN_RE = {
    "compile_s": r"compiled in (\d+\.\d) s \((\d+) graphs\); first step done (\d+\.\d) s",
    "closing": r"val loss (\d+\.\d+) \(best (\d+\.\d+)\) after (\d+) steps \| (\d+\.\d) s wall, first step at "
               r"(\d+\.\d|nan) s \| (compile off|compile (\d+\.\d) s \((\d+) graphs, [^)]*\)) \| ([\d,]+) tokens/s "
               r"steady \((\d+) steps, (\d+\.\d) s\)",
}


def parse_main(text: str) -> dict:
    """The main job's numbers, read off its closing line (minite.train.closing_line)."""
    m = re.search(MAIN_RE["closing"], text)
    if not m:
        return {}
    return {"val_loss": float(m[1]), "best_val_loss": float(m[2]), "steps": int(m[3]), "wall_s": float(m[4]),
            "first_step_s": float(m[5]), "compile_s": float(m[7]) if m[7] else 0.0,
            "graphs": int(m[8]) if m[8] else 0, "steady_tokens_per_s": int(m[9].replace(",", "")),
            "steady_steps": int(m[10]), "steady_s": float(m[11])}


def stage_main(ctx: dict, limit: float) -> dict:
    work = ctx["work"]
    data, note = [], "the default corpus (data/shakespeare-char, carried)"
    if os.environ.get("MAIN_DATA"):
        data, note = ["--data", os.environ["MAIN_DATA"]], f"--data {os.environ['MAIN_DATA']}"
    elif not (ROOT / "data" / "shakespeare-char" / "meta.json").exists():  # the default corpus needs the network
        data, note = ["--data", "pydoc-topics"], ("--data pydoc-topics: the default corpus was not carried (carry "
                                                  "data/ after one `make train` here)")
    cmd = [sys.executable, "-m", "minite.train", *data, "--train.out_dir", str(work / "main_out"),
           "--train.overwrite=True"]
    r = run(cmd, limit, work / "main.log", ctx["env"])
    numbers = parse_main((work / "main.log").read_text(errors="replace"))
    ctx["main"] = {"command": " ".join(["python -m minite.train", *data]), "data": note, **numbers}
    (work / "main.json").write_text(json.dumps(ctx["main"], indent=1))
    return {**r, "note": note}


GROUPS = (("distributed", "tests/parallel/"), ("grading", "tests/test_grading"), ("notebooks", "notebooks/"),
          ("library", ""))


def group_of(nodeid: str) -> str:
    return next(g for g, prefix in GROUPS if nodeid.startswith(prefix))


def stage_suite(ctx: dict, limit: float) -> dict:
    work, env = ctx["work"], dict(ctx["env"])
    have = ctx.get("facts", {}).get("importable", {})
    if not have.get("xdist", True) or not have.get("pytest", True):
        return {"rc": None, "skipped": "pytest / pytest-xdist not importable"}
    workers = max(1, min(14, (os.cpu_count() or 2) - 2))
    targets = ["tests"] + (["--timeout=150"] if have.get("pytest_timeout") else [])  # a hung test frees its worker
    note = f"{workers} workers"
    if have.get("nbval", False):
        targets += ["notebooks", "--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=120"]
    else:
        note += "; notebooks not run: nbval is not installed (carry the wheels: --fetch-wheels)"
    env.update(OMP_NUM_THREADS="1", GPU_REPORT_TESTS=str(work / "suite.jsonl"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), env["PYTHONPATH"]]))
    cmd = [sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadfile", "-p", "no:cacheprovider",
           "-p", "gpu_report", "-q", "-rfE", "--durations=20", *targets]
    r = run(cmd, limit, work / "suite.log", env)
    ctx["suite"] = summarize_tests(work / "suite.jsonl")
    return {**r, "note": note}


def summarize_tests(path: Path) -> dict:
    counts, failures = {}, []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    for row in rows:
        c = counts.setdefault(group_of(row["nodeid"]), {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
        c[row["outcome"]] += 1
        if row["outcome"] in ("failed", "error"):
            failures.append(f"{row['nodeid']}: {row['message']}")
    return {"counts": counts, "failures": failures}


# pytest plugin (-p gpu_report): every finished test as a JSON line in $GPU_REPORT_TESTS, written by the controller
# as the results come in, so that a suite stopped at its time limit still counts what finished.
def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_REPORT_TESTS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or (report.outcome != "passed" and report.when == "setup") or \
            (report.outcome == "failed" and report.when == "teardown"):
        outcome = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
        if hasattr(report, "wasxfail"):
            outcome = "skipped" if report.outcome == "skipped" else "passed"
        message = (str(report.longrepr).strip().splitlines() or [""])[-1][:200] if report.failed else ""
        with open(path, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2),
                                "message": message}) + "\n")


def pytest_collectreport(report):
    if report.failed and os.environ.get("GPU_REPORT_TESTS") and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.environ["GPU_REPORT_TESTS"], "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": "error", "seconds": 0.0, "message": "collection: "
                                + (str(report.longrepr).strip().splitlines() or [""])[-1][:180]}) + "\n")


def stage_gpt_step(ctx: dict, limit: float) -> dict:
    return run([sys.executable, "benchmarks/bench_gpt_step.py"], limit, ctx["work"] / "gpt_step.log", ctx["env"])


def stage_bench(ctx: dict, limit: float) -> dict:
    clock, done = Clock(limit), []
    for script, args, seconds in BENCHES:
        name = bench_name(script, args)
        window = clock.window(seconds)
        if window < 3:
            done.append({"bench": name, "rc": None, "skipped": "no time left"})
            continue
        r = run([sys.executable, f"benchmarks/{script}", *args], window, ctx["work"] / f"bench_{name}.log", ctx["env"])
        done.append({"bench": name, **r, "tail": "" if r["rc"] == 0 else tail(ctx["work"] / f"bench_{name}.log")})
    ctx["benches"] = done
    bad = [d["bench"] for d in done if d["rc"] != 0]
    return {"rc": 0 if not bad else 1, "note": f"not ok: {', '.join(bad)}" if bad else f"{len(done)} ok"}


RUNNERS = {"env": stage_env, "main": stage_main, "suite": stage_suite, "gpt_step": stage_gpt_step,
           "bench": stage_bench}


# ------------------------------------------------------------------------------------------------ the summary
MEASURED = {"impl", "ms", "ms_per_step", "ms_per_token", "params", "flops_per_token", "counts", "timer", "peak_gib",
            "bytes"}


def peer_ratios(rows: list) -> list[str]:
    """For every minite row, peer time / minite time against every other implementation measured at the same
    point (the same non-measured fields): above 1 = minite faster."""
    groups: dict = {}
    for r in rows:
        ms = next((r[k] for k in ("ms", "ms_per_step", "ms_per_token") if k in r), None) if isinstance(r, dict) \
            else None
        if not isinstance(ms, (int, float)) or ms <= 0 or "impl" not in r:
            continue
        key = tuple((k, v) for k, v in r.items() if k not in MEASURED and isinstance(v, (str, int, bool))
                    and not isinstance(v, float))
        groups.setdefault(key, []).append((str(r["impl"]), ms))
    lines = []
    for key, impls in groups.items():
        peers = [(i, ms) for i, ms in impls if "minite" not in i.lower()]
        for name, ms in (x for x in impls if "minite" in x[0].lower()):
            if peers:
                where = " ".join(f"{k}={v}" for k, v in key if k not in ("dtype", "table"))
                lines.append(f"{where} {name}: " + ", ".join(f"{p_ms / ms:.2f}x {p}" for p, p_ms in peers))
    return lines


def collect_results(since: float, work: Path) -> list[Path]:
    """The benchmarks' JSON/PNG written during this report, copied into the report's folder."""
    (work / "results").mkdir(exist_ok=True)
    fresh = [p for p in sorted(RESULTS.glob("*")) if p.is_file() and p.stat().st_mtime >= since]
    for p in fresh:
        shutil.copy2(p, work / "results" / p.name)
    return fresh


def render(report: dict) -> str:
    """summary.md: one page."""
    f = report.get("facts", {})
    lines = [f"# minite GPU report: {f.get('device', '?')}",
             f"{report['date']}, commit {report['commit']}; torch {f.get('torch', '?')}, "
             f"triton {f.get('triton', '?')}, CUDA {f.get('cuda', '?')}, Python {f.get('python', '?')}; "
             f"{report['elapsed_s']:.0f} s of {TOTAL_S} s",
             "", "| stage | limit s | took s | result |", "|---|---|---|---|"]
    limits = {s.name: s.limit_s for s in STAGES}
    for name, st in report["stages"].items():
        if st.get("skipped"):
            status = f"skipped: {st['skipped']}"
        else:
            status = "TIMED OUT" if st.get("timed_out") else "ok" if st.get("rc") == 0 else f"rc {st.get('rc')}"
        note = f"; {st['note'][:240]}" if st.get("note") else ""
        lines.append(f"| {name} | {limits.get(name, '?')} (ran under {st.get('limit_s', '-')}) | "
                     f"{st.get('seconds', '-')} | {status}{note} |")
    m = report.get("main")
    if m:
        lines += ["", f"## Main job: `{m.get('command', '')}` ({m.get('data', '')})"]
        if "first_step_s" in m:
            lines.append(f"first step at **{m['first_step_s']} s** (target <= 15) | compile {m['compile_s']} s "
                         f"({m['graphs']} graphs) | **{m['steady_tokens_per_s']:,} tokens/s** steady "
                         f"({m['steady_steps']} steps in {m['steady_s']} s) | val {m['val_loss']} (best "
                         f"{m['best_val_loss']}) after {m['steps']} steps | {m['wall_s']} s wall")
        else:
            lines.append("no closing line: see main.log in the archive")
    s = report.get("suite")
    if s:
        lines += ["", "## Suite on CUDA", "| group | passed | failed | errors | skipped |", "|---|---|---|---|---|"]
        for g, c in sorted(s["counts"].items()):
            lines.append(f"| {g} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |")
        lines += [f"- {x}" for x in s["failures"][:12]]
        if len(s["failures"]) > 12:
            lines.append(f"- ... {len(s['failures']) - 12} more in suite.jsonl")
    ratios = report.get("ratios", {})
    if ratios:
        lines += ["", "## Speed against each peer (peer time / minite time: above 1 = minite faster)"]
        lines += ["GPT step: MFU = tokens/s x (6N + 12 L C T) / 989 TFLOP/s (dense bf16 H100/H200); issue 33's "
                  "target: minite's step <= 0.9x nanoGPT's time, i.e. >= 1.11 here"] if "gpt_step" in ratios else []
        for name, rs in ratios.items():
            lines.append(f"- **{name}**: " + "; ".join(rs) if rs else f"- **{name}**: no minite row beside a peer")
    for b in report.get("benches", []):
        if b.get("rc") != 0:
            what = b.get("skipped") or ("timed out" if b.get("timed_out") else f"rc {b['rc']}")
            lines.append(f"- {b['bench']}: {what} {b.get('tail', '')[:200]}")
    lines += ["", f"Not run here: {'; '.join(f'{k}: {v}' for k, v in NOT_RUN.items())}"]
    return "\n".join(lines) + "\n"


def gpt_step_lines(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    out = []
    for r in data.get("results", []):
        if r.get("impl") == "nanoGPT":
            continue
        peer = f", nanoGPT {r['peer_ms']:.2f} ms MFU {100 * r['peer_mfu']:.1f}%: time ratio {r['ratio_time']:.3f}" \
            if "ratio_time" in r else ""
        out.append(f"{r['shape']} {r['impl']} {r['ms']:.2f} ms MFU {100 * r['mfu']:.1f}% (first step "
                   f"{r['first_step_s']:.1f} s){peer}")
    return out + [f"{f['shape']} {f['impl']} FAILED {f['error'][:120]}" for f in data.get("failed", [])]


def finish(report: dict, ctx: dict, out: Path, since: float) -> Path:
    work = ctx["work"]
    fresh = collect_results(since, work)
    ratios = {}
    for p in fresh:
        if p.suffix == ".json":
            try:
                data = json.loads(p.read_text())
                rows = data.get("results", []) if isinstance(data, dict) else []
                ratios[p.stem] = gpt_step_lines(p) if p.stem.startswith("gpt_step") else peer_ratios(rows)
            except (ValueError, KeyError, TypeError) as e:
                ratios[p.stem] = [f"(unreadable: {type(e).__name__}: {e})"]
    # backend="auto"'s choice table follows the results just recorded (tools/derive_choices.py): the archive
    # carries the regenerated minite/choices.py beside benchmarks/results (tests/test_backend_choice.py fails on a
    # table older than the committed results)
    derive = subprocess.run([sys.executable, str(ROOT / "tools" / "derive_choices.py")], cwd=ROOT,
                            capture_output=True, text=True)
    if (ROOT / "minite" / "choices.py").exists():
        shutil.copy2(ROOT / "minite" / "choices.py", work / "choices.py")
    ctx.setdefault("facts", {})["choices"] = "regenerated" if derive.returncode == 0 else \
        f"derive_choices failed: {(derive.stderr or derive.stdout)[-200:]}"
    report.update(ratios=ratios, main=ctx.get("main"), suite=ctx.get("suite"), benches=ctx.get("benches", []),
                  facts=ctx.get("facts", {}), elapsed_s=ctx["clock"].elapsed())
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(render(report))
    (out / "summary.json").write_text(json.dumps(report, indent=1, default=str))
    shutil.copy2(out / "summary.md", work / "summary.md")
    archive = out / f"gpu-report-{slug(report['facts'].get('device', 'gpu'))}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work, arcname="gpu-report", filter=lambda t: None if t.name.endswith(".pt") or
                t.name.startswith("gpu-report/site") else t)  # no checkpoints, no installed wheels
    return archive


def fetch_wheels() -> int:
    """Download the WHEELS (the versions installed here when there are, else the newest) into .whl/, for python
    3.12 on manylinux x86-64 (the GPU machine's), no dependencies resolved: the list is the closure."""
    import importlib.metadata as md
    names = []
    for n in WHEELS:
        try:
            names.append(f"{n}=={md.version(n)}")
        except md.PackageNotFoundError:
            names.append(n)
    plats = [a for n in (39, 35, 34, 31, 28, 27, 24, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *plats, "--platform", "manylinux2014_x86_64", "--platform", "any",
           "-d", str(ROOT / ".whl"), *names]
    print(" ".join(cmd))
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "out" / "gpu-report"), help="where summary.md and the .tgz go")
    p.add_argument("--stages", nargs="+", default=[s.name for s in STAGES], choices=[s.name for s in STAGES])
    p.add_argument("--list", action="store_true", help="print the stages and their time limits, run nothing")
    p.add_argument("--fetch-wheels", action="store_true", help="download the carried wheels into .whl/ (network)")
    args = p.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels()
    if args.list:
        print(f"make gpu-report: stages and time limits\n{plan_text()}")
        return 0
    device = cuda_device()
    if device is None:
        print(f"make gpu-report needs an NVIDIA GPU (CUDA), and this machine has none (or torch sees none).\n"
              f"On a GPU machine it runs, each stage under its own time limit:\n{plan_text()}\n"
              "The CPU's checks are `make test` and `make check-fast`.", file=sys.stderr)
        return 2
    since = time.time() - 1
    work = Path(tempfile.mkdtemp(prefix="minite-gpu-report-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}
    env.pop("TRITON_INTERPRET", None)
    ctx = {"work": work, "env": env, "clock": Clock(), "facts": {"device": device}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit.strip() or "?", "stages": {}}
    print(f"gpu-report on {device}: work in {work}, summary to {args.out}\n{plan_text()}", flush=True)
    for stage in STAGES:
        window = ctx["clock"].window(stage.limit_s)
        if stage.name not in args.stages:
            continue
        print(f"== {stage.name} (up to {window:.0f} s): {stage.what}", flush=True)
        t0 = time.monotonic()
        try:
            result = RUNNERS[stage.name](ctx, window) if window >= 3 else {"rc": None, "skipped": "no time left"}
        except Exception as e:  # a stage that breaks is recorded; the others still run
            result = {"rc": None, "note": f"the stage broke: {type(e).__name__}: {str(e)[-300:]}"}
        result.setdefault("seconds", round(time.monotonic() - t0, 1))
        result["limit_s"] = round(window)
        report["stages"][stage.name] = result
        print(f"   {json.dumps(result)[:300]}", flush=True)
        finish(report, ctx, Path(args.out), since)  # after every stage: what finished is written
    archive = finish(report, ctx, Path(args.out), since)
    print((Path(args.out) / "summary.md").read_text())
    print(f"wrote {args.out}/summary.md, summary.json, {archive.name}")
    failed = [n for n, r in report["stages"].items() if r.get("rc") not in (0,)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
