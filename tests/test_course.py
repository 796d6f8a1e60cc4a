"""The course's machinery without a kernel: solutions merge into the learner's notebooks one for one,
a learner notebook is cut after its first exercise, and each grader catches a wrong answer and says
what differs (the right answers pass in the solved notebooks, tests/test_notebooks.py)."""
import ast
import json
import shutil
from pathlib import Path

import pytest

from orca_lab.course import ch02_request_level_batching as ch02
from orca_lab.course import ch03_iteration_level_scheduling as ch03
from orca_lab.course import ch04_selective_batching as ch04
from orca_lab.course import ch05_kv_slot_manager as ch05
from orca_lab.course import ch07_distributed_workers as ch07
from orca_lab.course import ch12_prefix_caching as ch12
from orca_lab.course import harness, solve
from orca_lab.engine.prefix_cache import block_hash, chain_hashes
from orca_lab.engine.request import RequestState


def test_solutions_merge_one_for_one(tmp_path):
    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": ["exercise:a"]}, "source": ["# YOUR CODE HERE\n",
                                                                                         "raise NotImplementedError(\"a\")"]},
                    {"cell_type": "code", "metadata": {}, "source": ["print(a)"]}]}
    sols = tmp_path / "s.py"
    sols.write_text('"""doc"""\n\n# %% exercise: a\na = 1\n\n\n')
    solved = solve.solve(nb, solve.solutions(sols))
    assert solved["cells"][0]["source"] == ["a = 1"] and nb["cells"][0]["source"][0] == "# YOUR CODE HERE\n"
    with pytest.raises(ValueError, match=r"exercises without a solution \['a'\]"):
        solve.solve(nb, {})
    with pytest.raises(ValueError, match=r"solutions without an exercise \['b'\]"):
        solve.solve(nb, {"a": "a = 1\n", "b": "b = 2\n"})
    assert len(solve.until_first_exercise(nb)["cells"]) == 1       # it raises where it stands


def test_a_function_exercise_is_cut_after_its_check():
    nb = solve.load(solve.NOTEBOOKS / "03_iteration_level_scheduling.ipynb")
    head = solve.until_first_exercise(nb)["cells"]
    assert solve.exercise_id(head[-2]) == "select" and "ch03.check_select(select)" in "".join(head[-1]["source"])


