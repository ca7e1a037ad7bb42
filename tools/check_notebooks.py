"""Notebook checks for `make check-fast` (docs/chapter_template.md), for every chapter NN present:

* **copied answers**: no solution region of chapter NN may appear, token for token (comments and whitespace
  dropped), in lesson NN's cells or printed outputs: a region is a copy when runs of at least RUN consecutive
  tokens that also appear in the lesson cover SHARE or more of its tokens. (A shared prelude such as
  ``pid = tl.program_id(0)...; mask = offs < n`` covers a small share of a real answer; a transcribed answer
  covers all of it.)
* **pairs in sync**: each jupytext pair in notebooks/ and solutions/ has both files, and the .py's cells
  (type, source, minite/tags metadata) equal the .ipynb's.
* **exercises without outputs**: no code cell of exercises/ has outputs or an execution count, and no
  exercise holds a solution marker.
* **exercises in sync**: exercises/ is what `make exercises` would write from solutions/.
* **runs on a GPU too** (`gpu_portability`, static, on the .py of notebooks/ and solutions/): every `tl.dot` states
  `input_precision=`; a cell that forces `backend="triton"` makes no CPU tensor (torch.randn/zeros/... without
  `device=` or `.to(DEVICE)`); TRITON_INTERPRET is set only by the first code cell, only when no CUDA device is
  present.
* **checks that can fail** (`self_checks`, static, on solutions/*.ipynb): in a check cell, the reference of
  `check_op(name, fn, ref, ...)` and the expected side of `assert_close(actual, expected)` must not depend on the
  answers (a function or constant a task's solution region defines, or a function that uses one), nor be the
  same expression as the side under test. Such a check passes for any answer when the notebook runs it.
* **the learner's voice** (`authors_words`, on the .py of notebooks/ and solutions/): no text written for the
  course's authors rather than its learners: editions, work sessions, issue numbers, briefs, helper sessions.

* **a wrong core fails a check** (`planted_cores`, executes): for each lesson of PLANTED, the cells that build
  its core and check it pass as written and fail with one plausible mistake planted in the core.

    python tools/check_notebooks.py [--root DIR] [--only copies,pairs,outputs,exercises,gpu,selfcheck,voice,planted]
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minite.grading import BEGIN, generate_all, regions  # noqa: E402
from minite.grading.flow import loads  # noqa: E402

RUN = 12     # a run of this many consecutive tokens of an answer found in the lesson counts as copied ...
SHARE = 0.7  # ... and an answer is a copy when such runs cover this share of its tokens. Not lower: a 2-D
#             tile kernel shares its offsets/mask/load idiom with the lesson's matmul (measured 52-55 % on two
#             honest answers in 00 and 01); a transcribed answer covers ~100 %.

_STR = r"'(?:\\.|[^'\\\n])*'" + "|" + r'"(?:\\.|[^"\\\n])*"'
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|" + _STR + r"|\*\*=?|//=?|->|[-+*/%&|^<>=!]=|<<|>>|\S")
_COMMENT = re.compile("(" + _STR + r")|#[^\n]*")


def tokens(text: str) -> list[str]:
    """Code-ish text -> its tokens, comments and whitespace dropped (strings kept whole)."""
    return _TOKEN.findall(_COMMENT.sub(lambda m: m.group(1) or "", text))


def _output_text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") in ("execute_result", "display_data"):
            parts.append(o.get("data", {}).get("text/plain", ""))
        elif o.get("output_type") == "error":
            parts.append("\n".join(o.get("traceback", [])))
    return "\n".join(parts)


def _ngrams(seq: list[str], n: int) -> set[tuple]:
    return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}


def copied_answers(root: Path) -> list[str]:
    """One line per solution region whose tokens are mostly found, in runs of at least RUN tokens, in its
    chapter's lesson (cells or printed outputs)."""
    problems = []
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        lessons = sorted((root / "notebooks").glob(sol.name[:3] + "*.ipynb"))  # same chapter NN_
        if not lessons:
            continue
        seen: set[tuple] = set()
        for lesson in lessons:
            for cell in nbformat.read(lesson, as_version=4).cells:
                if cell.cell_type == "code":
                    seen |= _ngrams(tokens(cell.source), RUN) | _ngrams(tokens(_output_text(cell)), RUN)
        sol_nb = nbformat.read(sol, as_version=4)
        for i, cell in enumerate(sol_nb.cells):
            if cell.cell_type != "code":
                continue
            lines = cell.source.splitlines()
            for b, e in regions(cell.source, f"{sol.name} cell {i}"):
                answer = tokens("\n".join(lines[b + 1:e]))
                if len(answer) < RUN:
                    continue
                covered = [False] * len(answer)
                for j in range(len(answer) - RUN + 1):
                    if tuple(answer[j:j + RUN]) in seen:
                        covered[j:j + RUN] = [True] * RUN
                share = sum(covered) / len(answer)
                if share >= SHARE:
                    name = cell.metadata.get("minite", {}).get("task", f"cell {i}")
                    problems.append(f"{sol.name}: task {name!r} (lines {b + 2}-{e}): {share:.0%} of its "
                                    f"{len(answer)} tokens appear in its lesson in runs of >= {RUN} tokens")
    return problems


