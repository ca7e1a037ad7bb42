"""Derive ``backend="auto"``'s choice table (minite/choices.py, TABLE) from the recorded GPU benchmarks.

    python tools/derive_choices.py          # rewrite the table between the markers in minite/choices.py
    python tools/derive_choices.py --check  # exit 1 if the shipped table differs from what the results give

For every op below and every GPU family with a record of it (``benchmarks/results/<concept>_<device>.json``, the
name the benchmarks write; the newest GPU of the family first, in minite.choices.FAMILIES' order): the points where
minite's row and the peer's rows were measured side by side (only the fwd+bwd rows where the file has them: a
training step runs both), the ratio best-peer time / minite time at each point, their geometric mean, and the
winner: minite at a mean >= 1. The peers are only what the ``torch`` backend runs, per regime: eagerly ("eager")
and while torch.compile traces ("compile", where Inductor fuses the reference ops). None: the torch backend does not
run the benchmarked peer in that regime. ``peer_path: False``: it never does (it runs an fp32 spec), so auto keeps
minite's kernel whatever the ratio. tests/test_backend_choice.py checks the shipped table equals this tool's output.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minite.choices import FAMILIES, family, slug  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGET = ROOT / "minite" / "choices.py"
BEGIN, END = "# BEGIN TABLE (tools/derive_choices.py writes this block)\n", "# END TABLE\n"

# op: its benchmark files' concepts (first found wins), the rows' filter, minite's impl, and the peer rows the torch
# backend runs eagerly / under torch.compile with their short names (None: no such peer in that regime; no
# "compile": the eager one).
SDPA = (("sdpa flash", "sdpa cudnn"), "SDPA")
OPS = {
    "attention": dict(concepts=("attention",), minite="minite triton", eager=SDPA, compile=SDPA),
    # rmsnorm_bwdwarps16: the H100 run at today's backward warp cap (16); a plain rmsnorm_<device> run comes first
    "rmsnorm": dict(concepts=("rmsnorm", "rmsnorm_bwdwarps16"), where={"op": "rmsnorm"}, minite="minite",
                    eager=(("eager",), "eager torch"), compile=(("torch.compile",), "Inductor")),
    "layernorm": dict(concepts=("rmsnorm", "rmsnorm_bwdwarps16"), where={"op": "layernorm"}, minite="minite",
                      eager=(("eager",), "eager torch"), compile=(("torch.compile",), "Inductor")),
    "rope": dict(concepts=("rope",), minite="minite", eager=(("eager",), "eager torch"),
                 compile=(("torch.compile",), "Inductor")),
    "swiglu": dict(concepts=("swiglu",), minite="minite triton", eager=(("torch eager",), "eager torch"),
                   compile=(("torch.compile",), "Inductor")),
    "cross_entropy": dict(concepts=("cross_entropy",), where={"table": "cross_entropy"}, minite="minite triton",
                          eager=(("torch eager",), "eager torch"), compile=(("torch.compile",), "Inductor")),
    # the torch backend's softmax is the reference chain, not the benchmarked torch.softmax: no eager peer
    "softmax": dict(concepts=("softmax",), minite="minite", eager=None, compile=(("torch.compile",), "Inductor")),
    "lora": dict(concepts=("lora",), minite="minite fused", eager=(("unfused",), "unfused GEMMs"),
                 compile=(("unfused",), "unfused GEMMs")),
    # the torch backend runs fp32 specs here (a loop of fp32 GEMMs; dequantize and an fp32 GEMM): peer_path False
    "grouped_gemm": dict(concepts=("grouped_gemm",), minite="minite triton", peer_path=False,
                         eager=(("torch._grouped_mm", "torch loop"), "torch._grouped_mm")),
    "fp8_gemm": dict(concepts=("fp8_gemm",), where={"table": "gemm"}, minite="minite fp8 split", peer_path=False,
                     eager=(("torch _scaled_mm fp8",), "_scaled_mm")),
    "fp8_block": dict(concepts=("fp8_block",), where={"table": "gemm"}, minite="minite blockwise", peer_path=False,
                      eager=(("scaled_mm rowwise",), "_scaled_mm")),
}
MEASURED = {"ms", "TFLOPs", "tflops", "GBs", "GBps", "bytes", "pct_peak", "timer", "counts", "impl", "TFLOPs_base"}


def _point(row: dict) -> tuple:
    """What was measured: every field that is not a measurement and not the implementation's name."""
    return tuple(sorted((k, v) for k, v in row.items() if k not in MEASURED and not k.startswith("speedup")
                        and isinstance(v, (str, int, bool))))


