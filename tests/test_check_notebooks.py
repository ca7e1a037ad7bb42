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
    ex = chapter / "exercises" / "42_norm.ipynb"
    nb = nbformat.read(ex, as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS: layernorm\n")]
    nb.cells[2].execution_count = 4
    nb.cells[1].source = nb.cells[1].source.replace("### BEGIN YOUR CODE", BEGIN)
    nbformat.write(nb, ex)
    problems = cn.exercises_with_outputs(chapter)
    assert any("check cell 2 carries outputs" in p for p in problems), problems
    assert any("holds a solution" in p for p in problems), problems
    assert cn.exercises_stale(chapter) == ["exercises/42_norm.ipynb: out of sync with solutions/ (run `make "
                                           "exercises`)"]
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
