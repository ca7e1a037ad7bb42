"""tools/check_notebooks.py: each check passes on a clean chapter and fails on the violation it plants."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minite.grading import BEGIN, END, generate_all

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import check_notebooks as cn  # noqa: E402

# A first code cell as every lesson and solution has one (tools/nbtool.setup_text): the interpreter only without a GPU.
SETUP = ('import os, torch\nif not torch.cuda.is_available():\n    os.environ["TRITON_INTERPRET"] = "1"\n'
         'from minite._triton import triton, tl\nDEVICE = "cuda" if torch.cuda.is_available() else "cpu"')
ANSWER = ("row = tl.program_id(0)\ncols = tl.arange(0, BLOCK)\nmask = cols < n\n"
          "x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)\n"
          "mean = tl.sum(x, axis=0) / n\nxc = tl.where(mask, x - mean, 0.0)\n"
          "var = tl.sum(xc * xc, axis=0) / n\ntl.store(Y + row * stride + cols, xc / tl.sqrt(var + eps), mask=mask)")


def _cell(src, **meta):
    c = nbformat.v4.new_code_cell(src)
    if meta:
        c.metadata["minite"] = meta
    return c


def _pair(path: Path, cells):
    """Write a jupytext pair path.ipynb + path.py with `cells`."""
    import jupytext
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path.with_suffix(".ipynb"))
    jupytext.write(nb, path.with_suffix(".py"), fmt="py:percent")


@pytest.fixture()
def chapter(tmp_path):
    """A clean chapter 42: lesson (RMSNorm, no answer in it), solution (LayerNorm), generated exercise."""
    indented = "\n".join("    " + ln for ln in ANSWER.splitlines())
    _pair(tmp_path / "notebooks" / "42_norm", [
        nbformat.v4.new_markdown_cell("# lesson"),
        _cell(SETUP),
        _cell("@triton.jit\ndef rms(X, Y, stride, n, eps, BLOCK: tl.constexpr):\n    row = tl.program_id(0)\n"
              "    x = tl.load(X + row * stride + tl.arange(0, BLOCK))\n    tl.store(Y, x * tl.rsqrt(eps))"),
    ])
    _pair(tmp_path / "solutions" / "42_norm", [
        _cell(SETUP),
        _cell(f"@triton.jit\ndef layernorm(X, Y, stride, n, eps, BLOCK: tl.constexpr):\n    {BEGIN}\n{indented}\n"
              f"    {END}", task="layernorm"),
        _cell("# CHECK: layernorm\nassert True\nprint('PASS: layernorm')", check="layernorm"),
    ])
    generate_all(tmp_path / "solutions", tmp_path / "exercises")
    return tmp_path


def test_a_clean_chapter_passes_every_check(chapter):
    for name, check in cn.CHECKS.items():
        assert check(chapter) == [], name
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_notebooks.py"), "--root", str(chapter)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("where", ["cell", "output"])
def test_copied_answer_fails(chapter, where):
    lesson = chapter / "notebooks" / "42_norm.ipynb"
    nb = nbformat.read(lesson, as_version=4)
    # the same answer, re-indented and commented: still a copy
    copied = "def f():\n" + "\n".join(f"        {ln}  # copied" for ln in ANSWER.splitlines())
    if where == "cell":
        nb.cells.append(_cell(copied))
    else:
        c = _cell("print(src)")
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=copied)]
        nb.cells.append(c)
    nbformat.write(nb, lesson)
    problems = cn.copied_answers(chapter)
    assert len(problems) == 1 and "task 'layernorm'" in problems[0], problems
    # half of it (the first lines only) is a shared prelude, not a copy
    nb.cells[-1] = _cell("\n".join(ANSWER.splitlines()[:3]))
    nbformat.write(nb, lesson)
    assert cn.copied_answers(chapter) == []


def test_unsynced_pair_fails(chapter):
    ipynb = chapter / "solutions" / "42_norm.ipynb"
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells[1].source += "\nassert 1 == 1"  # edited in the .ipynb only
    nbformat.write(nb, ipynb)
    problems = cn.pairs_out_of_sync(chapter)
    assert len(problems) == 1 and "solutions/42_norm" in problems[0] and "from cell 1" in problems[0], problems
    (chapter / "notebooks" / "42_norm.py").unlink()
    assert any("only 42_norm.ipynb exists" in p for p in cn.pairs_out_of_sync(chapter))


def test_task_metadata_change_unsyncs_a_pair(chapter):
    py = chapter / "solutions" / "42_norm.py"
    py.write_text(py.read_text().replace('"task": "layernorm"', '"task": "layernorm2"'))
    assert cn.pairs_out_of_sync(chapter)


def test_exercise_with_outputs_fails(chapter):
    ex = chapter / "exercises" / "42_norm_exercise.ipynb"
    nb = nbformat.read(ex, as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS: layernorm\n")]
    nb.cells[2].execution_count = 4
    nb.cells[1].source = nb.cells[1].source.replace("### BEGIN YOUR CODE", BEGIN)
    nbformat.write(nb, ex)
    problems = cn.exercises_with_outputs(chapter)
    assert any("check cell 2 carries outputs" in p for p in problems), problems
    assert any("holds a solution" in p for p in problems), problems
    assert cn.exercises_stale(chapter) == ["exercises/42_norm_exercise.ipynb: out of sync with solutions/ (run "
                                           "`make exercises`)"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_notebooks.py"), "--root", str(chapter)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "carries outputs" in out.stdout


# ------------------------------------------------------------------------ gpu_portability: runs on a GPU too
def _lesson(chapter, *sources, setup=SETUP):
    """Rewrite lesson 42 as `setup` + one code cell per source; returns the .py's text."""
    _pair(chapter / "notebooks" / "42_norm", [nbformat.v4.new_markdown_cell("# lesson"), _cell(setup),
                                              *(_cell(src) for src in sources)])
    return (chapter / "notebooks" / "42_norm.py").read_text()


