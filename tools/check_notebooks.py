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

    python tools/check_notebooks.py [--root DIR] [--only copies,pairs,outputs,exercises]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minite.grading import BEGIN, generate_all, regions  # noqa: E402

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


CHECKS = {"copies": copied_answers, "pairs": pairs_out_of_sync, "outputs": exercises_with_outputs,
          "exercises": exercises_stale}


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
