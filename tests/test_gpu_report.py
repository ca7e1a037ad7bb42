"""make gpu-report (benchmarks/gpu_report.py) on the CPU: its refusal, its time limits, and the parts that read what
the stages print (the main job's closing line, the suite's per-test lines, the benchmarks' peer ratios)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_report as gr  # noqa: E402


def test_without_a_gpu_it_says_so_and_lists_every_stage_with_its_limit():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert "make gpu-report needs an NVIDIA GPU (CUDA), and this machine has none" in out.stderr
    for stage in gr.STAGES:
        assert f"  {stage.name:9s} {stage.limit_s:4d} s  {stage.what}" in out.stderr
    for script, args, seconds in gr.BENCHES:
        assert f"{gr.bench_name(script, args):17s} {seconds:3d} s" in out.stderr
    assert "at most 540 s (9 minutes)" in out.stderr


def test_every_stage_and_benchmark_has_a_time_limit_and_they_fit_in_9_minutes():
    assert sum(s.limit_s for s in gr.STAGES) + gr.PACK_S <= gr.TOTAL_S == 9 * 60
    assert all(s.limit_s > 0 for s in gr.STAGES) and set(gr.RUNNERS) == {s.name for s in gr.STAGES}
    bench = next(s for s in gr.STAGES if s.name == "bench")
    assert sum(b[2] for b in gr.BENCHES) <= bench.limit_s and all(b[2] > 0 for b in gr.BENCHES)
    scripts = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    covered = {b[0] for b in gr.BENCHES} | set(gr.NOT_RUN)
    assert scripts == covered, f"benchmarks neither run nor excluded with a reason: {scripts - covered}"
    # the summary names every stage with its limit, whatever happened to it
    results = [{"rc": 0, "seconds": 3.0, "limit_s": 15}, {"rc": 1, "seconds": 9.0, "limit_s": 60},
               {"rc": -2, "seconds": 170.0, "limit_s": 170, "timed_out": True}, {"rc": None, "skipped": "no time left"},
               {"rc": 0, "seconds": 99.0, "limit_s": 185, "note": "12 ok"}]
    report = {"date": "today", "commit": "abc", "elapsed_s": 300.0, "facts": {"device": "NVIDIA H200"},
              "stages": {s.name: r for s, r in zip(gr.STAGES, results)}}
    md = gr.render(report)
    for s in gr.STAGES:
        assert f"| {s.name} | {s.limit_s} (ran under " in md
    assert "TIMED OUT" in md and "skipped: no time left" in md and "rc 1" in md


@pytest.mark.parametrize("compiled", [True, False])
def test_the_main_stage_reads_the_closing_line_that_train_prints(compiled):
    from minite.train import closing_line
    s = {"val_loss": 1.5446, "best_val_loss": 1.4908, "steps": 1000, "wall_time_s": 38.2, "train_time_s": 20.5,
         "tokens_per_s": 1_650_000.4, "first_step_s": 11.94, "steady_steps": 999, "steady_time_s": 9.9,
         "compile": "reduce-overhead" if compiled else "off", "compile_time_s": 9.81, "compile_graphs": 4}
    got = gr.parse_main(closing_line(s))
    assert got == {"val_loss": 1.5446, "best_val_loss": 1.4908, "steps": 1000, "wall_s": 38.2, "first_step_s": 11.9,
                   "compile_s": 9.8 if compiled else 0.0, "graphs": 4 if compiled else 0,
                   "steady_tokens_per_s": 1_650_000, "steady_steps": 999, "steady_s": 9.9}
    assert math.isnan(gr.parse_main(closing_line({**s, "first_step_s": math.nan}))["first_step_s"])


def test_peer_ratios_pair_each_minite_row_with_every_peer_at_the_same_point():
    rows = [{"impl": "minite triton", "D": 128, "causal": True, "mode": "fwd", "ms": 2.0, "TFLOPs": 250.0},
            {"impl": "sdpa flash", "D": 128, "causal": True, "mode": "fwd", "ms": 1.6, "TFLOPs": 306.0},
            {"impl": "sdpa cudnn", "D": 128, "causal": True, "mode": "fwd", "ms": 1.0, "TFLOPs": 500.0},
            {"impl": "sdpa flash", "D": 128, "causal": False, "mode": "fwd", "ms": 1.0},  # no minite row here
            {"impl": "minite triton", "D": 64, "causal": True, "mode": "fwd", "ms": None}]  # failed: no ratio
    assert gr.peer_ratios(rows) == ["D=128 causal=True mode=fwd minite triton: 0.80x sdpa flash, 0.50x sdpa cudnn"]


def test_the_suite_plugin_writes_each_test_as_it_finishes(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'planted'\n"
        "def test_skip():\n    pytest.skip('no')\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('fixture')\n"
        "def test_error(broken):\n    pass\n")
    log = tmp_path / "suite.jsonl"
    env = {**os.environ, "GPU_REPORT_TESTS": str(log), "PYTHONPATH": str(ROOT / "benchmarks")}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_report",
                    str(tmp_path / "test_planted.py")], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    rows = {r["nodeid"].split("::")[-1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert {k: r["outcome"] for k, r in rows.items()} == {"test_ok": "passed", "test_bad": "failed",
                                                           "test_skip": "skipped", "test_error": "error"}
    assert "planted" in rows["test_bad"]["message"]
    summary = gr.summarize_tests(log)
    assert summary["counts"] == {"library": {"passed": 1, "failed": 1, "error": 1, "skipped": 1}}
    assert len(summary["failures"]) == 2
