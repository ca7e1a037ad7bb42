"""``python -m minite.grading``: see minite/grading/cli.py. ``make grade`` runs it as ``python -I -m``; run
plainly, the package first drops the working directory from sys.path, and this refuses to grade if a module was
imported from there before it could (a planted argparse.py, say)."""
import sys

from .guard import _cwd_modules

planted = _cwd_modules()
if planted and sys.argv[1:2] == ["grade"]:
    print(f"error: the grader imported {', '.join(planted[:3])} from the working directory: "
          "not grading; run `python -I -m minite.grading ...` (make grade does) or from another folder",
          file=sys.stderr)
    sys.exit(2)

from .cli import main  # noqa: E402

sys.exit(main())
