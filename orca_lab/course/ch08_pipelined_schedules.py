"""Chapter 08, pipelined schedules: the grader of Algorithm 1's loop with up to ``n_workers`` batches in
flight (chapter 03's loop grader, on more cases), and the loop's plug point, ``run_loop``."""
from __future__ import annotations

from orca_lab.course.ch03_iteration_level_scheduling import check_loop_cases, run_loop
from orca_lab.course.forked import grader
from orca_lab.course.harness import Piece


@grader
def check_in_flight(loop, seed: int = 0):
    """Chapter 08: the same loop keeping up to ``n_workers`` batches in flight, n_workers in {1, 2,
    4}, on ORCA's engine and the baseline's micro-batches (``executor="local"``: a pipeline's stages
    run one after another in this process, in the pipeline's order); batches in flight compared too."""
    check_loop_cases(loop, (1, 2, 4), ("orca", "ft"), seed)


# the loop drives the engine (``run_loop``) rather than plugging into it: ``assemble`` leaves it out
PIECES = (Piece("loop", "03, 08", "run_loop: every system, offline", check_in_flight, run_loop),)
