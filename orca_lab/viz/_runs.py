"""What the figures and the animation read from a ``RunResult``: its iterations grouped by index,
one label and one colour per request, one look per phase. Shared so that request C is the same
colour in the timeline, the K/V figure and the animation."""
from __future__ import annotations

import string
from collections import defaultdict

from plotly.colors import qualitative

PALETTE = qualitative.D3 + qualitative.Set2 + qualitative.Pastel1
# prefill hatched, decode solid, held (the baseline computes a finished request) crossed
PHASE_PATTERN = {"prefill": "/", "decode": "", "held": "x"}


def as_list(results) -> list:
    return list(results) if isinstance(results, (list, tuple)) else [results]


def by_iteration(result) -> dict[int, list]:
    """``{iteration: [record of stage 0, stage 1, ...]}`` in iteration order."""
    groups = defaultdict(list)
    for rec in result.iterations:
        groups[rec.iteration].append(rec)
    return {i: sorted(groups[i], key=lambda r: r.stage) for i in sorted(groups)}


def n_stages(result) -> int:
    return 1 + max((r.stage for r in result.iterations), default=0)


def request_labels(result) -> dict[int, str]:
    """Letters, as in the paper's Figure 8, while there are at most 26 requests; numbers after."""
    rids = sorted({r.rid for r in result.requests} | {rid for it in result.iterations for rid in it.rids})
    if len(rids) <= 26:
        return {rid: string.ascii_uppercase[i] for i, rid in enumerate(rids)}
    return {rid: str(rid) for rid in rids}


def request_color(rid: int) -> str:
    return PALETTE[rid % len(PALETTE)]


def n_slots_of(result, n_slots: int | None = None) -> int | None:
    """The K/V pool size: given, or as recorded in the run's engine configuration."""
    return n_slots if n_slots is not None else result.config.get("n_slots")


def prefill_notes(result) -> dict[tuple[int, int], str]:
    """``{(iteration, rid): note}`` for the policies after ORCA: a prompt split over iterations
    ("chunk 2/3"), or a request preempted after it had produced tokens, recomputing its context
    ("recompute")."""
    notes, runs, decoded = {}, defaultdict(list), set()

    def close(rid):                      # a run of prefill iterations of one request has ended
        its = runs.pop(rid, [])
        for k, i in enumerate(its if len(its) > 1 else [], 1):
            notes[(i, rid)] = (notes.get((i, rid), "") + f" chunk {k}/{len(its)}").strip()

    for i, stages in by_iteration(result).items():
        for rid, phase in zip(stages[0].rids, stages[0].phases):
            if phase == "decode":
                close(rid)
                decoded.add(rid)
            elif phase == "prefill":
                if rid in decoded:           # it had produced tokens: its K/V was freed, now rebuilt
                    close(rid)
                    decoded.discard(rid)
                    notes[(i, rid)] = "recompute"
                runs[rid].append(i)
    for rid in list(runs):
        close(rid)
    return notes