def _line(text, needle):
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


KERNEL = ("@triton.jit\ndef mm(A, B, C, K: tl.constexpr):\n    a = tl.load(A + tl.arange(0, K))\n"
          "    # tl.dot(a, b) in a comment, and in a string below, is not a call\n    msg = 'tl.dot(a, b)'\n"
          "    acc = tl.dot(a, b, acc{})\n")


def test_tl_dot_must_state_its_input_precision(chapter):
    text = _lesson(chapter, KERNEL.format(""))
    assert cn.gpu_portability(chapter) == [
        f"notebooks/42_norm.py:{_line(text, 'acc = tl.dot')}: (cell 1) tl.dot without input_precision=: \"ieee\" "
        "for exact fp32 products (a GPU multiplies fp32 tiles in TF32 by default), or \"tf32\""]
    for prec in ("ieee", "tf32"):
        _lesson(chapter, KERNEL.format(f', input_precision="{prec}"'))
        assert cn.gpu_portability(chapter) == []


@pytest.mark.parametrize("bad, what", [
    ('x = torch.randn(4, 8)\ny = softmax(x, backend="triton")', ["randn"]),
    # 02_fp8 cell 4 on the H100: .to(dtype) names no device
    ('x = (torch.randn(37, 129) * torch.logspace(-5, 3, 129)).to(torch.bfloat16)\n'
     'x[0, :3] = torch.tensor([float("inf"), -1e9, 0.0]).to(torch.bfloat16)\n'
     'a = quantize(x, 7.5, backend="triton")', ["randn", "logspace", "tensor"]),
    # 02_fp8 cell 10: the forced call sits in a lambda, the CPU tensors are check_op's arguments
    ('x = torch.randn(3, 7)\nassert check_op("f", lambda x: f(x, backend="triton"), f_ref, x)', ["randn"]),
    ('with minite.use_backend("triton"):\n    y = model(torch.zeros(2, 3, dtype=torch.long))', ["zeros"]),
    ('x = torch.randn(4, 8).to("cpu")\ny = softmax(x, backend="triton")', ["randn"]),
])
def test_forcing_triton_on_cpu_tensors_fails(chapter, bad, what):
    text = _lesson(chapter, bad)
    problems = cn.gpu_portability(chapter)
    assert len(problems) == len(what), problems
    for name in what:
        assert any(f"torch.{name}(...) makes a CPU tensor in a cell that forces backend='triton'" in p
                   and p.startswith(f"notebooks/42_norm.py:{_line(text, 'torch.' + name + '(')}: (cell 1)")
                   for p in problems), (name, problems)


