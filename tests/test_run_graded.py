"""The distributed check cells' launcher (minite.parallel.workers.grade.run_graded): a task function that is still
the exercise's stub is answered at once, without a torchrun launch that could only end in NotImplementedError."""
import inspect

from minite.grading import STUB
from minite.parallel.workers import grade


def _src(body: str) -> str:
    return "def step(flat_param, flat_grad, group, lr):\n" + "".join(f"    {ln}\n" for ln in body.splitlines())


def test_the_stub_is_not_launched(monkeypatch):
    launched = []
    monkeypatch.setattr("minite.parallel.launch.torchrun", lambda *a, **k: launched.append(a))
    for body in (STUB, f'"""Docstring."""\n{STUB}', "raise NotImplementedError"):
        ok, msg = grade.run_graded(_src(body), "sharded_sgd_step")
        assert not ok and "step still raises NotImplementedError" in msg, msg
    assert launched == []


def test_written_code_is_launched_even_with_a_raise_left_below():
    # only a function whose FIRST statement raises is the stub: code before it (even one that returns before a
    # leftover raise), a raise of another error, no function, or a syntax error go to the ranks as written
    for src in (_src(f"flat_param.sub_(lr * flat_grad)\nreturn\n{STUB}"), _src("raise ValueError('lr')"),
                "x = 1\n", "def broken(:\n", _src("pass")):
        assert grade.unwritten(src) is None, src
    assert grade.unwritten(_src(STUB)) == "step"
    assert grade.unwritten(inspect.getsource(_src)) is None
