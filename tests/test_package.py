"""Reuse as a package: the wheel installs into a fresh venv outside the source tree (--no-deps, beside the pinned
torch and triton) and runs a kernel there (tools/wheel_smoke.py; about 15 s on 2 cores)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_runs_a_kernel():
    pytest.importorskip("build")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "wheel_smoke.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "softmax kernel ok" in out.stdout and "/venv/" in out.stdout, out.stdout
    assert "(typed: py.typed)" in out.stdout, out.stdout  # type checkers read minite's hints from the wheel
    # issue 37: a project that only wants the kernels gets no plotting stack (matplotlib is the `plot` extra)
    assert "wheel requires: numpy, torch, tqdm, triton\n" in out.stdout, out.stdout


def test_imports_stay_light_and_the_facades_are_whole():
    # issue 22: importing one part loads only what it uses (was: minite.parallel.dims loaded 33 minite modules);
    # issue 26: the LoRA API from one facade, as PEFT's
    code = ("import sys, minite.parallel.dims, minite.errors; "
            "print(sorted(m for m in sys.modules if m.startswith('minite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["minite", "minite._triton", "minite.backend", "minite.choices", "minite.errors",
                         "minite.parallel", "minite.parallel.dims", "minite.parallel.watch"]
    import minite
    import minite.layers.lora as L
    assert set(minite.lora.__all__) == set(L.__all__)
    assert all(getattr(minite.lora, n) is getattr(L, n) for n in L.__all__)


def test_dir_of_minite_lists_its_parts():
    # issue 37: dir(minite) listed `annotations` and `importlib` (the module's plumbing) but not `ops` / `nn`
    import minite
    names = dir(minite)
    assert {"ops", "nn", "formats", "lora", "use_backend", "parallel", "models"} <= set(names), names
    assert "annotations" not in names and "importlib" not in names, names
    assert all(hasattr(minite, n) for n in names), names