@pytest.mark.parametrize("good", [
    'x = torch.randn(4, 8).to(DEVICE)\ny = softmax(x, backend="triton")',
    'x = (torch.randn(37, 129) * torch.logspace(-5, 3, 129)).to(DEVICE, torch.bfloat16)\n'
    'x[0, :3] = torch.tensor([float("inf"), -1e9, 0.0]).to(DEVICE, torch.bfloat16)\n'
    'a = quantize(x, 7.5, backend="triton")',
    'x = torch.randn(3, 7, device=DEVICE)\nassert check_op("f", lambda x: f(x, backend="triton"), f_ref, x)',
    'x = torch.arange(10, device="cpu")  # a reference kept on the CPU on purpose\n'
    'y = f(x.float().to(device=DEVICE), backend="triton")',
    'w = torch.ones(3).float().cuda()\nv = torch.zeros(3)[None].to(w.device)\ny = f(w, v, backend="triton")',
    'x = torch.randn(4, 8)\ny = softmax(x)  # auto: the torch reference on CPU tensors when no interpreter runs',
])
def test_forcing_triton_on_placed_tensors_passes(chapter, good):
    _lesson(chapter, good)
    assert cn.gpu_portability(chapter) == []


def test_forcing_triton_needs_device_in_the_first_cell(chapter):
    text = _lesson(chapter, 'y = f(x, backend="triton")', setup=SETUP.replace("DEVICE =", "DEV ="))
    assert cn.gpu_portability(chapter) == [f"notebooks/42_norm.py:{_line(text, 'y = f(x')}: (cell 1) forces "
                                           "backend='triton', but the first code cell defines no DEVICE"]


def test_interpreter_only_in_the_guarded_first_cell(chapter):
    # 11_tensor_parallel cell 5 on the H100: the workers were sent to the interpreter on a GPU machine
    text = _lesson(chapter, 'res = torchrun(2, ["-m", "x"], env={"TRITON_INTERPRET": "1"})')
    assert cn.gpu_portability(chapter) == [
        f"notebooks/42_norm.py:{_line(text, 'res = torchrun')}: (cell 1) sets TRITON_INTERPRET: only the first cell "
        "does, and only without a GPU (torchrun's launcher decides for its workers)"]
    for setup in ('import os, torch\nos.environ["TRITON_INTERPRET"] = "1"',  # unconditional: a GPU machine too
                  'import os, torch\nimport minite\nif not torch.cuda.is_available():\n'
                  '    os.environ["TRITON_INTERPRET"] = "1"'):                  # after minite imported triton
        _lesson(chapter, "x = 1", setup=setup)
        problems = cn.gpu_portability(chapter)
        assert any("(cell 0) the first code cell must set TRITON_INTERPRET under" in p for p in problems), problems
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_notebooks.py"), "--root", str(chapter),
                          "--only", "gpu"], capture_output=True, text=True)
    assert out.returncode == 1 and "notebooks/gpu: " in out.stdout and "(cell 0)" in out.stdout


# ------------------------------------------------------------------------ self_checks: every check can fail
AREA = (f"def area(r):\n    {BEGIN}\n    return math.pi * r * r\n    {END}\n\n\n"
        "def area_ref_given(r):\n    return math.pi * r ** 2")


def _solution(chapter, check_src, task_src=AREA):
    """Rewrite solution 42 as setup + one task cell ('area') + one check cell holding `check_src`."""
    _pair(chapter / "solutions" / "42_norm", [
        _cell(SETUP + "\nimport math\nfrom minite.testing import check_op, assert_close"),
        _cell(task_src, task="area"),
        _cell(f"# CHECK: area\nr = torch.linspace(0.5, 2.0, 7)\n{check_src}\nprint('PASS: area')", check="area"),
    ])


@pytest.mark.parametrize("check, why", [
    # 14_graduation's Tasks 2 and 4 before the fix: the learner's function wrapped, then compared with itself
    ("def wrap(r):\n    return area(r)\nassert check_op('area', wrap, wrap, r, grad=False)",
     "the reference is the tested expression itself (wrap)"),
    ("assert check_op('area', area, area, r, grad=False)", "the reference is the tested expression itself (area)"),
    ("assert_close(area(r), area(r), name='area')", "the reference is the tested expression itself"),
    ("assert check_op('area', area, lambda t: area(t) + 0, r, grad=False)", "calls the answers (area)"),
    ("def wrap(r):\n    return area(r)\nassert check_op('area', area, ref=wrap, fn=area, grad=False)",
     "calls the answers (wrap)"),
    ("want = 2 * math.pi\nassert_close(area(r), expected=area(r) * 1)", "calls the answers (area)"),
])
def test_a_check_whose_reference_is_the_answer_fails(chapter, check, why):
    _solution(chapter, check)
    problems = cn.self_checks(chapter)
    assert len(problems) == 1 and problems[0].startswith("solutions/42_norm.ipynb: check 'area'") \
        and why in problems[0], problems