def _cells(nb) -> list[tuple]:
    out = []
    for c in nb.cells:
        meta = {k: c.get("metadata", {}).get(k) for k in ("minite", "tags") if c.get("metadata", {}).get(k)}
        out.append((c.cell_type, "\n".join(ln.rstrip() for ln in c.source.strip("\n").splitlines()), meta))
    return out


def pairs_out_of_sync(root: Path) -> list[str]:
    import jupytext
    problems = []
    for folder in ("notebooks", "solutions"):
        d = root / folder
        stems = {p.stem for p in d.glob("*.py")} | {p.stem for p in d.glob("*.ipynb")}
        for stem in sorted(stems):
            py, ipynb = d / f"{stem}.py", d / f"{stem}.ipynb"
            if not py.exists() or not ipynb.exists():
                problems.append(f"{folder}/{stem}: only {(py if py.exists() else ipynb).name} exists; a lesson or "
                                "solution is a jupytext pair (make notebooks NB=...py creates the .ipynb)")
                continue
            a, b = _cells(jupytext.read(py)), _cells(nbformat.read(ipynb, as_version=4))
            if a != b:
                k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                problems.append(f"{folder}/{stem}: the .py and the .ipynb differ (from cell {k}; {len(a)} vs "
                                f"{len(b)} cells): run `make notebooks NB={folder}/{stem}.py`, or save in JupyterLab")
    return problems


def exercises_with_outputs(root: Path) -> list[str]:
    problems = []
    for ex in sorted((root / "exercises").glob("*.ipynb")):
        nb = nbformat.read(ex, as_version=4)
        for i, c in enumerate(nb.cells):
            if c.cell_type != "code":
                continue
            what = c.metadata.get("minite", {})
            kind = "task" if "task" in what else "check" if "check" in what else "code"
            if c.get("outputs") or c.get("execution_count") is not None:
                problems.append(f"exercises/{ex.name}: {kind} cell {i} carries outputs or an execution count")
            if any(ln.strip() == BEGIN for ln in c.source.splitlines()):
                problems.append(f"exercises/{ex.name}: cell {i} holds a solution ('{BEGIN}')")
    return problems


def exercises_stale(root: Path) -> list[str]:
    return [f"exercises/{n}: out of sync with solutions/ (run `make exercises`)"
            for n in generate_all(root / "solutions", root / "exercises", check=True)]


