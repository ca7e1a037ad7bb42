"""Install the pinned torch (and triton) into the running interpreter's environment: `make setup` calls it.

PyPI's Linux torch wheel is the CUDA build: several GB with about fifteen nvidia-* packages. A machine without an
NVIDIA driver needs none of that, so it gets torch's CPU build from PyTorch's CPU wheel index when that index
answers a quick probe (3 s: an unreachable index must not slow set-up down), and otherwise whatever the configured
indexes give for the pin (PyPI's CUDA build, or a CPU wheel a machine keeps locally). A machine with a driver gets
the CUDA build. It says which build it got, where from, how big it is on disk and how long it took.

    python tools/install_torch.py torch==2.13.0 [triton==3.7.1]
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_cuda_driver() -> bool:
    """An NVIDIA driver answers (nvidia-smi lists a GPU): the CUDA build is what this machine wants."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def index_reachable(url: str = CPU_INDEX, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=timeout) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - DNS failure, refused, timed out, proxy: all mean "not here"
        return False


def _size(dists) -> float:
    """GB on disk of the installed distributions named (torch, nvidia-*, triton, ...)."""
    from importlib import metadata
    total = 0
    for d in metadata.distributions():
        name = (d.metadata["Name"] or "").lower()
        if any(name == n or name.startswith(n) for n in dists):
            total += sum((Path(d.locate_file(f)).stat().st_size for f in (d.files or [])
                          if Path(d.locate_file(f)).is_file()), 0)
    return total / 1e9


def main(argv: list[str]) -> int:
    if not argv or not argv[0].startswith("torch"):
        print(__doc__.strip().splitlines()[-1].strip())
        return 2
    torch_pin, rest = argv[0], argv[1:]
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    t0 = time.perf_counter()
    if has_cuda_driver():
        where = "the configured indexes (an NVIDIA driver is present: the CUDA build)"
        cmd = pip + [torch_pin]
    elif index_reachable():
        where = f"PyTorch's CPU index {CPU_INDEX} (no NVIDIA driver here)"
        cmd = pip + ["--index-url", CPU_INDEX, torch_pin]
    else:
        where = ("the configured indexes: no NVIDIA driver, but PyTorch's CPU index is not reachable (a 3 s probe), so "
                 "this is whatever they hold for the pin (PyPI's Linux wheel is the CUDA build)")
        cmd = pip + [torch_pin]
    print(f"== torch: installing {torch_pin} from {where}", flush=True)
    subprocess.run(cmd, check=True)
    if rest:  # triton from the configured indexes (the CPU index's torch does not pull it; the interpreter needs it)
        subprocess.run(pip + rest, check=True)
    info = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True, check=True).stdout.split()
    build = "CPU build" if info[1] == "None" else f"CUDA {info[1]} build"
    print(f"== torch {info[0]} ({build}): torch + nvidia-* + triton take {_size(('torch', 'nvidia', 'triton')):.1f} GB "
          f"on disk; installed in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