@pytest.mark.parametrize("check", [
    "assert check_op('area', area, lambda t: math.pi * t ** 2, r, grad=False)",   # a formula
    "assert check_op('area', area, area_ref_given, r, grad=False)",  # given code in the task cell, not the answer
    "a = area(r)\nassert_close(a, torch.pi * r * r, name='area')",
    # data derived from the answer may appear on both sides: a property check (04_rope's permutation)
    "a = area(r)\nassert_close(a[[1, 0]], (math.pi * r * r)[[1, 0]])",
])
def test_an_independent_reference_passes(chapter, check):
    _solution(chapter, check)
    assert cn.self_checks(chapter) == []


# ------------------------------------------------------------------------ authors_words: the learner's voice
@pytest.mark.parametrize("text, hit", [
    ("It has not been run on a GPU for this edition.", "'edition'"),
    ("No GPU run was done in this session.", "'this session'"),
    ("The goal stands as the issue sets it.", "'as the issue'"),
    ("Fixed in (issue 26).", "'issue 26'"),
    ("Measured by another helper.", "'another helper'"),
    ("The brief asks for this.", "'The brief'"),
])
def test_words_for_authors_fail(chapter, text, hit):
    text_py = _lesson(chapter, "x = 1")
    (chapter / "notebooks" / "42_norm.py").write_text(text_py + f"\n# %% [markdown]\n# {text}\n")
    problems = cn.authors_words(chapter)
    assert len(problems) == 1 and problems[0].startswith("notebooks/42_norm.py:") and hit in problems[0], problems


def test_words_for_learners_pass(chapter):
    text_py = _lesson(chapter, "x = 1  # a Triton helper, inlined by the compiler")
    (chapter / "notebooks" / "42_norm.py").write_text(
        text_py + "\n# %% [markdown]\n# The issue is that fp16 overflows; a training session on one GPU; the other "
        "helper function; pytorch#147793 names a PyTorch bug.\n")
    assert cn.authors_words(chapter) == []


def test_every_check_of_the_course_can_fail():
    assert cn.self_checks(ROOT) == []


def test_the_course_speaks_to_learners():
    assert cn.authors_words(ROOT) == []


@pytest.mark.parametrize("check", [c for c in cn.CHECKS if c not in ("selfcheck", "voice")])
def test_the_course_passes_every_notebook_check(check):
    # `make check-fast`'s notebook checks, on the course itself, in the suite CI runs: lesson 16's pair drifted
    # (its .py edited, its .ipynb not) and only check-fast, which CI does not run, would have said so.
    assert cn.CHECKS[check](ROOT) == []


def test_the_code_passes_ruff_and_the_line_budgets():
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "minite", "tests", "tools", "benchmarks", "notebooks",
                           "solutions"], cwd=ROOT, capture_output=True, text=True)
    assert ruff.returncode == 0, ruff.stdout[-3000:]
    budgets = subprocess.run([sys.executable, "tools/budgets.py"], cwd=ROOT, capture_output=True, text=True)
    assert budgets.returncode == 0, budgets.stdout[-3000:]


