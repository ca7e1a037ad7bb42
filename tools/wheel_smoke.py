"""Reuse as a package: build minite's wheel, install it into a fresh venv outside the source tree, run a kernel.

    python tools/wheel_smoke.py [--keep]

1. ``python -m build --wheel --no-isolation`` (the build backend comes from this environment: no download).
2. A fresh venv in a temporary folder (no ``--system-site-packages``), given the *pinned* torch and triton (and
   what they import: numpy, sympy, ...) by linking this environment's installed distributions into its
   site-packages (their files are symlinked, their .dist-info copied, so pip sees them installed). No wheel is
   downloaded or unpacked again: that is what keeps this step to seconds.
3. ``pip install --no-deps`` of the wheel into that venv (pip run from here with ``--python``).
4. In that venv, from a folder outside the source tree and without PYTHONPATH: ``import minite`` (from the venv,
   not from the checkout), its ``py.typed`` marker (PEP 561) installed, and one Triton kernel (softmax) under
   ``TRITON_INTERPRET=1``, compared with torch.
Prints each step's time; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = ["torch", "triton", "numpy"]  # minite's runtime needs for `import minite` + one kernel (no tqdm/mpl)

SMOKE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, minite
from minite import ops
assert "site-packages" in minite.__file__ and not minite.__file__.startswith(sys.argv[1]), minite.__file__
from pathlib import Path
assert (Path(minite.__file__).parent / "py.typed").is_file(), "the wheel lacks minite/py.typed (PEP 561)"
x = torch.randn(5, 37, generator=torch.Generator().manual_seed(0))
y = ops.softmax(x, backend="triton")
assert torch.allclose(y, torch.softmax(x, -1), atol=1e-6), (y - torch.softmax(x, -1)).abs().max()
print(f"minite {minite.__version__} from {minite.__file__} (typed: py.typed); torch {torch.__version__}; "
      "softmax kernel ok")
"""


def _closure(names: list[str]) -> list[md.Distribution]:
    """The installed distributions `names` need (requirements without extras, markers evaluated)."""
    from packaging.requirements import Requirement
    seen, todo, out = set(), list(names), []
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        out.append(dist)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return out


def _link(dist: md.Distribution, site: Path) -> None:
    """Make `dist` installed in `site`: symlink its top-level files and folders, copy its metadata folder."""
    base = Path(dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in dist.files or []}
    for top in sorted(tops):
        src, dst = base / top, site / top
        if top.endswith((".dist-info", ".egg-info")):
            shutil.copytree(src, dst)
        elif src.exists() and not dst.exists() and top not in ("..", "bin"):
            dst.symlink_to(src, target_is_directory=src.is_dir())


def _requires(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (Requires-Dist without an extra), names only."""
    import zipfile
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    return sorted(re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower() for r in reqs if "extra ==" not in r)


def run(keep: bool = False) -> float:
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="minite-wheel-"))
    steps = []

    def step(what, cmd, **kw):
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, **kw)
        if out.returncode:
            raise SystemExit(f"{what} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        steps.append(f"{what}: {time.perf_counter() - t:.1f} s")
        return out.stdout

    try:
        dist_dir, src = tmp / "dist", tmp / "src"  # build from a copy: setuptools writes build/ and egg-info
        shutil.copytree(ROOT / "minite", src / "minite", ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("pyproject.toml", "README.md", "LICENSE"):
            if (ROOT / f).exists():
                shutil.copy(ROOT / f, src / f)
        step("build the wheel", [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                                 str(dist_dir), str(src)], cwd=tmp)
        wheel = next(dist_dir.glob("minite-*.whl"))
        print(f"wheel requires: {', '.join(_requires(wheel))}")
        venv = tmp / "venv"
        step("create the venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
        py = venv / "bin" / "python"
        site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                            text=True).strip())
        t = time.perf_counter()
        dists = _closure(PINNED)
        for d in dists:
            _link(d, site)
        pinned = ", ".join(f"{n}=={md.version(n)}" for n in PINNED[:2])
        steps.append(f"link the pinned {pinned} (+{len(dists) - 2} more distributions): "
                     f"{time.perf_counter() - t:.1f} s")
        step("pip install --no-deps the wheel", [sys.executable, "-m", "pip", "--python", str(py), "install",
                                                 "--no-deps", "--no-index", "--quiet", str(wheel)])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        print(step("import minite and run a kernel", [str(py), "-c", SMOKE, str(ROOT)], cwd=tmp, env=env).strip())
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - t0
    print("\n".join(steps) + f"\ntotal: {total:.1f} s" + (f" (kept {tmp})" if keep else ""))
    return total


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (venv, wheel)")
    run(p.parse_args().keep)
