"""Exercise notebooks: generate them from solutions, and grade a student's copy.

Conventions (docs/chapter_template.md)
--------------------------------------
* ``solutions/NN_topic.ipynb`` is the solved notebook. A *task cell* carries ``metadata.minite.task = NAME``
  and has one or more answer regions between the lines ``### BEGIN SOLUTION`` and ``### END SOLUTION``.
* A *check cell* carries ``metadata.minite.check = NAME`` (the same NAME as its task), is tagged
  ``nbval-check-output``, starts with ``# CHECK: NAME``, ends with an ``assert`` and prints ``PASS: ...``.
* A task is worth ``metadata.minite.points`` of its task cell (a positive number; 1 when absent): the report
  gives each task's points and the total (``score: earned/possible``), read from the course's solution only.
* ``exercises/NN_topic_exercise.ipynb`` is generated (``generate``; the suffix tells its JupyterLab tab from the
  lesson's, notebooks/NN_topic.ipynb): every region becomes ::

      ### BEGIN YOUR CODE
      raise NotImplementedError()
      ### END YOUR CODE

  at the same indentation; code outputs and execution counts are cleared, jupytext pairing is removed. An
  exercise whose cells were edited after it was generated (a learner's answers) is never overwritten (``--force``
  does), and one under the old name (exercises/NN_topic.ipynb) is kept and still grades; ``generate`` names both.

Grading (``grade``)
-------------------
1. *Assemble* (assembly.py, lint.py). The graded notebook is the course's pristine solution notebook
   (``solutions/<same name>`` of the installed course, never a file beside the submission; the report names it)
   with only the student's answers spliced in: the code between ``### BEGIN YOUR CODE`` / ``### END YOUR CODE``
   of the student's task cell of the same NAME (cell ids play no part). Each answer must parse as code inside its
   own block, the solution cell's structure around it unchanged (an answer that dedents out of its function
   fails), and may not reach outside itself: imports other than math/torch/triton/numpy..., ``globals`` /
   ``open`` / ``eval`` / ``type``..., getattr-likes (``operator.attrgetter``, ``methodcaller``), private or
   dunder attributes and dunder strings, file loading (``torch.load``...), ``global``, setting any attribute,
   writing into objects it did not create, rebinding the notebook's names. A rejected answer is replaced by the
   stub, and a note says why.
2. *Record, in two processes* (rewrite.py, runtime.py, sandbox.py). Check cells are rewritten to record values
   instead of judging them: ``check_op`` records ``fn``'s outputs and input gradients (in the student's run
   ``ref`` is removed from the call before it runs), ``assert_close`` its two tensors, every ``assert`` its leaf
   values. The pristine solution runs the same way in a separate kernel (the reference run) and is judged
   against itself. Each kernel runs ``python -P -s`` in its own scratch folder (working directory, temporary
   files, caches, fresh IPython/Jupyter configuration) and, where Landlock is available, can write nothing
   outside it (confine.py).
3. *Judge in the grader's process* (judge.py, guard.py), assuming the student's process ran arbitrary code.
   The grader imported all it judges with before the student's kernel started, and refuses any import of minite
   until the report is made; it is not dumpable (no same-user process can trace it or open its file
   descriptors). Each kernel runs under ``--timeout`` seconds per cell; then the kernel and every process it
   started (the grader is their child subreaper) are killed; only then the records are compared.
   Nothing the student's process recorded stands for the reference side: ``check_op`` outputs and gradients
   are compared with the reference run's, ``assert_close``'s actual tensor with the reference run's expected
   one, and an ``assert`` must hold on the student's values, and again with every value that does not depend on
   the answers (flow.py) taken from the reference run; a value that cannot be re-checked (not recordable)
   fails. No file, report or state of the student's process decides a score.

Threat model (grader.py states it in full): nothing the student's code writes may change its score, a later
grade or the grader, and the grader never undoes or blames anyone for another person's edit. Confined
(Landlock), the kernel cannot write the course, the virtual environment, the home folder or /tmp: a refused
write is named in the report, and a change to the course during a grade (an instructor's edit) is left alone.
Unconfined (no Landlock), every path of the course that changed during the run is named and kept as it is (the
grader cannot tell who wrote it): grade for credit where the report's ``confinement`` line says Landlock.

Limits (the README says them too): answers run as Python in the student's kernel, so they may compute their
result with what the notebook imported (minite's own kernels, torch), or with the check's own reference code if
they get around the answer check (a lint, not a sandbox). A student who can read ``solutions/`` can copy it
(ship ``make bundle``'s zip instead). A same-user process outside the kernel that acts on its behalf is out of
reach of the confinement: grade for credit as another user, in a container.

A notebook that cannot be read (not JSON, not UTF-8, unreadable) gets one line saying why and a score of 0;
so does a task whose name several cells of the notebook carry.

CLI (cli.py; the score line is printed last, after every student's process is dead, and the report is also
written to a file the grader creates)::

    python -m minite.grading grade exercises/00_triton_from_zero_exercise.ipynb [more.ipynb] [--json]
                                   [--timeout S] [--report PATH] [--csv PATH]
    python -m minite.grading generate [--check] [--force]                   # solutions/ -> exercises/
"""
from __future__ import annotations

import os as _os
import sys as _sys

if _sys.argv[:1] == ["-m"] and not getattr(_sys.flags, "safe_path", False) and _sys.path \
        and _sys.path[0] in ("", _os.getcwd()):
    del _sys.path[0]  # `python -m minite.grading`: import nothing more from the working directory (threat model)

from .assembly import assemble  # noqa: E402
from .cli import main  # noqa: E402
from .grader import GradeReport, course_solution, grade  # noqa: E402
from .notebook import (  # noqa: E402
    BEGIN,
    BEGIN_YOURS,
    CHECK_TAG,
    END,
    END_YOURS,
    STUB,
    check_cells,
    exercise_name,
    generate_all,
    make_exercise,
    regions,
    solution_name,
    stub_source,
    task_cells,
    task_points,
)
from .rewrite import rewrite_check  # noqa: E402
from .sandbox import DEFAULT_TIMEOUT, _subreaper  # noqa: E402

__all__ = ["make_exercise", "generate_all", "assemble", "grade", "GradeReport", "course_solution", "check_cells",
           "task_cells", "task_points", "exercise_name", "solution_name", "regions", "stub_source", "main",
           "rewrite_check", "BEGIN", "END", "BEGIN_YOURS", "END_YOURS", "STUB", "CHECK_TAG", "DEFAULT_TIMEOUT",
           "_subreaper"]
