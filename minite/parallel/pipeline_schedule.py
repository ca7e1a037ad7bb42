"""Pipeline schedules as data (chapter 12): the ordered list of steps one stage runs for one optimizer step.

A step is ``("F", i)`` (forward of micro-batch i) or ``("B", i)`` (its backward). With p stages and m micro-batches:

    AFAB (GPipe):  F0 F1 ... F(m-1)  B0 B1 ... B(m-1)          every stage; m micro-batches of activations held
    1F1B:          warm-up  F0 .. F(w-1)      w = min(p - 1 - stage, m) forwards before the first backward
                   steady   F(w) B0 F(w+1) B1 ...              one forward, one backward
                   cool-down  the remaining backwards          at most p - stage micro-batches held at once

Both do the same work (m forwards and m backwards per stage) and have the same bubble: with equal-time steps
(t_F per forward, t_B = 2 t_F per backward) each stage idles (p - 1)(t_F + t_B) of a step that lasts
(m + p - 1)(t_F + t_B), so ``bubble = (p - 1) / (m + p - 1)``. 1F1B's gain is memory, not time.
``simulate`` lays a schedule out in time under those assumptions; ``minite.parallel.pipeline`` runs it for real.
"""
from __future__ import annotations

__all__ = ["afab", "one_f_one_b", "SCHEDULES", "bubble_fraction", "check_schedule", "simulate", "plot_timeline"]


def afab(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (GPipe). Backwards run in micro-batch order, like the forwards."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """PipeDream-flush 1F1B: warm-up forwards, then alternate one forward / one backward, then cool-down."""
    warm = min(p - 1 - stage, m)
    steps = [("F", i) for i in range(warm)]
    for i in range(m - warm):  # steady state: F(warm + i) then B(i)
        steps += [("F", warm + i), ("B", i)]
    return steps + [("B", i) for i in range(m - warm, m)]  # cool-down


SCHEDULES = {"afab": afab, "1f1b": one_f_one_b}


def bubble_fraction(p: int, m: int) -> float:
    """Idle fraction of every stage when forwards and backwards each take the same time on every stage."""
    return (p - 1) / (m + p - 1)


def check_schedule(steps, m: int, stage: int = 0) -> None:
    """Each micro-batch forward once and backward once, the backward after its forward; else ValueError."""
    seen_f, seen_b = [], []
    for kind, i in steps:
        if kind not in ("F", "B") or not 0 <= i < m:
            raise ValueError(f"stage {stage}: bad step {(kind, i)!r} (kinds F/B, micro-batches 0..{m - 1})")
        if kind == "B" and i not in seen_f:
            raise ValueError(f"stage {stage}: backward of micro-batch {i} before its forward")
        (seen_f if kind == "F" else seen_b).append(i)
    if sorted(seen_f) != list(range(m)) or sorted(seen_b) != list(range(m)):
        raise ValueError(f"stage {stage}: forwards {seen_f} / backwards {seen_b}: each of 0..{m - 1} exactly once")


def simulate(schedule, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> dict[int, list[tuple]]:
    """{stage: [(kind, i, start, end)]}: each step starts when its stage is free and its input has arrived
    (F i on stage s after F i on s-1; B i on s after B i on s+1); communication takes no time."""
    plans = {s: list(schedule(p, m, s)) for s in range(p)}
    done = {}  # (kind, i, stage) -> when it ended
    free = [0.0] * p  # when each stage is next free
    out = {s: [] for s in range(p)}
    pos = [0] * p  # each stage's next step
    while any(pos[s] < len(plans[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(plans[s]):
                continue
            kind, i = plans[s][pos[s]]
            dep = (kind, i, s - 1) if kind == "F" else (kind, i, s + 1)
            if 0 <= dep[2] < p and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0))
            end = start + (t_f if kind == "F" else t_b)
            done[(kind, i, s)], free[s] = end, end
            out[s].append((kind, i, start, end))
            pos[s] += 1
            progressed = True
        if not progressed:
            stuck = [plans[s][pos[s]:pos[s] + 1] for s in range(p)]
            raise RuntimeError(f"schedule deadlocks: the stages wait at steps {stuck}")
    return out


def plot_timeline(events: dict[int, list[tuple]], ax, title: str = "") -> None:
    """Gantt chart: one row per stage, forwards light, backwards dark, the micro-batch number on each bar."""
    t0 = min(e[2] for ev in events.values() for e in ev)
    for s, ev in events.items():
        for kind, i, a, b in ev:
            ax.barh(s, b - a, left=a - t0, color="#9ecae1" if kind == "F" else "#3182bd", edgecolor="k", lw=0.5)
            ax.text((a + b) / 2 - t0, s, str(i), ha="center", va="center", fontsize=7)
    ax.set_yticks(list(events), [f"stage {s}" for s in events])
    ax.invert_yaxis()
    ax.set_title(title)
