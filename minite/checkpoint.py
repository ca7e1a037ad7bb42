"""Checkpoints of ``minite.train``: written atomically, checksummed, checked on load, debris cleaned up.

File layout: the ``torch.save`` bytes of the state dict, then a 80-byte trailer ``MINITE-SHA256:<64 hex>\\n``
holding the SHA-256 of those bytes. ``load_checkpoint`` recomputes it and refuses a mismatch: a flipped byte
inside a tensor loads fine with ``torch.load`` and would resume with a silently wrong optimizer state.
A file without the trailer (written before checksums) still loads, with its structure checked.

Writes go to ``.<name>.tmp<pid>`` in the same directory, fsync, then ``os.replace``: a crash leaves the old or
the new checkpoint, never half of one. A process killed during the write leaves its temporary file behind;
``clean_orphans`` removes those at the next start.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
from pathlib import Path

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "clean_orphans", "load_model_state",
           "rng_state", "set_rng_state", "check_finite", "REQUIRED_KEYS"]

_MAGIC = b"MINITE-SHA256:"
_TRAILER_LEN = len(_MAGIC) + 64 + 1
REQUIRED_KEYS = ("model", "optimizer", "config", "step")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (missing, truncated, corrupt) or does not fit the configuration."""


def _tmp_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.tmp{pid}")


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write `state` to `path` atomically (temp file, fsync, os.replace), with a SHA-256 trailer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)  # serialise first: a failure here leaves nothing on disk
    payload = buf.getbuffer()
    tmp = _tmp_name(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # only when something failed before os.replace
            tmp.unlink()
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible on Windows)
        fd = os.open(path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers (an exception between write and replace) are orphans too
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else: leave its file alone
    return True


def clean_orphans(path: str | os.PathLike) -> list[tuple[Path, int]]:
    """Remove ``.<name>.tmp<pid>`` files next to `path` whose writer is gone (killed mid-write).

    Returns [(file, size in bytes)] of what was removed, for the caller to report.
    """
    path = Path(path)
    removed = []
    if not path.parent.is_dir():
        return removed
    for p in path.parent.glob(f".{path.name}.tmp*"):
        pid = p.name[len(f".{path.name}.tmp"):]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            size = p.stat().st_size
            p.unlink()
            removed.append((p, size))
    return removed


def _check_structure(path: Path, state) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a minite.train checkpoint (a {type(state).__name__}, "
                              f"not a dict)")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a complete minite.train checkpoint (missing {missing})")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {path}: 'step' must be an int >= 0, got {type(step).__name__} {step!r}")
    for key in ("model", "optimizer", "config"):
        if key == "optimizer" and state[key] is None:  # a torchrun run whose optimizer state is sharded (ZeRO,
            continue                                    # TP, PP): the model is the consolidated dense one
        if not isinstance(state[key], dict):
            raise CheckpointError(f"checkpoint {path}: {key!r} must be a dict, got {type(state[key]).__name__}")
    bad = [k for k, v in state["model"].items() if not isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
    if bad:
        raise CheckpointError(f"checkpoint {path}: model entries {bad[:5]} are not tensors")


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a checkpoint written by save_checkpoint: checksum verified, structure checked, or a CheckpointError
    naming the file and what is wrong."""
    if not (path := Path(path)).is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    data = path.read_bytes()
    trailer = data[-_TRAILER_LEN:]
    if len(data) >= _TRAILER_LEN and trailer.startswith(_MAGIC):
        data = data[:-_TRAILER_LEN]
        stored = trailer[len(_MAGIC):-1].decode("ascii", "replace")
        actual = hashlib.sha256(data).hexdigest()
        if stored != actual:
            raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 is {actual[:16]}..., the one stored "
                                  f"when it was written is {stored[:16]}...; restore a copy or start a new --out_dir")
    try:  # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0][:200]  # torch's first line, not its long weights_only essay
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: {why})") from e
    if isinstance(state, dict) and not any(k in state for k in ("model", "config")):
        raise CheckpointError(f"checkpoint {path} is not a minite.train checkpoint (keys {sorted(state)[:8]})")
    _check_structure(path, state)
    return state


def load_model_state(model: torch.nn.Module, sd: dict, path) -> None:
    """model.load_state_dict(sd), with a CheckpointError naming each wrong-shaped, missing or unknown tensor."""
    own = model.state_dict()
    tensors = [(k, v, own[k]) for k, v in sd.items() if k in own and isinstance(v, torch.Tensor)
               and isinstance(own[k], torch.Tensor)]
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(o.shape)}" for k, v, o in tensors if v.shape != o.shape]
    missing = [k for k in own if k not in sd and not k.endswith("_extra_state")]
    unknown = [k for k in sd if k not in own and not k.endswith("_extra_state")]
    if wrong or missing or unknown:
        parts = ([f"wrong shapes: {'; '.join(wrong[:5])}"] if wrong else []) + \
                ([f"missing: {missing[:5]}"] if missing else []) + ([f"unknown: {unknown[:5]}"] if unknown else [])
        raise CheckpointError(f"checkpoint {path} does not fit the model ({', '.join(parts)})")
    try:
        model.load_state_dict(sd)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot load the model state ({e})") from e


def rng_state(sampler) -> dict:
    """Every random state a run draws from (torch, Python, numpy, CUDA, the batch sampler): a resumed run
    continues exactly where the interrupted one was."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "python_version": 3,
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "sampler": sampler.state_dict(),
    }


def set_rng_state(state: dict, sampler) -> None:
    """Inverse of rng_state."""
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), None))
    np.random.set_state((state["numpy"][0], state["numpy"][1].numpy().astype(np.uint32), *state["numpy"][2:]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    sampler.load_state_dict(state["sampler"])


def check_finite(model_state: dict, path) -> None:
    """Refuse weights holding NaN or inf (a run that diverged before it was stopped): resuming or fine-tuning them
    trains nothing. The error names the first tensors and how many of their values are not finite."""
    bad = [f"{k} ({int((~torch.isfinite(v)).sum())} of {v.numel()})" for k, v in model_state.items()
           if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights: {', '.join(bad[:4])}"
                              f"{' ...' if len(bad) > 4 else ''}; go back to an earlier checkpoint")
