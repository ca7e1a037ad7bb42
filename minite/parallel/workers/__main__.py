"""``python -m minite.parallel.workers CHECK ... --out DIR`` (under torchrun): see the package's docstring."""
import sys

from minite.parallel.workers import main

sys.exit(main())