def _regime(points: dict, minite: str, peers, peer_path: bool) -> dict | None:
    if peers is None:
        return None
    names, label = peers
    ratios, best = [], {}
    for impls in points.values():
        theirs = [(impls[i], i) for i in names if i in impls]
        if minite in impls and theirs:
            ms, name = min(theirs)
            ratios.append(ms / impls[minite])
            best[name] = best.get(name, 0) + 1
    if not ratios:
        return None
    ratio = round(math.exp(sum(math.log(x) for x in ratios) / len(ratios)), 2)
    return {"peer": label, "best": max(sorted(best), key=best.get), "ratio": ratio, "points": len(ratios),
            "winner": "minite" if ratio >= 1 or not peer_path else "peer"}


def _entry(spec: dict, path: Path) -> dict | None:
    data = json.loads(path.read_text())
    rows = [r for r in data.get("results", []) if "ms" in r and "impl" in r
            and all(r.get(k) == v for k, v in spec.get("where", {}).items())]
    if any(r.get("mode") == "fwd+bwd" for r in rows):
        rows = [r for r in rows if r.get("mode") == "fwd+bwd"]
    points: dict[tuple, dict] = {}
    for r in rows:
        points.setdefault(_point(r), {})[r["impl"]] = r["ms"]
    path_ok = spec.get("peer_path", True)
    eager, comp = (_regime(points, spec["minite"], spec.get(k, spec["eager"]), path_ok) for k in ("eager", "compile"))
    if eager is None and comp is None:
        return None
    return {"file": path.name, "device": data.get("device", "?"), "mode": rows[0].get("mode", "fwd"),
            "peer_path": path_ok, "eager": eager, "compile": comp}


def recorded_devices(results: Path) -> dict[str, list[tuple[int, str]]]:
    """{family: [(rank, device slug)]}, newest first, from the "device" of every result file."""
    seen: dict[str, set] = {}
    for p in sorted(results.glob("*.json")):
        try:
            name = json.loads(p.read_text()).get("device")
        except (ValueError, AttributeError):
            continue
        fam = family(name) if isinstance(name, str) else None
        if fam and p.stem.endswith("_" + slug(name)):
            rank = next(i for i, pat in enumerate(FAMILIES[fam]) if pat in slug(name))
            seen.setdefault(fam, set()).add((rank, slug(name)))
    return {fam: sorted(devs) for fam, devs in seen.items()}


def derive(results: Path = RESULTS) -> dict:
    """{family: {op: entry}} from the JSON files in `results`."""
    table: dict = {}
    for fam, devices in sorted(recorded_devices(results).items()):
        for op, spec in OPS.items():
            files = [p for c in spec["concepts"] for _, d in devices if (p := results / f"{c}_{d}.json").is_file()]
            entry = next((e for p in files if (e := _entry(spec, p)) is not None), None)
            if entry is not None:
                table.setdefault(fam, {})[op] = entry
    return table


def _fill(items: list[str], indent: str, first: str, last: str) -> list[str]:
    """`first` + the items, comma-separated, in lines of at most 120 characters, + `last`."""
    lines, line = [], indent + first
    for i, item in enumerate(items):
        piece = item + (last if i == len(items) - 1 else ",")
        if len(line) + len(piece) + 1 > 120 and line.strip() not in ("", first.strip()):
            lines.append(line.rstrip())
            line = indent + "    "
        line += ("" if line.endswith(("{", "    ")) else " ") + piece
    return lines + [line]


def render(table: dict) -> str:
    """The block of minite/choices.py: per op, its record's file, then one dict per regime."""
    lines = ["TABLE = {"]
    for fam, ops in table.items():
        lines.append(f"    {fam!r}: {{")
        for op, e in ops.items():
            items = [f"{k!r}: {v!r}" for k, v in e.items() if k not in ("eager", "compile")]
            lines += _fill(items, " " * 8, f"{op!r}: {{", ",")
            for k in ("eager", "compile"):
                inner = [f"{a!r}: {b!r}" for a, b in e[k].items()] if e[k] else []
                end = "}}," if k == "compile" else "},"
                lines += _fill(inner, " " * 12, f"{k!r}: {{", end) if inner else [f"            {k!r}: None{end[1:]}"]
        lines.append("    },")
    return BEGIN + "\n".join(lines + ["}"]) + "\n" + END


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare, do not write")
    args = p.parse_args(argv)
    text = TARGET.read_text()
    head, rest = text.split(BEGIN)
    old, tail = rest.split(END)
    new = render(derive())
    if args.check:
        same = BEGIN + old + END == new
        print("minite/choices.py: the table is " + ("up to date" if same else "stale: run tools/derive_choices.py"))
        return 0 if same else 1
    TARGET.write_text(head + new + tail)
    print(f"wrote the table of {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