# ------------------------------------------------------------------------ runs on the CPU and on a GPU
# Three static rules, each a bug that passed on the CPU (interpreter) and failed on an H100 (2026-11-25):
# fp32 checks of a TF32 tl.dot; backend="triton" forced on CPU tensors; the interpreter forced on a GPU machine.
_CELL = re.compile(r"^# %%(.*)$")
_CREATE = {"randn", "rand", "randint", "randperm", "zeros", "ones", "full", "empty", "tensor", "as_tensor",
           "arange", "linspace", "logspace", "eye"}
_DEVICE_NAMES = {"DEVICE", "device"}


def code_cells(py: Path) -> list[tuple[int, int, str]]:
    """(k, first line, source) of each code cell of a jupytext percent .py: k counts code cells only, as nbval's
    'Cell k' does; the first line is the .py's line number of the cell's first source line."""
    cells, cur, kind = [], None, None
    for n, line in enumerate(py.read_text().splitlines(), 1):
        m = _CELL.match(line)
        if m:
            if cur is not None and kind == "code":
                cells.append(cur)
            kind = "markdown" if "[markdown]" in m.group(1) else "raw" if "[raw]" in m.group(1) else "code"
            cur = (n + 1, [])
        elif cur is not None:
            cur[1].append(line)
    if cur is not None and kind == "code":
        cells.append(cur)
    return [(k, first, "\n".join(lines)) for k, (first, lines) in enumerate(cells)]


def _parse(src: str):
    """A cell's AST (IPython magics and shell lines blanked), or None when it does not parse."""
    try:
        return ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines()))
    except SyntaxError:
        return None


def _is_device(node) -> bool:
    """An expression naming a device that is not the CPU: DEVICE / device, x.device, torch.device(...), 'cuda'."""
    if isinstance(node, ast.Name):
        return node.id in _DEVICE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr == "device"
    if isinstance(node, ast.Call):
        f = node.func
        return isinstance(f, ast.Attribute) and f.attr == "device" and isinstance(f.value, ast.Name) \
            and f.value.id == "torch" and not (node.args and _is_cpu(node.args[0]))
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda")


def _is_cpu(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cpu"


def _placed(call, parents) -> bool:
    """Whether a tensor-creating call was given a device: `device=` on the call (any: "cpu" says the tensor stays
    on the CPU on purpose), or the tensor flows (through arithmetic, indexing and method calls) into
    `.to(<device>, ...)` or `.cuda()`, where <device> is DEVICE / device, `x.device`, `torch.device(...)` or "cuda"."""
    if any(kw.arg == "device" for kw in call.keywords):
        return True  # the author chose, the CPU included (a reference computed there)
    node = call
    while True:
        up = parents.get(node)
        if isinstance(up, ast.Attribute) and up.value is node and isinstance(parents.get(up), ast.Call) \
                and parents[up].func is up:
            method = parents[up]
            if up.attr == "cuda":
                return True
            if up.attr == "to" and (any(_is_device(a) for a in method.args) or
                                    any(k.arg == "device" and _is_device(k.value) for k in method.keywords)):
                return True
            node = method
        elif isinstance(up, (ast.BinOp, ast.UnaryOp)) or (isinstance(up, ast.Subscript) and up.value is node):
            node = up
        else:
            return False


def _forces_triton(tree) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if any(k.arg == "backend" and isinstance(k.value, ast.Constant) and k.value.value == "triton"
                   for k in node.keywords):
                return True
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "use_backend" and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value == "triton":
                return True
    return False


def _sets_interpreter(node) -> bool:
    """`os.environ["TRITON_INTERPRET"] = ...`, `{"TRITON_INTERPRET": ...}`, `dict(TRITON_INTERPRET=...)`,
    `environ.setdefault("TRITON_INTERPRET", ...)`."""
    key = "TRITON_INTERPRET"
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
        return isinstance(node.slice, ast.Constant) and node.slice.value == key
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == key for k in node.keys)
    if isinstance(node, ast.Call):
        return any(k.arg == key for k in node.keywords) or (
            isinstance(node.func, ast.Attribute) and node.func.attr in ("setdefault", "putenv")
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == key)
    return False