# ------------------------------------------------------------------------ a wrong answer passes no check
# Chapter 14's tasks are plain Python (no kernel, no torchrun): its grading takes seconds. Each answer below is a
# plausible mistake; the grader must fail every task.
WRONG_14 = {
    "plan_layout": [  # pipeline stages counted as dividing the activations; no search at all
        "return n_params / (tp * pp) * (4 + (12 / dp if zero else 12)) + 34 * T / cp * micro_batch * n_embd / tp "
        "* n_layer / pp",
        "return (world, 1, 1, 1)"],
    "layout_errors": [  # the batch rule forgotten
        "found = {}\nif dp * tp * pp * cp != world:\n    found['world'] = f'{dp * tp * pp * cp} != {world}'\n"
        "if n_head % tp:\n    found['heads'] = f'{n_head} {tp}'\nif pp > n_layer:\n    found['layers'] = f'{pp} "
        "{n_layer}'\nif cp > 1 and T % (2 * cp):\n    found['sequence'] = f'{T} {2 * cp}'\nreturn found"],
    "reshard_qkv": [  # the shards re-cut as one block, ignoring the q / k / v layout
        "return list(torch.cat(shards).chunk(new_tp))"],
    "utilization": [  # selective recompute counted as a full one
        "if recompute not in ('none', 'selective', 'full'):\n    raise ValueError(recompute)\n"
        "need = 6 * n_params + 12 * n_layer * n_embd * T\n"
        "again = 0 if recompute == 'none' else 2 * n_block_params + 4 * n_layer * n_embd * T\n"
        "return tokens_per_s * need / peak_flops, tokens_per_s * (need + again) / peak_flops"],
}


@pytest.mark.notebook
def test_wrong_answers_pass_no_check_of_chapter_14(tmp_path):
    from minite.grading import STUB, grade
    solution = ROOT / "solutions" / "14_graduation.ipynb"
    ex = nbformat.read(ROOT / "exercises" / "14_graduation_exercise.ipynb", as_version=4)
    for cell in ex.cells:
        todo = list(WRONG_14.get(cell.get("metadata", {}).get("minite", {}).get("task"), []))
        if todo:
            out = []
            for ln in cell.source.splitlines():
                if ln.strip() == STUB:
                    ind = ln[: len(ln) - len(ln.lstrip())]
                    out += [ind + a if a else a for a in todo.pop(0).splitlines()]
                else:
                    out.append(ln)
            assert not todo, "one wrong answer per region"
            cell.source = "\n".join(out)
    assert {c.metadata.get("minite", {}).get("task") for c in ex.cells} - {None} == set(WRONG_14)
    student = tmp_path / "exercises" / "14_graduation_exercise.ipynb"
    student.parent.mkdir(parents=True)
    nbformat.write(ex, student)
    rep = grade(student, solution, timeout=120)
    assert rep.total == len(WRONG_14) and rep.score == 0, rep.summary()
    assert sorted(rep.failed) == sorted(WRONG_14), rep.summary()


# ------------------------------------------------------------------------ a wrong core fails a lesson's check
CORE = "def mean_of(xs):\n    return sum(xs) / len(xs)"


def _mean_lesson(root: Path, check: str):
    _pair(root / "notebooks" / "43_mean", [nbformat.v4.new_markdown_cell("# lesson"), _cell("import os"),
                                           _cell(CORE), _cell("print('unrelated')"), _cell(check)])


TABLE = {"43_mean": (["def mean_of", "CHECK: mean"], ("/ len(xs)", "/ (len(xs) - 1)"))}  # an off-by-one


def test_a_planted_core_fails_an_asserting_check(tmp_path):
    _mean_lesson(tmp_path, "# CHECK: mean\nassert abs(mean_of([1.0, 2.0, 6.0]) - 3.0) < 1e-12")
    assert cn.planted_cores(tmp_path, TABLE) == []
    script = cn.lesson_script(tmp_path / "notebooks" / "43_mean.py", TABLE["43_mean"][0])
    assert "unrelated" not in script  # only the named cells run


@pytest.mark.parametrize("check", ["# CHECK: mean\nprint(mean_of([1.0, 2.0, 6.0]))",  # prints, asserts nothing
                                   "# CHECK: mean\nassert abs(mean_of([1.0, 2.0, 6.0]) - 3.0) < 2"])  # too loose
def test_a_check_the_planted_core_passes_is_reported(tmp_path, check):
    _mean_lesson(tmp_path, check)
    assert any("still passes" in p for p in cn.planted_cores(tmp_path, TABLE))


def test_a_core_that_fails_as_written_or_an_edit_not_found_is_reported(tmp_path):
    _mean_lesson(tmp_path, "# CHECK: mean\nassert mean_of([1.0, 2.0, 6.0]) == 4.0")
    assert any("fail as written" in p for p in cn.planted_cores(tmp_path, TABLE))
    assert any("occurs 0 times" in p for p in cn.planted_cores(tmp_path, {"43_mean": (["def mean_of"], ("xx", "y"))}))
