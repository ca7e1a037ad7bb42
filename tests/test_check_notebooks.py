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
        _cell("@triton.jit\ndef rms(X, Y, stride, n, eps, BLOCK: tl.constexpr):\n    row = tl.program_id(0)\n"
              "    x = tl.load(X + row * stride + tl.arange(0, BLOCK))\n    tl.store(Y, x * tl.rsqrt(eps))"),
    ])
    _pair(tmp_path / "solutions" / "42_norm", [
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
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="PASS: layernorm\n")]
    nb.cells[1].execution_count = 4
    nb.cells[0].source = nb.cells[0].source.replace("### BEGIN YOUR CODE", BEGIN)
    nbformat.write(nb, ex)
    problems = cn.exercises_with_outputs(chapter)
    assert any("check cell 1 carries outputs" in p for p in problems), problems
    assert any("holds a solution" in p for p in problems), problems
    assert cn.exercises_stale(chapter) == ["exercises/42_norm.ipynb: out of sync with solutions/ (run `make "
                                           "exercises`)"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "check_notebooks.py"), "--root", str(chapter)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "carries outputs" in out.stdout
