"""Test-suite set-up: run Triton kernels on the CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when a kernel is decorated (at import), so it must be set before minite is imported.
At the end the summary says how many Triton-kernel tests *ran* (not skipped), and where.
"""
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# backend="auto" on a GPU runs the peer (SDPA, Inductor) where the recorded benchmark says it wins (minite/choices.py):
# the suite's tests are about minite's kernels, so auto here runs them wherever Triton can (read at minite's import)
os.environ.setdefault("MINITE_AUTO", "kernels")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: a second OpenMP thread per worker only oversubscribes the cores
    # (measured: a tiny training test went from 0.26 s to 9.6 s with 2 threads x 2 workers on 2 cores).
    torch.set_num_threads(1)

# Thread picks are cached per machine (minite/resources.py, ~/.cache/minite): the suite keeps its own, so a test that
# times the picker never reads a pick a user's run (or an earlier suite) left, and writes nothing in the user's home.
if "MINITE_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MINITE_CACHE_DIR"] = tempfile.mkdtemp(prefix="minite-cache-")

import pytest  # noqa: E402

from minite._triton import HAS_TRITON, interpreting  # noqa: E402

# The sm_90/sm_80 compile gate (minite/gpu_compile.py): while the kernels run under the interpreter, write down
# every distinct launch of a minite kernel; `make test` compiles them for the GPU at the end of the session.
_RECORD_DIR = os.environ.get("MINITE_RECORD_LAUNCHES")
if _RECORD_DIR and interpreting():
    from minite.gpu_compile import record_launches
    os.makedirs(_RECORD_DIR, exist_ok=True)
    record_launches(os.path.join(_RECORD_DIR, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl"))

_counts = {"triton_passed": 0, "triton_failed": 0, "triton_skipped": 0}


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        elif item.get_closest_marker("triton") and not HAS_TRITON:
            item.add_marker(pytest.mark.skip(reason="triton is not installed"))
        elif item.get_closest_marker("triton") and not cuda and not interpreting():
            item.add_marker(pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET is off"))


def pytest_runtest_logreport(report):
    if "triton" not in report.keywords:
        return
    if report.when == "call":
        _counts["triton_passed" if report.passed else "triton_failed" if report.failed else "triton_skipped"] += 1
    elif report.when == "setup" and report.skipped:
        _counts["triton_skipped"] += 1


def pytest_terminal_summary(terminalreporter):
    where = "CUDA" if torch.cuda.is_available() else ("the CPU interpreter (TRITON_INTERPRET=1)" if interpreting()
                                                     else "nowhere (no CUDA, interpreter off)")
    terminalreporter.write_line(
        f"Triton-kernel tests: {_counts['triton_passed']} passed, {_counts['triton_failed']} failed, "
        f"{_counts['triton_skipped']} skipped, run on {where}")


# ------------------------------------------------------------------------------------------ shared fixtures
@pytest.fixture(scope="session")
def device():
    """The one device of the suite: CUDA when present, else the CPU with the Triton interpreter on (DESIGN §7).
    Draw inputs from a seeded CPU generator, then ``.to(device)``: the same test runs on both."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, seed=0, dtype=torch.float32, device="cpu", requires_grad=False):
    """Seeded standard-normal input made on the CPU (same numbers on every device), then moved to ``device``."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)


@pytest.fixture
def one_thread():
    """One torch thread for the test. On 2 shared cores (pytest-xdist workers, other jobs) two OpenMP threads per
    process oversubscribe the CPU and tiny ops become ~30x slower while the threads wait for each other.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write_corpus(path, n_chars=20_000, seed=0, marks=".,;!?"):
    """A small pseudo-English corpus: words drawn from a fixed list, lines ending in one of `marks`."""
    rng = random.Random(seed)
    words = "the king and queen of night shall speak to thee my lord what art thou sweet love".split()
    lines = []
    for _ in range(n_chars // 30):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize()
        lines.append(line + (rng.choice(marks) if len(marks) > 1 else marks))  # a single mark draws nothing
    text = "\n".join(lines)[:n_chars] + "\n"
    path.write_text(text, encoding="utf-8")
    return text


@pytest.fixture
def make_corpus():
    """``make_corpus(path, n_chars=20_000, seed=0, marks=".,;!?") -> text``: writes a generated corpus (no download)."""
    return _write_corpus


# ------------------------------------------------------------------------------------------- tiny training runs
_TINY_RUN = {
    "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 16, "model.block_size": 16, "model.backend": "torch",
    "train.batch_size": 4, "train.max_iters": 12, "train.eval_interval": 4, "train.eval_iters": 2,
    "train.warmup_iters": 2, "train.log_interval": 1, "train.threads": 1, "train.progress": False,
    "train.sample_tokens": 0, "train.lr": 1e-2,
}


@pytest.fixture
def tiny_run():
    """The overrides of a one-layer GPT run of 12 steps that trains in about a second on one CPU thread."""
    return dict(_TINY_RUN)


@pytest.fixture
def run_cfg(tmp_path, make_corpus, tiny_run):
    """``run_cfg(**overrides) -> RunConfig``: a tiny run on a generated corpus, writing under tmp_path."""
    from minite.config import make_config
    make_corpus(tmp_path / "corpus.txt", n_chars=6000, marks=".")

    def build(**over):
        o = {**tiny_run, "data.path": str(tmp_path / "corpus.txt"), "data.data_dir": str(tmp_path / "data"),
             "train.out_dir": str(tmp_path / "out"), **over}
        return make_config("cpu", o)
    return build
