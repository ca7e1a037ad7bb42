"""Line budgets from DESIGN.md §2: a concept file <= 300 lines (attention <= 450), parallel <= 250, train.py <= 400."""
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
# _library.py is not a concept file: it registers every op for torch.compile (issue 22 moves each registration
# into its concept file, which retires this line).
rules = [("minite/kernels/attention.py", 450), ("minite/kernels/_library.py", 360),
         ("minite/kernels/*.py", 300), ("minite/formats/*.py", 300),
         ("minite/layers/*.py", 300), ("minite/parallel/*.py", 250), ("minite/train.py", 400)]
seen, over = set(), []
for pattern, limit in rules:
    for f in sorted(root.glob(pattern)):
        if f in seen:
            continue
        seen.add(f)
        n = len(f.read_text().splitlines())
        if n > limit:
            over.append(f"{f.relative_to(root)}: {n} lines > {limit}")
print("line budgets: " + ("; ".join(over) if over else f"ok ({len(seen)} files)"))
sys.exit(1 if over else 0)
