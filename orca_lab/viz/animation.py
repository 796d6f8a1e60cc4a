"""Algorithm 1 step by step: one frame per scheduled iteration, and a Play + slider widget over them.

``ScheduleFrames(result)`` is a plain sequence of ``Frame`` objects computed from a ``RunResult``
alone (no engine, no browser), so tests step through it like a list. Frame ``k`` is the moment the
scheduler has just submitted iteration ``k`` (a last frame shows the end, every batch back):

- the request pool: each request waiting for its first iteration (INITIATION), running in a batch
  that is in flight, or back and waiting for its next iteration (INCREMENT); finished ones leave;
- the batch ``Select`` chose, and Algorithm 1's ``n_rsrv`` after choosing it;
- the batches in flight (the engine returns them oldest first, so they are the last ``in_flight``
  iterations) and, on the run's clock, what each worker computes when iteration ``k`` enters
  worker 1. With the in-process executor the stages run one after another, so only one worker is
  ever busy there; a pipelined executor (worker processes, a cost model) shows them all busy.
"""
from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from orca_lab.viz._runs import by_iteration, n_slots_of, n_stages, prefill_notes, request_color, request_labels

STATES = ("waiting", "running", "increment")   # INITIATION, RUNNING, INCREMENT of Algorithm 1


@dataclass(frozen=True)
class PoolEntry:
    rid: int
    label: str
    state: str            # one of STATES
    n_done: int           # iterations of this request that have returned
    n_total: int          # iterations it runs in the whole run


@dataclass(frozen=True)
class Frame:
    index: int
    iteration: int | None                        # None: the last frame, every batch back
    time: float                                  # when the iteration entered worker 1 (or the end)
    pool: tuple[PoolEntry, ...]                  # requests in the system, by arrival
    batch: tuple[int, ...]                       # the request ids Select chose
    phases: tuple[str, ...]
    n_rsrv: int
    kv_used: int
    n_slots: int | None
    in_flight: tuple[tuple[int, ...], ...]       # batches in flight, oldest first (this one last)
    workers: tuple[tuple[int, ...] | None, ...]  # per worker, the batch it computes at ``time``
    returned: tuple[tuple[int, ...], ...]        # batches back since the previous frame
    finished: tuple[int, ...]                    # requests done by now

    def describe(self, labels: dict[int, str]) -> str:
        """One line, e.g. ``iteration 3: Select -> AB; n_rsrv 40; in flight CD EF AB``."""
        name = lambda rids: "".join(labels[r] for r in rids) if rids else "-"
        if self.iteration is None:
            return f"end: every batch returned; finished {name(self.finished)}"
        workers = " | ".join(name(w) if w else "idle" for w in self.workers)
        return (f"iteration {self.iteration}: Select -> {name(self.batch)}; n_rsrv {self.n_rsrv}; "
                f"in flight {' '.join(name(b) for b in self.in_flight)}; workers {workers}")


class ScheduleFrames(Sequence):
    """The frames of a run, one per iteration in the order the scheduler submitted them."""

    def __init__(self, result, n_slots: int | None = None):
        self.result = result
        self.labels = request_labels(result)
        self.n_stages = n_stages(result)
        self.n_slots = n_slots_of(result, n_slots)
        self._heads = [stages[0] for stages in by_iteration(result).values()]   # stage 0, in order
        self._total = Counter(rid for h in self._heads for rid in h.rids)      # iterations per request
        self._frames: dict[int, Frame] = {}
        self._notes = prefill_notes(result)                                    # chunks, recomputations

    def __len__(self) -> int:
        """One frame per iteration, and a last one once every batch has returned."""
        return len(self._heads) + 1 if self._heads else 0

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"frame {k} is out of range: allowed [0, {len(self) - 1}]")
        if k not in self._frames:
            self._frames[k] = self._build(k)
        return self._frames[k]

    def _n_returned(self, k: int) -> int:
        """How many iterations (in submission order) had returned when frame ``k`` was taken:
        the engine returns batches oldest first, so all but the last ``in_flight`` submitted."""
        if k < 0 or k == len(self._heads):
            return max(k, 0)
        return k - self._heads[k].in_flight + 1

    def _build(self, k: int) -> Frame:
        end = k == len(self._heads)                           # the last frame: every batch back
        head = None if end else self._heads[k]
        back, back_before = self._n_returned(k), self._n_returned(k - 1)
        now = max(r.end for r in self.result.iterations) if end else head.start
        flying = tuple(h.rids for h in self._heads[back:k + 1])
        done = Counter(rid for h in self._heads[:back] for rid in h.rids)
        finished = tuple(sorted(rid for rid, n in done.items() if n == self._total[rid]))
        return Frame(k, None if end else head.iteration, now, self._pool(k, now, done, flying, finished),
                     head.rids if head else (), head.phases if head else (),
                     head.kv_reserved if head else 0, head.kv_used if head else 0, self.n_slots, flying,
                     self._workers(now), tuple(h.rids for h in self._heads[back_before:back]), finished)

    def _pool(self, k, now, done, flying, finished) -> tuple[PoolEntry, ...]:
        seen = {rid for h in self._heads[:k + 1] for rid in h.rids}
        running = {rid for batch in flying for rid in batch}
        pool = []
        for r in sorted(self.result.requests, key=lambda r: (r.arrival, r.rid)):
            if r.rid in finished or (r.rid not in seen and r.arrival > now):
                continue                                      # gone, or not arrived yet
            state = "running" if r.rid in running else "increment" if done[r.rid] else "waiting"
            pool.append(PoolEntry(r.rid, self.labels[r.rid], state, done[r.rid], self._total[r.rid]))
        return tuple(pool)

    def _workers(self, now: float) -> tuple:
        """What each worker computes at ``now``: the batch whose stage holds that instant, or None."""
        busy = {rec.stage: rec.rids for rec in self.result.iterations if rec.start <= now < rec.end}
        return tuple(busy.get(s) for s in range(self.n_stages))

    def describe(self, k: int) -> str:
        """The frame's line, and the chunks and recomputations of its batch (paged / chunked)."""
        f = self[k]
        notes = [f"{self.labels[r]} {self._notes[(f.iteration, r)]}" for r in f.batch if (f.iteration, r) in self._notes]
        return f.describe(self.labels) + (f"; {', '.join(notes)}" if notes else "")

    def to_html(self, k: int) -> str:
        return render_frame(self[k], self.labels, len(self), self._notes)


