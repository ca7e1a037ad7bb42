"""``python -m minite.grading``: see minite/grading/cli.py."""
import sys

from .cli import main

sys.exit(main())
