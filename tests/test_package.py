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
