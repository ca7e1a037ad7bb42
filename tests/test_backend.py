"""The backend switch (DESIGN.md §3): precedence, "auto" rules, and clear errors."""
import subprocess
import sys

import pytest
import torch

import minite
from minite.backend import get_backend, resolve_backend, use_backend


def test_precedence_call_over_context_over_env(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("MINITE_BACKEND", "triton")
    assert get_backend() == "triton"
    with use_backend("torch"):
        assert resolve_backend(x) == "torch"
        with use_backend("auto"):
            assert get_backend() == "auto"
        assert get_backend() == "torch"
    assert resolve_backend(x, "torch") == "torch"


def test_use_backend_restores_on_exception(monkeypatch):
    monkeypatch.delenv("MINITE_BACKEND", raising=False)  # a known outer value, so the restore is observable
    with pytest.raises(KeyError):
        with use_backend("torch"):
            assert get_backend() == "torch"
            raise KeyError
    assert get_backend() == "auto"
    with use_backend("triton"):
        assert get_backend() == "triton"
    assert get_backend() == "auto"


def test_unknown_backend_names_the_value(monkeypatch):
    with pytest.raises(ValueError, match="'cuda'.*valid: auto, torch, triton"):
        resolve_backend(torch.zeros(1), "cuda")
    monkeypatch.setenv("MINITE_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"'fast' from \$MINITE_BACKEND"):
        get_backend()


def test_auto_follows_interpreter_and_device(device):
    # CPU tensors: Triton only under the interpreter. The suite's device (CUDA, or the CPU with the interpreter
    # that tests/conftest.py switches on): Triton whenever triton is installed.
    x = torch.zeros(3)
    expected = "triton" if (minite.HAS_TRITON and minite.interpreting()) else "torch"
    assert resolve_backend(x) == expected
    assert resolve_backend(x, "auto") == expected
    on_device = torch.zeros(3, device=device)
    runs = minite.HAS_TRITON and (device.type == "cuda" or minite.interpreting())
    assert resolve_backend(on_device) == ("triton" if runs else "torch")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINITE_BACKEND")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_forced_triton_without_interpreter_raises_clearly():
    p = _run("import torch, minite\n"
             "try:\n    minite.resolve_backend(torch.randn(2, 3), 'triton')\n"
             "except RuntimeError as e:\n    print('ERR', e)\n"
             "print('AUTO', minite.resolve_backend(torch.zeros(1)))")
    assert p.returncode == 0, p.stderr
    assert "ERR backend='triton' was forced but cannot run" in p.stdout and "TRITON_INTERPRET=1" in p.stdout
    assert "AUTO torch" in p.stdout


def test_minite_imports_and_runs_reference_without_triton():
    # sys.modules['triton'] = None makes `import triton` raise ImportError, as on a machine without it.
    p = _run("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
             "import torch, minite\n"
             "assert not minite.HAS_TRITON\n"
             "x = torch.randn(3, 5)\n"
             "assert minite.resolve_backend(x) == 'torch'\n"
             "torch.testing.assert_close(minite.ops.softmax(x), torch.softmax(x, -1))\n"
             "try:\n    minite.ops.softmax(x, backend='triton')\nexcept RuntimeError as e:\n    print('ERR', e)\n",
             TRITON_INTERPRET="1")
    assert p.returncode == 0, p.stderr
    assert "ERR backend='triton' was forced but cannot run: triton is not installed" in p.stdout


def test_interpreter_version_problem_is_named():
    # triton 3.6's interpreter fails under numpy 2.5 (H100 machine, 2026-11-25): said at set-up, with versions.
    from minite._triton import interpreter_problem
    msg = interpreter_problem("3.6.0", "2.5.2")
    assert msg and "triton 3.6.0" in msg and "numpy 2.5.2" in msg
    assert interpreter_problem("3.7.1", "2.5.5") is None and interpreter_problem("3.6.0", "2.4.6") is None


def test_a_broken_interpreter_keeps_cpu_tensors_on_the_reference(monkeypatch):
    import minite._triton as T
    from minite.backend import resolve_backend
    monkeypatch.setattr(T, "_INTERPRET_AT_IMPORT", True)
    monkeypatch.setattr(T, "HAS_TRITON", True)
    monkeypatch.setattr(T, "INTERPRETER_PROBLEM", T.interpreter_problem("3.6.0", "2.5.2"))
    x = torch.zeros(2)
    assert resolve_backend(x, "auto") == "torch"
    with pytest.raises(RuntimeError, match="triton 3.6.0 fails under numpy 2.5.2"):
        resolve_backend(x, "triton")
