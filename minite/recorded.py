"""Recorded benchmark results for the lessons: ``benchmarks/results/<concept>_<device>.json`` of a source checkout.

A lesson loads what a GPU run recorded and must still run where nothing is recorded (an installed wheel, a fresh
benchmark name): ``recorded`` then returns an empty dict, ``recorded_for`` None, and the lesson says so.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
FALLBACK = "nvidia-h200"  # the device whose run a lesson shows where its own device recorded none


def recorded(concept: str, results: Path = RESULTS) -> dict[str, dict]:
    """{file name: its JSON} for every ``<concept>_*.json`` in `results`, sorted by name; {} when there is none."""
    if not results.is_dir():
        return {}
    return {p.name: json.loads(p.read_text()) for p in sorted(results.glob(f"{concept}_*.json"))}


def _current_device() -> str | None:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def recorded_for(concept: str, device: str | None = None, results: Path = RESULTS) -> tuple[str, dict] | None:
    """(file name, JSON) of the run of `concept` recorded on `device` (a name as its JSON's "device" spells it,
    e.g. "NVIDIA H200"; None: this process's CUDA device, if any), else of the run recorded on the H200
    (``<concept>_nvidia-h200.json``), else None."""
    runs = recorded(concept, results)
    here = _current_device() if device is None else device
    name = next((n for n, r in runs.items() if here is not None and r.get("device") == here),
                f"{concept}_{FALLBACK}.json")
    return (name, runs[name]) if name in runs else None