def _guarded_setup(tree) -> tuple[bool, set]:
    """Whether a first code cell turns the interpreter on only under `if not torch.cuda.is_available():`
    before it imports anything but os/torch, and the nodes of that guarded assignment."""
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test).replace(" ", "") == "nottorch.cuda.is_available()" \
                and any(_sets_interpreter(n) for n in ast.walk(stmt)):
            return True, {id(n) for n in ast.walk(stmt)}
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module or ""]
            if any(m.split(".")[0] not in ("os", "torch") for m in mods):
                return False, set()
    return False, set()


def gpu_portability(root: Path) -> list[str]:
    """Static rules for lessons and solutions (their .py), so that what passes here also runs on a GPU:

    * **tl.dot states its precision**: every `tl.dot(` passes `input_precision=` ("ieee": exact fp32 products;
      "tf32": the GPU's default for fp32 tiles, ~1e-3 relative error, which an fp32 check at 1e-5 fails on an H100
      while the interpreter, which does not emulate TF32, passes it). On fp16/bf16/fp8 tiles it changes nothing.
    * **no backend="triton" on CPU tensors**: a notebook that forces the Triton kernels (`backend="triton"`,
      `use_backend("triton")`) defines DEVICE in its first code cell, and in each cell that forces them every
      tensor made with torch.randn/zeros/ones/tensor/empty/arange/... is given a device: `device=` (`"cpu"` too, for
      a reference kept on the CPU on purpose), or `.to(DEVICE...)`. On a GPU machine the interpreter is off and
      Triton cannot run on CPU tensors. (Per cell: a tensor made in another cell is not followed.)
    * **the interpreter only without a GPU**: the first code cell sets TRITON_INTERPRET under
      `if not torch.cuda.is_available():` before importing anything but os and torch, and no code sets it
      anywhere else (e.g. `env={"TRITON_INTERPRET": "1"}` for torchrun workers: the launcher decides).
    """
    problems = []
    for folder in ("notebooks", "solutions"):
        for py in sorted((root / folder).glob("*.py")):
            found: list[tuple[int, str]] = []  # (line of the .py, problem)
            cells = code_cells(py)
            trees = [_parse(src) for _, _, src in cells]
            found += [(first, f"(cell {k}) does not parse") for (k, first, _), t in zip(cells, trees) if t is None]
            if not cells or trees[0] is None:
                problems += [f"{folder}/{py.name}:{n}: {msg}" for n, msg in sorted(found)]
                continue
            ok, guard = _guarded_setup(trees[0])
            if not ok:
                found.append((cells[0][1], "(cell 0) the first code cell must set TRITON_INTERPRET under `if not "
                                           "torch.cuda.is_available():` before importing triton or minite"))
            has_device = any(isinstance(t, ast.Name) and t.id in _DEVICE_NAMES
                             for s in trees[0].body if isinstance(s, ast.Assign) for t in s.targets)
            for (k, first, _), tree in zip(cells, trees):
                if tree is None:
                    continue
                parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
                forced = _forces_triton(tree)
                if forced and not has_device:
                    found.append((first, f"(cell {k}) forces backend='triton', but the first code cell defines no "
                                         "DEVICE"))
                for node in ast.walk(tree):
                    n = first + getattr(node, "lineno", 1) - 1
                    if _sets_interpreter(node) and id(node) not in guard:
                        found.append((n, f"(cell {k}) sets TRITON_INTERPRET: only the first cell does, and only "
                                         "without a GPU (torchrun's launcher decides for its workers)"))
                    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                        continue
                    f = node.func
                    if f.attr == "dot" and isinstance(f.value, ast.Name) and f.value.id == "tl" \
                            and not any(kw.arg == "input_precision" for kw in node.keywords):
                        found.append((n, f"(cell {k}) tl.dot without input_precision=: \"ieee\" for exact fp32 "
                                         "products (a GPU multiplies fp32 tiles in TF32 by default), or \"tf32\""))
                    if forced and f.attr in _CREATE and isinstance(f.value, ast.Name) and f.value.id == "torch" \
                            and not _placed(node, parents):
                        found.append((n, f"(cell {k}) torch.{f.attr}(...) makes a CPU tensor in a cell that forces "
                                         "backend='triton': give it device=DEVICE or .to(DEVICE)"))
            problems += [f"{folder}/{py.name}:{n}: {msg}" for n, msg in sorted(found)]
    return problems


