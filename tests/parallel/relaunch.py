"""``torchrun`` for the distributed tests: minite.parallel.launch.torchrun, launched once more when a rank died of
a signal with "terminate called" after a run (gloo's C++ threads torn down at the end of a process, a crash the
CI saw once in a 20-step run whose curve then matched; minite.parallel.runtime.exit_process is the fix, this is
the suite's guard). A second death, or any other failure, is the test's result: wrong numbers never pass by a
relaunch, since the relaunch runs the same deterministic job and its output is what the test checks."""
import re
import sys
import warnings

from minite.parallel import launch

_ABORT = re.compile(r"terminate called|exitcode\s*:\s*-(6|11)\b")


def torchrun(nproc, args, **kw):
    res = launch.torchrun(nproc, args, **kw)
    if res.returncode != 0 and _ABORT.search(res.stdout or ""):
        tail = "\n".join(res.stdout.splitlines()[-8:])
        warnings.warn(f"a rank died of a signal; relaunching once. The first launch's end:\n{tail}")
        print(f"relaunch: a rank died of a signal in {args[:2]} (nproc {nproc})", file=sys.stderr)
        res = launch.torchrun(nproc, args, **kw)
    return res