def test_build_writes_every_chapter_solved(tmp_path):
    paths = solve.build(tmp_path, ["01_generation_and_kv_cache"])
    nb = json.loads(paths[0].read_text())
    assert [p.name for p in paths] == ["01_generation_and_kv_cache.ipynb"]
    code = [json.dumps(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert solve.exercises(nb) and not any("NotImplementedError" in c for c in code)


def skipping_select(pool, n_rsrv, max_bs, n_slots):
    """Select with `continue` where Algorithm 1 breaks: a later, smaller request overtakes."""
    batch = []
    for req in (r for r in pool if r.state is not RequestState.RUNNING):
        if len(batch) == max_bs:
            break
        if req.state is RequestState.INITIATION:
            if n_rsrv + req.max_tokens > n_slots:
                continue
            n_rsrv += req.max_tokens
        batch.append(req)
    return batch, n_rsrv


def test_graders_say_what_differs():
    with pytest.raises(harness.Mismatch, match="breaks \\(does not skip\\)"):
        ch03.check_select(skipping_select)
    with pytest.raises(harness.Mismatch, match="cu_seqlens_k differs"):
        def no_cache(reqs):            # forgets the cached tokens in cu_seqlens_k
            out = {"input_ids": [t for r in reqs for t in r.pending_tokens()],
                   "positions": [r.n_cached + i for r in reqs for i in range(len(r.pending_tokens()))],
                   "slot_mapping": [int(s) for r in reqs for s in r.slots[r.n_cached:r.n_cached + len(r.pending_tokens())]],
                   "kv_slot_ids": [int(s) for r in reqs for s in r.slots[:r.n_cached + len(r.pending_tokens())]],
                   "cu_seqlens_q": [0], "cu_seqlens_k": [0], "last_idx": []}
            for r in reqs:
                out["cu_seqlens_q"].append(out["cu_seqlens_q"][-1] + len(r.pending_tokens()))
                out["cu_seqlens_k"].append(out["cu_seqlens_k"][-1] + len(r.pending_tokens()))
                out["last_idx"].append(out["cu_seqlens_q"][-1] - 1)
            return out
        ch04.check_flatten(no_cache)
    with pytest.raises(harness.Mismatch, match="the stages differs"):
        ch07.check_split_layers(lambda n, s: [(i * (n // s), (i + 1) * (n // s)) for i in range(s)])
    with pytest.raises(harness.Mismatch, match="the finish iterations differs"):
        ch02.check_ft_finish(lambda p, g, max_bs: [max(g)] * len(g))


def test_a_grader_lets_the_learners_not_implemented_through():
    def select(pool, n_rsrv, max_bs, n_slots):
        raise NotImplementedError("select")
    with pytest.raises(NotImplementedError, match="select"):
        ch03.check_select(select)


class LowestFirst:
    """Hands out the lowest free slots, never looking for a contiguous run."""

    def __init__(self, n_slots):
        self.n_slots, self.n_reserved, self.free = n_slots, 0, list(range(n_slots))

    def can_reserve(self, n):
        return self.n_reserved + n <= self.n_slots

    def reserve(self, req, n):
        req.slots, self.free = self.free[:n], self.free[n:]
        self.n_reserved += n

    def release(self, req):
        self.free = sorted(self.free + req.slots)
        self.n_reserved -= len(req.slots)
        req.slots = None


def test_the_slot_grader_wants_contiguous_runs():
    with pytest.raises(harness.Mismatch, match="one contiguous run"):
        ch05.check_slot_manager(LowestFirst)


def cached_run(cache, tokens, block_size) -> int:
    """Tokens of the longest run of cached full blocks of ``tokens``."""
    n = 0
    for name in chain_hashes(tokens, block_size, len(tokens) // block_size):
        if name not in cache:
            break
        n += block_size
    return n


def test_the_prefix_grader_wants_full_blocks_short_of_the_last_token():
    with pytest.raises(harness.Mismatch, match="the last prompt token is always computed"):
        ch12.check_prefix_lookup(cached_run)                 # a prompt of whole blocks found all cached
    with pytest.raises(harness.Mismatch, match="full blocks only"):
        def with_partial(cache, prompt, bs):                  # counts the last, partial block's tokens too
            n = cached_run(cache, prompt[:-1], bs)
            return n and len(prompt) - 1
        ch12.check_prefix_lookup(with_partial)
    with pytest.raises(harness.Mismatch, match="stop at the first block"):
        ch12.check_prefix_lookup(lambda cache, prompt, bs: bs * sum(
            name in cache for name in chain_hashes(prompt, bs, (len(prompt) - 1) // bs)))
    ch12.check_prefix_lookup(lambda cache, prompt, bs: cached_run(cache, prompt[:-1], bs))
    with pytest.raises(harness.Mismatch, match="each later block's parent is the block before it"):
        ch12.check_block_hashes(lambda tokens, bs: [block_hash(None, tokens[i:i + bs])
                                                    for i in range(0, len(tokens) - bs + 1, bs)])


def private_names_reached(course_dir: Path) -> list[str]:
    """Each ``module: name`` where a module of ``course_dir`` imports a private name (or reads one off a
    module it imported) from outside ``orca_lab.course``."""
    found = []
    for path in sorted(course_dir.glob("*.py")):
        modules = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("orca_lab.course"):
                found += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
                modules |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith("orca_lab.course")}
        found += [f"{path.name}: {n.value.id}.{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules
                  and n.attr.startswith("_") and not n.attr.startswith("__")
                  and f"{n.value.id}.{n.attr}" not in DOCUMENTED]
    return found


# Underscored names the standard library documents as its interface: the one way to read another
# thread's stack (the capstone names the line a blocked piece is stuck at), and the one way a fork
# ends without running its parent's exit handlers (a grader's process, ``forked``).
DOCUMENTED = {"sys._current_frames", "os._exit"}


def test_the_course_reaches_the_engine_through_public_names_only():
    assert private_names_reached(Path(__file__).parents[1] / "orca_lab" / "course") == []


def test_a_learners_copy_in_notebooks_is_not_a_chapter(tmp_path):
    """A learner's copy beside the course (``02_mine.ipynb``: exercises, no solutions file) is no
    chapter: ``strays`` names it, the site's chapters and the solved build leave it out."""
    from orca_lab.course.chapters import chapters
    nbs = tmp_path / "notebooks"
    (nbs / "solutions").mkdir(parents=True)
    for stem in ("02_request_level_batching", "13_capstone"):
        shutil.copy(solve.NOTEBOOKS / f"{stem}.ipynb", nbs)
    shutil.copy(solve.SOLUTIONS / "02_request_level_batching.py", nbs / "solutions")
    shutil.copy(solve.NOTEBOOKS / "02_request_level_batching.ipynb", nbs / "02_mine.ipynb")
    assert [c.stem for c in chapters(tmp_path)] == ["02_request_level_batching", "13_capstone"]
    assert solve.strays(nbs) == [nbs / "02_mine.ipynb"]
    assert [p.name for p in solve.build(tmp_path / "solved", folder=nbs)] == [
        "02_request_level_batching.ipynb", "13_capstone.ipynb"]


def test_only_picks_exactly_the_chapters_named():
    """``--only 11`` is chapter 11, not also ``fig11_homogeneous``; a chapter is named by its number,
    its first word or its whole name; a word naming none is refused, with the names."""
    from orca_lab.course.chapters import chapters, select
    chs = chapters()
    assert [c.stem for c in select(chs, ["11"])] == ["11_after_orca"]
    assert [c.stem for c in select(chs, ["fig9", "3", "02_", "kv_memory"])] == [
        "02_request_level_batching", "03_iteration_level_scheduling", "fig9_engine", "kv_memory"]
    assert select(chs, None) == chs
    with pytest.raises(ValueError, match="--only: 'after' names no chapter; the chapters: 01_.*11_after_orca"):
        select(chs, ["after"])