# ------------------------------------------------------------------------ checks that can fail
def _reference_args(call) -> tuple | None:
    """(tested, reference) expressions of a `check_op(name, fn, ref, ...)` or `assert_close(actual, expected)`
    call, or None for any other call."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    kw = {k.arg: k.value for k in call.keywords}
    if name == "check_op":
        args = list(call.args[1:3])
        tested, ref = (args + [None, None])[:2]
        return kw.get("fn", tested), kw.get("ref", ref)
    if name == "assert_close":
        args = list(call.args[:2])
        tested, ref = (args + [None, None])[:2]
        return kw.get("actual", tested), kw.get("expected", ref)
    return None


def _answer_names(cell, label: str) -> set[str]:
    """Names a task cell binds at module level with a solution region inside (or around) the statement: the
    learner's functions, kernels, classes and constants. Given code around them (a launcher, a spec) is not."""
    tree = _parse(cell.source)
    spans = regions(cell.source, label)
    out = set()
    for st in tree.body if tree else []:
        first, last = st.lineno - 1, st.end_lineno - 1  # 0-based lines, as regions() counts
        if not any(first <= b <= last or b <= first <= e for b, e in spans):
            continue
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(st.name)
        elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in st.targets if isinstance(st, ast.Assign) else [st.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _calls_answers(trees, answers: set[str]) -> set[str]:
    """The answers, and every function (def, or a name bound to a lambda) whose body reads one of them,
    transitively, in any cell: what a reference must not call."""
    funcs = {}
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.setdefault(n.name, set()).update(loads(n))
            elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        funcs.setdefault(t.id, set()).update(loads(n.value))
    out = set(answers)
    while True:
        more = {name for name, used in funcs.items() if used & out} - out
        if not more:
            return out
        out |= more


def self_checks(root: Path) -> list[str]:
    """A check whose reference is the learner's own code: `check_op(name, f, f)`, `assert_close(y, y)`, or a
    reference that calls (or reads) an answer: a function or constant a task cell's solution region defines, or a
    function whose body uses one (`check_op("t", wrap, wrap)` where `wrap` calls the task). Run in the notebook,
    such a check passes for any answer. Data derived from an answer may appear in a reference (checking a
    property: `ref(x[..., perm])` against `mine(x)[..., perm]`)."""
    problems = []
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        cells = [c for c in nbformat.read(sol, as_version=4).cells if c.cell_type == "code"]
        trees = [t for t in (_parse(c.source) for c in cells) if t is not None]
        answers = set()
        for c in cells:
            if "task" in c.metadata.get("minite", {}):
                answers |= _answer_names(c, f"{sol.name} task {c.metadata['minite']['task']}")
        forbidden = _calls_answers(trees, answers)
        for i, cell in enumerate(cells):
            what = cell.metadata.get("minite", {})
            tree = _parse(cell.source)
            if "check" not in what or tree is None:
                continue
            for node in ast.walk(tree):
                pair = _reference_args(node) if isinstance(node, ast.Call) else None
                if not pair or pair[1] is None:
                    continue
                tested, ref = pair
                where = f"solutions/{sol.name}: check {what['check']!r} (line {node.lineno} of its cell)"
                if tested is not None and ast.dump(tested) == ast.dump(ref):
                    problems.append(f"{where}: the reference is the tested expression itself "
                                    f"({ast.unparse(ref)[:60]}): the check passes for any answer")
                elif loads(ref) & forbidden:
                    problems.append(f"{where}: the reference {ast.unparse(ref)[:60]!r} calls the answers "
                                    f"({', '.join(sorted(loads(ref) & forbidden))}): compare with an independent "
                                    "reference (a formula, a library call, recorded numbers)")
    return problems


# ------------------------------------------------------------------------ the learner's voice
# Words written for the course's authors (the work that made a lesson), not for its learners. Precise on purpose:
# "a Triton helper", "the issue is that ...", "a training session" stay legal.
AUTHORS_WORDS = [
    (re.compile(r"\beditions?\b", re.I), "an edition of the course"),
    (re.compile(r"\b(this|that|previous|earlier|next|another|other|current|in a later) (work )?sessions?\b", re.I),
     "a work session"),
    (re.compile(r"\bissues? ?#?\d+\b", re.I), "an issue number"),
    (re.compile(r"\b(as|per) the issue\b|\bthe issue (sets|says|asks|requires|wants|lists|demands)\b", re.I),
     "the issue that asked for the work"),
    (re.compile(r"\b(the|my|this) brief\b", re.I), "a brief"),
    (re.compile(r"\bhelpers? (sessions?|agents?)\b|\b(another|the other) helper\b(?!\s+(function|kernel|method))",
                re.I), "a helper session"),
]


def authors_words(root: Path) -> list[str]:
    """Lines of a lesson or solution (markdown, code, comments) that speak to the authors, not the learner."""
    problems = []
    for folder in ("notebooks", "solutions"):
        for py in sorted((root / folder).glob("*.py")):
            for n, line in enumerate(py.read_text().splitlines(), 1):
                for pattern, what in AUTHORS_WORDS:
                    m = pattern.search(line)
                    if m:
                        problems.append(f"{folder}/{py.name}:{n}: {m.group(0)!r} names {what}: write to the "
                                        "learner (what is measured, what is not, and why)")
    return problems


# ------------------------------------------------------------------------ a wrong core fails a lesson's check
# For each lesson, the core it builds in its cells with one plausible mistake planted (a sign, an off-by-one, a
# missing scale): (the cells to run, each named by a string its source contains; the edit (old, new)). The
# first code cell (imports) always runs; the named cells run in lesson order, the edit applied to the one that
# holds `old`. The real lesson must pass those cells and the planted one must fail one of them: a check that
# prints but does not assert, or asserts with a tolerance the mistake fits in, passes both.
PLANTED: dict[str, tuple[list[str], tuple[str, str]]] = {
    "00_triton_from_zero": (["def naive_softmax(x", "def softmax_fwd_kernel", "def softmax_fwd(x)",
                             "def softmax_bwd_kernel", "def minite_softmax"],
                            ("dx = y * (dy - tl.sum(y * dy, axis=0))", "dx = y * (dy + tl.sum(y * dy, axis=0))")),
    #                                                             the backward's row term with the wrong sign
    "01_floating_point": (["def fp32_fields", "def round_to_format_bits", "specials = torch.tensor"],
                          ("round_up = (rem > half)", "round_up = (rem >= half)")),  # ties rounded away from even
    "02_fp8": (["def fp8_matmul_kernel", "from minite.testing import fp8_dot_tolerance"],
               ("acc * (tl.load(A_scale_inv_ptr) * tl.load(B_scale_inv_ptr))", "acc * tl.load(A_scale_inv_ptr)")),
    #                                                             B's per-tensor scale left out of the epilogue
    "03_rmsnorm": (["from minite.bytecount import", "def naive_rmsnorm", "import rmsnorm_ref", "def rmsnorm_fwd_kernel",
                    "def rms_dx_row", "def rmsnorm_bwd_kernel", "from minite.ops import rmsnorm"],
                   ("tl.sum(g * xhat, axis=0) / N_COLS)", "tl.sum(g * xhat, axis=0) / (N_COLS - 1))")),  # off by one
    "04_rope": (["def rope_cache", "def naive_rope", "def rope_kernel", "from minite.ops import rope"],
                ("rope_apply(dy, cos, sin, ctx.layout, -1)", "rope_apply(dy, cos, sin, ctx.layout, 1)")),  # the
    #                                                             backward rotates by +angle instead of undoing it
    "05_swiglu": (["from minite.bytecount import", "def naive_swiglu", "def swiglu_fwd_kernel", "def swiglu_bwd_kernel",
                   "from minite.kernels.swiglu import swiglu"],
                  ("dsilu = sig * (1.0 + g * (1.0 - sig))", "dsilu = sig * (1.0 - g * (1.0 - sig))")),  # a sign
    "06_cross_entropy": (["def ce_fwd_kernel", "def ce_bwd_kernel", "from minite.kernels.cross_entropy import cross"],
                         ("start + cols == t, 1.0", "start + cols == t + 1, 1.0")),  # the one-hot one column off
    "07_flash_attention": (["def naive_attention", "def flash_fwd_kernel", "def flash_bwd_dkdv_kernel",
                            "def flash_bwd_dq_kernel", "# CHECK: lesson backward kernels"],
                           ("// BLOCK_M * BLOCK_M if CAUSAL", "// BLOCK_M * BLOCK_M + BLOCK_M if CAUSAL")),  # dK/dV
    #                                                             skip the diagonal's query tile: an off-by-one block
    "08_kv_cache": (["def decode_partial_kernel", "# CHECK: lesson split-KV decode"],
                    ("hi = tl.minimum(lo + CHUNK, n_keys)", "hi = tl.minimum(lo + CHUNK, n_keys - 1)")),  # the last
    #                                                             cached key (the newest token) never read
    "09_lora": (["def fused_lora_fwd", "from minite.kernels.lora import lora_linear, lora_linear_ref"],
                ("tl.dot(xa * s, b_t, acc", "tl.dot(xa, b_t, acc")),  # the adapter's scale s = alpha / r left out
    "10_data_parallel": (["g = torch.Generator().manual_seed(1)", "def ring_all_reduce", "ring_all_reduce(vs)",
                          "def zero3_step", "CHECK: simulated ZeRO-3"],
                         ("/ ys[r].numel() / W", "/ ys[r].numel()")),  # the ranks' gradients summed, not averaged
    "11_tensor_parallel": (["partial = [F.gelu"], ("W2.chunk(t, 1)[r]", "W2.chunk(t, 1)[(r + 1) % t]")),  # the row
    #                                             layer's columns paired with the next rank's hidden units
    "12_pipeline_parallel": (["def one_f_one_b_steps", "CHECK: the 1F1B generator"],
                             ("min(p - 1 - stage, m)", "min(p - stage, m)")),  # one warm-up forward too many
    "13_context_parallel": (["def zigzag_positions", "CHECK: the zig-zag plan"],
                            ("2 * cp - 1 - rank", "2 * cp - 2 - rank")),  # off-by-one late chunk
    "14_graduation": (["mlp_loss(w1, w2, x, t)"], ("for ws in (w1, w2)] for d in grid]",
                                                    "for ws in (w1, w2)] for d in grid]\navg = [[a * DP for a in ga] "
                                                    "for ga in avg]")),  # the dp sum taken for the mean
    "15_fp8_at_scale": (["def blockwise_matmul_kernel", "for M, K, N in ((33, 200, 45)"],
                        ("acc += part * sa[:, None] * sb[None, :]", "acc += part * sa[:, None]")),  # B's block scales
    #                                                             left out
    "16_moe": (["def my_tile_table"], ("tl.load(Offsets_ptr + e + 1)", "tl.load(Offsets_ptr + e)")),  # each expert's
    #                                                             rows end where they start: an off-by-one expert
}


def lesson_script(py: Path, markers: list[str], edit: tuple[str, str] | None = None) -> str:
    """The first code cell of a lesson and the code cells holding one of `markers`, in order, as one script
    (IPython lines blanked), with `edit` (old, new) applied to the one place `old` occurs."""
    cells = code_cells(py)
    kept = [cells[0][2]] + [src for _, _, src in cells[1:] if any(m in src for m in markers)]
    text = "\n\n".join("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in c.splitlines())
                        for c in kept)
    if edit:
        if text.count(edit[0]) != 1:
            raise ValueError(f"{py.name}: the planted edit's {edit[0]!r} occurs {text.count(edit[0])} times, not once")
        text = text.replace(*edit)
    return text


_DRIVER = """import json, os, sys, traceback
out = []
for path in sys.argv[2:]:  # each script in a fresh namespace; the imports are paid once
    try:
        exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
        out.append(None)
    except BaseException:
        out.append(traceback.format_exc()[-600:])
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
    with open(sys.argv[1] + ".tmp", "w") as f:  # after every script: a process that dies later keeps these
        json.dump(out, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


def _run_scripts(texts: list[str], root: Path, timeout: int = 300) -> list[str | None]:
    """Run each script in turn in one fresh Python process (cwd = root): None for one that ran to its end, else
    the tail of its traceback. A process that dies or hangs fails every script it had not finished."""
    import json
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for k, text in enumerate(texts):
            paths.append(os.path.join(d, f"script{k}.py"))
            Path(paths[-1]).write_text(text)
        report = os.path.join(d, "report.json")
        env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
        try:
            run = subprocess.run([sys.executable, "-c", _DRIVER, report, *paths], cwd=root, env=env,
                                 capture_output=True, text=True, timeout=timeout)
            why = f"the process died (exit {run.returncode}): {(run.stdout + run.stderr)[-400:]}"
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout} s"
        done = json.loads(Path(report).read_text()) if os.path.exists(report) else []
        return done + [why] * (len(texts) - len(done))


def planted_cores(root: Path, table: dict | None = None) -> list[str]:
    """For each lesson of `table` (PLANTED): its core's cells must pass as written and fail with the mistake.
    One process runs both versions of every lesson, each script in a fresh namespace: torch, Triton and minite are
    imported once (~3 s of CPU a process; one process per lesson cost ~50 s of the suite's time for 17 lessons)."""
    problems, runs = [], []
    for stem, (markers, edit) in (PLANTED if table is None else table).items():
        py = root / "notebooks" / f"{stem}.py"
        if not py.exists():
            continue
        try:
            runs.append((stem, edit, lesson_script(py, markers), lesson_script(py, markers, edit)))
        except ValueError as e:
            problems.append(str(e))
    got = _run_scripts([s for _, _, real, wrong in runs for s in (real, wrong)], root, timeout=120 + 60 * len(runs))
    for k, (stem, edit, _, _) in enumerate(runs):
        ok, bad = got[2 * k], got[2 * k + 1]
        if ok is not None:
            problems.append(f"notebooks/{stem}.py: its core's cells fail as written: {ok[-400:]}")
        elif bad is None:
            problems.append(f"notebooks/{stem}.py: with {edit[0]!r} -> {edit[1]!r} planted in its core, every check "
                            "of the cells run still passes: a check there prints instead of asserting, or its "
                            "tolerance fits the mistake")
    return problems


CHECKS = {"copies": copied_answers, "pairs": pairs_out_of_sync, "outputs": exercises_with_outputs,
          "exercises": exercises_stale, "gpu": gpu_portability, "selfcheck": self_checks, "voice": authors_words,
          "planted": planted_cores}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    args = p.parse_args(argv)
    bad = 0
    for name in args.only.split(","):
        problems = CHECKS[name](Path(args.root))
        print(f"notebooks/{name}: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
        for line in problems:
            print("  " + line)
        bad += len(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
