"""Exercise notebooks: generate them from solutions, and grade a student's copy.

Conventions (docs/chapter_template.md)
--------------------------------------
* ``solutions/NN_topic.ipynb`` is the solved notebook. A *task cell* carries ``metadata.minite.task = NAME``
  and has one or more answer regions between the lines ``### BEGIN SOLUTION`` and ``### END SOLUTION``.
* A *check cell* carries ``metadata.minite.check = NAME`` (the same NAME as its task), is tagged
  ``nbval-check-output``, starts with ``# CHECK: NAME``, ends with an ``assert`` and prints ``PASS: ...``.
* ``exercises/NN_topic.ipynb`` is generated (``generate``): every region becomes ::

      ### BEGIN YOUR CODE
      raise NotImplementedError()
      ### END YOUR CODE

  at the same indentation; code outputs and execution counts are cleared, jupytext pairing is removed.

Grading (``grade``)
-------------------
1. *Assemble.* The graded notebook is the pristine solution notebook with only the student's answers spliced
   in: the code between ``### BEGIN YOUR CODE`` / ``### END YOUR CODE`` of the student's task cell of the same
   NAME (cell ids play no part). Each answer must parse as code inside its own block, the solution cell's
   structure around it unchanged (an answer that dedents out of its function fails), and may not reach outside
   itself (imports other than math/torch/triton/numpy..., ``globals``/``open``/``eval``..., private or dunder
   attributes, ``global``, assigning to attributes of objects it did not create, rebinding the notebook's names).
   A rejected answer is replaced by the stub, and a note says why.
2. *Record, in two processes.* Check cells are rewritten (``minite/grading/runtime.py``) to record values instead of
   judging them: ``check_op`` records ``fn``'s outputs and input gradients (in the student's run ``ref`` is
   removed from the call before it runs), ``assert_close`` its two tensors, every ``assert`` its leaf values.
   The pristine solution runs the same way in a separate kernel and records ``ref``'s outputs.
3. *Judge in the grader's process.* Each kernel runs under ``--timeout`` seconds per cell; then the kernel and
   every process it started (the grader is their child subreaper) are killed, and only then the grader compares
   the records: ``check_op`` outputs/gradients against the reference run's with ``minite.testing``'s tolerances,
   ``assert_close`` and ``assert`` tests re-evaluated with the grader's own ``torch``. No file, no pytest report
   and no state of the student's process decides a score.

Limits (the README says them too): answers run as Python in the student's kernel, so they may call what the
notebook imported (including minite's own kernels, or torch) and read files; a student who can read
``solutions/`` can copy it (ship ``make bundle``'s zip instead); values of raw ``assert`` and ``assert_close``
checks are computed in the student's process, so patching torch in a way the lint does not see could fake them.
``check_op`` checks cannot be faked without producing the right outputs.

CLI::

    python -m minite.grading grade exercises/00_triton_from_zero.ipynb [more.ipynb] [--json] [--timeout S]
    python -m minite.grading generate [--check]                             # solutions/ -> exercises/
"""
from __future__ import annotations

from .assemble import assemble
from .cli import main
from .grader import GradeReport, grade
from .notebook import (
    BEGIN,
    BEGIN_YOURS,
    CHECK_TAG,
    END,
    END_YOURS,
    STUB,
    check_cells,
    generate_all,
    make_exercise,
    regions,
    stub_source,
    task_cells,
)
from .rewrite import rewrite_check
from .sandbox import DEFAULT_TIMEOUT, _subreaper

__all__ = ["make_exercise", "generate_all", "assemble", "grade", "GradeReport", "check_cells", "task_cells",
           "regions", "stub_source", "main", "rewrite_check", "BEGIN", "END", "BEGIN_YOURS", "END_YOURS", "STUB",
           "CHECK_TAG", "DEFAULT_TIMEOUT", "_subreaper"]