# -- rendering: plain HTML, so the widget needs no plotting library in the browser ---------------
_BOX = ("display:inline-block;min-width:30px;margin:2px;padding:3px 6px;border-radius:4px;"
        "text-align:center;font:13px monospace;color:white;")
_STATE_STYLE = {"waiting": "opacity:0.35;border:2px dashed #333;",
                "running": "border:2px solid #000;box-shadow:0 0 0 2px #ffd700;",
                "increment": "border:2px solid transparent;"}


def _box(rid, labels, extra="", sub=""):
    sub = f"<br><small>{html.escape(sub)}</small>" if sub else ""
    return (f'<span class="orca-req" style="{_BOX}background:{request_color(rid)};{extra}">'
            f"{html.escape(labels[rid])}{sub}</span>")


def _batch(rids, labels, extra=""):
    if not rids:
        return '<span style="color:#999;font:13px monospace">idle</span>'
    return ('<span style="display:inline-block;border:1px solid #999;border-radius:6px;padding:1px">'
            + "".join(_box(r, labels, extra) for r in rids) + "</span>")


def render_frame(f: Frame, labels: dict[int, str], n_frames: int | None = None, notes: dict | None = None) -> str:
    """A frame as HTML: pool, Select's choice (with ``notes``: chunks, recomputations), n_rsrv
    against n_slots, workers, returns."""
    row = lambda title, body: (f'<tr><td style="padding:4px 10px 4px 0;color:#555;white-space:nowrap;'
                               f'vertical-align:middle">{title}</td><td>{body}</td></tr>')
    pool = "".join(_box(e.rid, labels, _STATE_STYLE[e.state], f"{e.n_done}/{e.n_total}") for e in f.pool)
    note = lambda r: f", {notes[(f.iteration, r)]}" if notes and (f.iteration, r) in notes else ""
    chosen = " ".join(f"{labels[r]}&nbsp;<small>({p}{note(r)})</small>" for r, p in zip(f.batch, f.phases)) or "-"
    kv = f"n_rsrv = {f.n_rsrv}"
    if f.n_slots:
        pct = lambda n: f"{100 * n / f.n_slots:.1f}%"
        kv += (f" of n_slots = {f.n_slots} (holding real K/V: {f.kv_used})"
               '<div style="width:320px;height:10px;background:#e5e5e5;border-radius:3px;display:flex">'
               f'<div style="width:{pct(f.kv_used)};background:#1f77b4"></div>'
               f'<div style="width:{pct(f.n_rsrv - f.kv_used)};background:#ff7f0e"></div></div>')
    workers = "<br>".join(f"worker {s + 1}: {_batch(w or (), labels)}" for s, w in enumerate(f.workers))
    flying = " ".join(_batch(b, labels) for b in f.in_flight)
    back = " ".join(_batch(b, labels) for b in f.returned) or "-"
    done = " ".join(_box(r, labels, "opacity:0.6;") for r in f.finished) or "-"
    of = f" / {n_frames - 1}" if n_frames else ""
    return (f'<div class="orca-frame" data-frame="{f.index}" style="font:14px sans-serif">'
            f'<div class="orca-frame-title" style="font-weight:bold;margin-bottom:4px">frame {f.index}{of}: '
            f"{'the end, every batch back' if f.iteration is None else f'iteration {f.iteration}'}, "
            f"t = {f.time:.4g}</div><table>"
            + row("returned", back) + row("request pool", pool or "-")
            + row("Select chose", chosen) + row("K/V slots", kv)
            + row("in flight<br><small>oldest first</small>", flying) + row("workers", workers)
            + row("finished", done)
            + "</table><small>pool: dashed = waiting for its first iteration, gold = running, "
              "plain = back, waiting for its next; n/m = iterations returned / needed</small></div>")


class ScheduleAnimation:
    """Play + slider over ``ScheduleFrames``; displaying it shows the widget.

    The Play button drives the slider in the browser (``jslink``); the slider's value comes back to
    the kernel, which renders that frame. Without a browser, set ``slider.value`` (or ``show(k)``).
    """

    def __init__(self, frames: ScheduleFrames, interval_ms: int = 900):
        import ipywidgets as w
        if not len(frames):
            raise ValueError("the run has no iteration to animate")
        self.frames = frames
        self.play = w.Play(value=0, min=0, max=len(frames) - 1, step=1, interval=interval_ms,
                           description="Play")
        self.slider = w.IntSlider(value=0, min=0, max=len(frames) - 1, description="frame")
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.view = w.HTML(frames.to_html(0))
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.view])
        self.widget.add_class("orca-animation")

    def show(self, k: int):
        self.view.value = self.frames.to_html(k)
        if self.slider.value != k:
            self.slider.value = k

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def animate(result, interval_ms: int = 900) -> ScheduleAnimation:
    """The widget for a ``RunResult`` (or frames already built)."""
    frames = result if isinstance(result, ScheduleFrames) else ScheduleFrames(result)
    return ScheduleAnimation(frames, interval_ms)
