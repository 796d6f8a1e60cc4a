"""Run a chapter's notebook and time it: wall time, and the CPU time of the kernel and every process
under it (workers, servers, a simulation's process pool).

CPU is read twice and the larger kept: ``RUSAGE_CHILDREN`` counts the kernel and what it waited for,
but not a process pool's workers, whose parent (a forkserver) outlives the kernel; so a sampler also
reads, every ``SAMPLE_S``, the CPU time of each process descended from this one (``/proc``), and sums
the last value seen of each (a process that lives less than ``SAMPLE_S`` may be missed).

A cell that raises is kept with its error and the notebook goes on (``allow_errors``): a learner's
notebook with an exercise left undone still builds, its error shown where the exercise is.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import nbformat

from orca_lab.course import mine
from orca_lab.course.chapters import Chapter

TIMEOUT_S = 900   # per cell
SAMPLE_S = 0.25


def execute(chapter: Chapter, source: Path, out: Path, out_dir: Path, package: Path) -> dict:
    """Execute ``source`` (the chapter's notebook) into ``out``; reproductions export into ``out_dir``;
    its exercise cells save into ``package`` (the kernel's ``$ORCA_LAB_MY_ORCA``), never into the
    learner's own ``my_orca``, which a solved chapter would overwrite with its solutions. Returns
    the chapter's run: when, wall and CPU seconds, cells, cells that raised."""
    import papermill as pm
    from nbclient import NotebookClient
    params = dict(chapter.parameters)
    if chapter.part == "reproduce":
        params.update(out_dir=str(out_dir), formats=["html", "png"])
    out.parent.mkdir(parents=True, exist_ok=True)
    nb = nbformat.from_dict(pm.execute_notebook(str(source), None, parameters=params, prepare_only=True,
                                                kernel_name="python3", progress_bar=False, log_output=False))
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(source.parent)}})
    started, load = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg()[0]
    with _kernel_env(mine.ENV, str(package)), DescendantsCPU() as sampled:
        cpu0, t0 = _children_cpu(), time.perf_counter()
        client.execute()
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    nbformat.write(nb, out)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [c for c in code if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    return {"notebook": chapter.path, "parameters": dict(chapter.parameters), "started": started,
            "load_average_1min_before": round(load, 2), "wall_s": round(wall, 1),
            "cpu_s": round(max(cpu, sampled.total()), 1), "code_cells": len(code), "cells_with_errors": len(errors)}


@contextmanager
def _kernel_env(name: str, value: str):
    """``name=value`` in the environment the kernel starts with (it inherits this process's)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name) if before is None else os.environ.update({name: before})


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class DescendantsCPU:
    """Samples the CPU seconds of every process descended from this one while the block runs."""

    def __init__(self):
        self.seen: dict[tuple[int, str], float] = {}   # (pid, start time) -> last CPU seconds read
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def total(self) -> float:
        return sum(self.seen.values())

    def _run(self):
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self):
        stats = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                # after the name: state ppid ... utime (12th) stime (13th) ... starttime (20th)
                stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick, fields[19])
        mine, frontier = set(), [os.getpid()]
        children = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for child in children.get(frontier.pop(), []):
                mine.add(child)
                frontier.append(child)
        for pid in mine:
            _, cpu, start = stats[pid]
            self.seen[(pid, start)] = cpu
