"""Recorded benchmark results for the lessons: ``benchmarks/results/<concept>_<device>.json`` of a source checkout.

A lesson loads what a GPU run recorded and must still run where nothing is recorded (an installed wheel, a fresh
benchmark name): ``recorded`` then returns an empty dict and the lesson says so.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def recorded(concept: str, results: Path = RESULTS) -> dict[str, dict]:
    """{file name: its JSON} for every ``<concept>_*.json`` in `results`, sorted by name; {} when there is none."""
    if not results.is_dir():
        return {}
    return {p.name: json.loads(p.read_text()) for p in sorted(results.glob(f"{concept}_*.json"))}
