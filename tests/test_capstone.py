"""The learner's own engine without a kernel: ``%%exercise`` cells saved as a package that stands
alone (``course/mine.py``), its pieces plugged all at once (``plug.assemble``) giving the package's
tokens, ``orca-lab serve --plugins`` running them, and the batch-formation grader catching wrong
versions, bounded. The capstone notebook itself runs in tests/test_notebooks.py."""
import time
from collections import deque

import pytest
import torch

from orca_lab import LLM, EngineConfig
from orca_lab.cli import main
from orca_lab.course import ch02_request_level_batching as ch02
from orca_lab.course import ch03_iteration_level_scheduling as ch03
from orca_lab.course import ch11_after_orca as ch11
from orca_lab.course import ch12_prefix_caching as ch12
from orca_lab.course import arrivals, bounded, guards, harness, mine, plug, regrade, solve
from orca_lab.engine.request import RequestState
from orca_lab.engine.scheduler import RequestLevelScheduler
from orca_lab.serving.engine_core import EngineArgs
from orca_lab.workload import TraceItem, few_shot_trace, paper_trace

from tests.test_course import skipping_select
from tests.test_graders import solution

# the chapters' solutions, and what the notebook cells before them gave them to read
CHAPTERS = {"02_request_level_batching": ["form_batch"], "03_iteration_level_scheduling": ["select", "loop"],
            "04_selective_batching": ["flatten"], "05_kv_slot_manager": ["slot_manager"],
            "07_distributed_workers": ["split_linear"], "08_pipelined_schedules": ["loop"],
            "11_after_orca": ["block_allocator", "victim", "fill_budget"],
            "12_prefix_caching": ["block_hashes", "cached_prefix", "block_lru", "block_refs"]}


@pytest.fixture
def package(tmp_path):
    """A learner's package written as the solved notebooks write it: each exercise cell saved."""
    return write_package(tmp_path / "my_orca", CHAPTERS)


def write_package(folder, chapters: dict):
    for stem, exercises in chapters.items():
        answers = solve.solutions(solve.SOLUTIONS / f"{stem}.py")
        namespace = {"__name__": "__main__", "RequestState": RequestState, "torch": torch}     # a notebook's
        for ex in exercises:
            exec(answers[ex], namespace)
            mine.save(ex, answers[ex], namespace, folder)
    return folder


def test_a_saved_exercise_imports_what_it_read_from_the_notebook(package):
    text = (package / "select.py").read_text()
    assert "from orca_lab.engine.request import RequestState" in text and "__all__ = ['select']" in text
    assert set(mine.load(package)) == set(plug.PIECES)


def test_a_cell_reading_a_plain_value_of_the_notebook_is_refused_naming_it(tmp_path):
    with pytest.raises(NameError, match="block_size cannot be imported"):
        mine.save("f", "def f(n):\n    return n // block_size\n", {"block_size": 4}, tmp_path)


def test_an_earlier_exercise_is_imported_from_its_own_file(tmp_path):
    mine.save("a", "def a():\n    return 1\n", {}, tmp_path)
    namespace = {}
    exec("def a():\n    return 1\n", namespace)
    path = mine.save("b", "def b():\n    return a() + 1\n", namespace, tmp_path)
    assert "from .a import a" in path.read_text()
    assert mine.load(tmp_path)["b"]() == 2


def test_plugins_that_are_neither_a_folder_nor_a_module_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="plugins='nowhere_at_all'"):
        EngineArgs("tiny", plugins="nowhere_at_all")
    with pytest.raises(SystemExit):
        main(["serve", "--plugins", str(tmp_path / "missing")])
    assert "plugins=" in capsys.readouterr().err


def test_the_assembled_engine_gives_the_packages_tokens_and_schedule(package):
    pieces = mine.load(package)
    llm = LLM("tiny", seed=0, engine=EngineConfig(max_bs=3, n_slots=3 * 1024))
    trace = paper_trace(8, None, 0, scale=0.04, vocab_size=llm.cfg.vocab_size)
    for system, expected in (("orca", ["select", "flatten", "SlotManager"]), ("ft", ["form_batch"])):
        reference = llm.serve(trace, system=system)
        engine = llm.new_engine(system)
        assert plug.assemble(engine, pieces) == expected
        yours = ch03.run_loop(engine, pieces["loop"], trace)
        engine.close()
        assert [r.output for r in yours.requests] == [r.output for r in reference.requests]
        assert [it.rids for it in yours.iterations] == [it.rids for it in reference.iterations]



def wrong_where_its_grader_never_looked(pieces: dict) -> dict:
    """Each piece the package can answer for, wrong only past what its grader tries."""
    flatten, hashes, split, reduce = (pieces[n] for n in ("flatten", "block_hashes", "split_linear", "all_reduce"))

    def byte_positions(requests):                      # positions kept in a byte: right below 256
        flat = flatten(requests)
        return {**flat, "positions": [p % 256 for p in flat["positions"]]}

    def cut_for_the_next_rank(weight, bias, t, T, parallel):
        return split(weight, bias, (t + 1) % T, T, parallel) if weight.shape[0] > 100 else split(weight, bias, t, T, parallel)

    return {"flatten": byte_positions, "cached_prefix": lambda cache, tokens, bs: 0,
            "block_hashes": lambda tokens, bs: hashes(tokens, bs)[::-1],
            "split_linear": cut_for_the_next_rank, "all_reduce": lambda partials: reduce(partials[:1] * len(partials))}


@pytest.mark.parametrize("wrong", ["flatten", "block_hashes", "cached_prefix", "split_linear", "all_reduce"])
def test_a_piece_the_package_can_answer_for_is_checked_where_it_runs(package, wrong):
    """A piece whose every answer the package can also give, wrong only where its grader never looked
    (a context past 255 tokens, a cache hit, a large layer's cut, a sum), stops the engine naming it
    and what differs: the model never runs on its answer, so no wrong text comes out."""
    pieces = {**mine.load(package)}
    pieces[wrong] = wrong_where_its_grader_never_looked(pieces)[wrong]
    cached = wrong in ("block_hashes", "cached_prefix")          # (each plugged with its partner, right)
    cfg = EngineConfig(max_bs=2, n_slots=2 * 1024, block_size=8, prefix_caching=cached)
    engine = LLM("tiny", seed=0, engine=cfg).new_engine("paged" if cached else "orca")
    together = {"block_hashes": "cached_prefix", "cached_prefix": "block_hashes", "split_linear": "all_reduce",
                "all_reduce": "split_linear"}
    prompt = list(range(40)) if cached else [7] * 300
    with pytest.raises(guards.PieceFault, match=f"your {wrong} .*(positions|chain of hashes|found 0 tokens|cut "
                                                 ".*shard_ranges|to other than their sum)") as e:
        plug.assemble(engine, {n: pieces[n] for n in (wrong, together.get(wrong, wrong))},    # (the cut: here)
                      tensor_ranks=2 if wrong in ("split_linear", "all_reduce") else 1)
        engine.run([TraceItem(arrival, (*prompt, last), 2) for arrival, last in ((0.0, 1), (1.0, 2))])
    engine.close()
    assert e.value.piece == wrong



def test_right_pieces_written_otherwise_serve_the_packages_tokens(package):
    """What a grader takes, a plug point takes too: a generator of block ids or of block names, a
    flattening into numpy arrays; the learner's allocator on an LLM whose cache an earlier engine
    filled (its cached blocks are not free); and a loop handing back tokens that say they are the
    batch's but are not is stopped naming it."""
    import numpy as np
    pieces = mine.load(package)
    allocator, hashes, flatten = pieces["BlockAllocator"], pieces["block_hashes"], pieces["flatten"]
    otherwise = {"BlockAllocator": type("Yields", (allocator,), {"take": lambda self, n: (
                     b for b in super(type(self), self).take(n))}),
                 "block_hashes": lambda tokens, bs: (h for h in hashes(tokens, bs)),
                 "flatten": lambda reqs: {k: np.asarray(v) for k, v in flatten(reqs).items()}}
    cfg = EngineConfig(max_bs=2, n_slots=64 * 4, block_size=4, prefix_caching=True)
    trace = few_shot_trace(4, prefix_len=12, question_len=(2, 5), gen_len=(3, 5), vocab_size=257, seed=0)
    for system, names in (("paged", ["BlockAllocator", "block_hashes"]), ("orca", ["flatten"])):
        llm = LLM("tiny", seed=0, engine=cfg if system == "paged" else EngineConfig(max_bs=2, n_slots=1024))
        want = [r.output for r in llm.new_engine(system).run(trace).requests]
        engine = llm.new_engine(system)            # the same LLM: its cache holds the first run's blocks
        plug.assemble(engine, {**{n: pieces[n] for n in ("cached_prefix",) if system == "paged"},
                               **{n: otherwise[n] for n in names}})
        assert [r.output for r in engine.run(trace).requests] == want, system
    from tests.test_graders import loop_with
    for mistake in ("off_by_one", "in_place"):      # (in place: the truth kept is the engine's, not the loop's list)
        with pytest.raises(guards.PieceFault, match="your loop .* handed back tokens other than its batch's"):
            ch03.run_loop(LLM("tiny", seed=0).new_engine(), loop_with(**{mistake: True}), trace)


@pytest.mark.parametrize("wrong", ["BlockLRU", "BlockRefs", "leaky BlockRefs"])
def test_an_eviction_order_or_counts_that_free_a_held_block_stop_the_engine_naming_them(package, wrong):
    """An LRU that keeps a block a request took again (``used`` does nothing), counts that free a
    block another request still holds: the cache would hand that block to a new request and
    overwrite its K/V under the one reading it; each is stopped where the cache uses its answer.
    Counts that keep a block no request holds leak it: stopped there too."""
    pieces = mine.load(package)
    sticky = type("Sticky", (pieces["BlockLRU"],), {"used": lambda self, b: None})
    eager = type("Eager", (pieces["BlockRefs"],), {"release": lambda self, blocks, cached: (lambda out: list(out) + [
        b for b in blocks if b not in out][:1])(super(type(self), self).release(blocks, cached))})
    leaky = type("Leaky", (pieces["BlockRefs"],), {"release": lambda self, blocks, cached: list(
        super(type(self), self).release(blocks, cached))[1:]})
    piece = wrong.split()[-1]
    cfg = {"BlockLRU": EngineConfig(max_bs=1, n_slots=16 * 4, block_size=4, prefix_caching=True),
           "BlockRefs": EngineConfig(max_bs=3, n_slots=32 * 4, block_size=4, prefix_caching=True)}[piece]
    engine = LLM("tiny", seed=0, engine=cfg).new_engine("paged")
    plug.assemble(engine, {piece: {"BlockLRU": sticky, "BlockRefs": eager, "leaky BlockRefs": leaky}[wrong]})
    prompt = tuple(range(40))
    trace = [TraceItem(0.0, (*prompt, 1), 2), TraceItem(float(piece == "BlockRefs"), (*prompt, 2), 6),
             TraceItem(float(piece == "BlockRefs"), (*prompt, 3), 2)]
    symptom = {"BlockLRU": "evicted block \\d+, which a request holds",
               "BlockRefs": "released \\[\\d+\\] for a request holding",
               "leaky BlockRefs": "kept \\[\\d+\\] counted for a request holding .*the pool leaks them"}[wrong]
    with pytest.raises(guards.PieceFault, match=f"your {piece} .*{symptom}"):
        engine.run(trace)


def test_the_learners_lookup_finds_nothing_for_a_request_scoring_its_prompt(package):
    """As the package's: a request asking for its prompt's logprobs computes every position."""
    from orca_lab.engine.prefix_cache import PrefixCachingBlockManager
    from orca_lab.engine.request import Request
    from orca_lab.engine.sampling_params import SamplingParams
    pieces = mine.load(package)
    kv = PrefixCachingBlockManager(64 * 4, 4)
    ch12._serve_and_free(kv, 0, list(range(20)))
    lookup = ch12.PluggedLookup(kv, pieces["block_hashes"], pieces["cached_prefix"])
    for scored, found in ((None, 5), (1, 0)):
        req = Request(1, list(range(20)) + [5], SamplingParams(max_gen_tokens=1, prompt_logprobs=scored))
        assert len(lookup.lookup(req)) == len(kv.lookup(req)) == found

def test_the_paged_engine_runs_the_learners_blocks_victims_and_lookup(package):
    pieces = mine.load(package)
    assert "from .block_hashes import block_hashes" in (package / "cached_prefix.py").read_text()
    cfg = EngineConfig(max_bs=4, n_slots=20 * 4, block_size=4, prefix_caching=True)   # tight: preempts, evicts
    model = LLM("tiny", seed=0, engine=cfg).model
    trace = few_shot_trace(8, prefix_len=32, question_len=(2, 9), gen_len=(4, 12), vocab_size=257, seed=0)
    runs, evictions = [], []
    for learner in (False, True):
        engine = LLM(gpt=model, engine=cfg).new_engine("paged")       # each with a cache of its own
        if learner:
            assert plug.assemble(engine, pieces) == ["BlockAllocator", "victim", "BlockLRU", "BlockRefs",
                                                     "block_hashes", "cached_prefix"]
        runs.append(engine.run(trace).requests_df())
        evictions.append(engine.scheduler.kv.n_evictions)
        engine.close()
    a, b = runs
    assert a.n_preemptions.sum() > 0 and a.prefix_hit_tokens.sum() > 0      # both mechanisms at work
    for column in ("output", "n_preemptions", "prefix_hit_tokens"):
        assert list(a[column]) == list(b[column]), column
    assert evictions[0] > 0 and evictions[0] == evictions[1]


def test_a_loop_that_stops_early_is_caught(package):
    llm = LLM("tiny", seed=0, engine=EngineConfig(max_bs=2, n_slots=1024))
    engine = llm.new_engine("orca")
    with pytest.raises(AssertionError, match="your loop returned with work left"):
        ch03.run_loop(engine, lambda scheduler, executor, n_workers: None, paper_trace(2, None, 0, scale=0.04,
                                                                                      vocab_size=257))


def test_the_server_runs_the_learners_pieces_and_loop(package, tmp_path):
    """Their loop drives the server's engine: one request of 6 tokens, 6 batches it selected."""
    openai = pytest.importorskip("openai")
    from orca_lab.serving.launch import ServerProcess
    marks = tmp_path / "batches"
    (package / "zz_counting_loop.py").write_text(       # loaded last: this loop is the package's
        "from .loop import loop as theirs\n\n\ndef loop(scheduler, executor, n_workers):\n"
        "    class Counting:\n        def __getattr__(self, name):\n            return getattr(scheduler, name)\n\n"
        "        def select(self, now):\n            batch = scheduler.select(now)\n"
        f"            if batch is not None:\n                open({str(marks)!r}, 'a').write('batch\\n')\n"
        "            return batch\n    theirs(Counting(), executor, n_workers)\n\n\n__all__ = ['loop']\n")
    llm = LLM("tiny", seed=0)
    expected = llm.complete(["a prompt"], 6, ignore_eos=True)[0].text
    with ServerProcess("--plugins", package, "--tensor-ranks", 2, "--max-bs", 2, "--n-slots", 2048) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model="tiny", prompt="a prompt", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
        plugged = [line for line in server.lines if "the engine runs your" in line]
        unproven = [line for line in server.lines if "checks did not pass when saved" in line]
    assert marks.exists() and marks.read_text().splitlines() == ["batch"] * 6
    assert plugged and "select, flatten, SlotManager, split_linear, all_reduce, loop" in plugged[0]
    assert unproven and "select (not graded); flatten (not graded)" in unproven[0]     # saved without a check
    assert got == expected


def test_tensor_ranks_are_refused_without_the_pieces_that_cut_the_model(tmp_path):
    from orca_lab.serving.engine_core import plug_learner
    with pytest.raises(ValueError, match="tensor_ranks=2 .* give plugins too"):
        EngineArgs("tiny", tensor_ranks=2)
    with pytest.raises(ValueError, match="tensor_ranks=0 is out of range"):
        EngineArgs("tiny", plugins=str(tmp_path), tensor_ranks=0)
    folder = write_package(tmp_path / "only_select", {"03_iteration_level_scheduling": ["select"]})
    with pytest.raises(ValueError, match="tensor_ranks=2: .* has no split_linear"):
        plug_learner(LLM("tiny", seed=0).new_engine(), str(folder), 2)


# -- the capstone's check of the package: each piece re-graded, beside its chapter's saved verdict ------
def test_the_capstone_names_each_piece_not_done_and_its_chapter(package, monkeypatch):
    """A stub, a select that skips, a slot manager that never gives slots back, a victim that never
    returns (bounded), and a right piece whose chapter's check never ran: each not done, named."""
    monkeypatch.setattr(bounded, "TIMEOUT_S", 1.0)
    pieces, saved = mine.load(package), dict.fromkeys(plug.PIECES, mine.PASSED)

    def stub(requests):                  # the exercise cell as the notebook hands it out
        raise NotImplementedError("flatten: the flat metadata of one iteration")

    class Leaky(pieces["SlotManager"]):
        def release(self, req):
            pass

    def never(running, req, chosen):
        while True:
            pass

    saved["block_hashes"] = mine.NOT_GRADED
    pieces.update(flatten=stub, select=skipping_select, SlotManager=Leaky, victim=never)
    names = ("flatten", "select", "SlotManager", "victim", "block_hashes", "cached_prefix")
    report = {p.name: p for p in regrade.regrade(pieces, saved, names)}
    assert [n for n in names if not report[n].done] == list(names[:5])
    assert "NotImplementedError" in report["flatten"].now and "TooSlow" in report["victim"].now
    assert "NOT DONE (its chapter's grader: not graded)" in report["block_hashes"].line()
    with pytest.raises(regrade.NotDone, match=r"select \(chapter 03\); SlotManager \(chapter 05\)"):
        regrade.check(regrade.regrade(pieces, saved, names[1:3]))


def test_the_capstone_grades_apart_a_piece_that_ends_its_process_naming_how(package):
    """``os._exit`` and a crash in C end the child grading them, not the capstone: each piece fails
    named with how its process ended, and the pieces after it are graded in a fresh child."""
    (package / "select.py").write_text("import os\n__all__ = ['select']\n__verdict__ = 'passed'\n\n\n"
                                       "def select(pool, n_rsrv, max_bs, n_slots):\n    os._exit(7)\n")
    (package / "block_hashes.py").write_text(
        "import ctypes\n__all__ = ['block_hashes']\n__verdict__ = 'passed'\n\n\n"
        "def block_hashes(*args):\n    return ctypes.string_at(0)\n")
    names = ("form_batch", "select", "block_hashes", "flatten")
    report = {p.name: p for p in regrade.apart(package, dict.fromkeys(plug.PIECES, mine.PASSED), names)}
    assert [n for n in names if not report[n].done] == ["select", "block_hashes"]
    assert "exited with code 7" in report["select"].now and "while grading it" in report["select"].now
    assert "killed by SIGSEGV" in report["block_hashes"].now
    (package / "flatten.py").write_text("import os\nos._exit(3)\n__all__ = ['flatten']\n")
    report = regrade.apart(package, names=("form_batch", "flatten"))
    assert all("code 3" in p.now and "importing the package" in p.now for p in report)


def test_a_package_neither_grades_itself_nor_outlasts_its_graders_bounds(package, monkeypatch):
    """A package whose import replaces the grading child's ``_verdict`` with one that always passes
    is graded all the same; a grader stuck in a C call that holds the interpreter (no thread's stop
    lands there) is killed past its bound, named so, and the pieces after it graded in a fresh child;
    a piece that takes 6 GB fails with MemoryError, named."""
    (package / "select.py").write_text(
        "import sys\n__all__ = ['select']\n__verdict__ = 'passed'\n"
        "for _m in (sys.modules.get('__main__'), sys.modules.get('orca_lab.course.regrade')):\n"
        "    if _m is not None and hasattr(_m, '_verdict'):\n"
        "        _m._verdict = lambda *a, **k: 'passed'\n\n\n"
        "def select(pool, n_rsrv, max_bs, n_slots):\n    raise NotImplementedError('select: never written')\n")
    report = {p.name: p for p in regrade.apart(package, dict.fromkeys(plug.PIECES, mine.PASSED), ("select",))}
    assert not report["select"].done and "NotImplementedError: select: never written" in report["select"].now
    (package / "select.py").write_text("__all__ = ['select']\n__verdict__ = 'passed'\n\n\n"
                                       "def select(pool, n_rsrv, max_bs, n_slots):\n    return sum(range(10**13)), 0\n")
    monkeypatch.setattr(regrade, "SLACK_S", 1.0)
    t = time.monotonic()
    report = {p.name: p for p in regrade.apart(package, dict.fromkeys(plug.PIECES, mine.PASSED),
                                                ("select", "form_batch"), timeout_s=2.0)}
    assert time.monotonic() - t < 60 and [p.done for p in report.values()] == [False, True]
    assert "ran past its bound of 2 s and its process was killed" in report["select"].now
    (package / "select.py").write_text("__all__ = ['select']\n__verdict__ = 'passed'\n_held = []\n\n\n"
                                       "def select(pool, n_rsrv, max_bs, n_slots):\n"
                                       "    _held.append(bytearray(6 * 10**9))\n    return [], 0\n")
    report = regrade.apart(package, dict.fromkeys(plug.PIECES, mine.PASSED), ("select",))
    assert "MemoryError: it ran out of memory (a grading child may allocate 4 GiB" in report[0].now


def test_an_exercise_records_its_graders_verdict(tmp_path, monkeypatch):
    """Saved "not graded" (an unsolved stub runs: it only defines), "failed" after a check that
    raised, "passed" after one that ran through."""
    from IPython.core.interactiveshell import InteractiveShell
    monkeypatch.setenv(mine.ENV, str(tmp_path / "my_orca"))
    monkeypatch.setattr(mine, "_saved", {})
    ip = InteractiveShell.instance()
    try:
        ip.run_cell("%load_ext orca_lab.course.mine")
        stub = 'def select(pool, n_rsrv, max_bs, n_slots):\n    raise NotImplementedError("select")\n'
        ip.run_cell("%%exercise select\n" + stub)
        assert mine.verdicts() == {"select": mine.NOT_GRADED}
        assert not ip.run_cell("from orca_lab.course import ch03_iteration_level_scheduling as ch03\nch03.check_select(select)").success
        assert mine.verdicts()["select"].startswith("failed: NotImplementedError")
        ip.user_ns["RequestState"] = RequestState
        answer = solve.solutions(solve.SOLUTIONS / "03_iteration_level_scheduling.py")["select"]
        ip.run_cell("%%exercise select\n" + answer)
        assert mine.verdicts() == {"select": mine.NOT_GRADED}
        assert ip.run_cell("ch03.check_select(select)").success and mine.verdicts() == {"select": mine.PASSED}
    finally:
        InteractiveShell.clear_instance()


def test_my_orca_has_one_home_whatever_the_working_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(mine.ENV, raising=False)
    homes = set()
    for folder in (tmp_path, solve.NOTEBOOKS, solve.NOTEBOOKS.parent):
        monkeypatch.chdir(folder)
        homes.add(mine.home())
    assert homes == {solve.NOTEBOOKS / "my_orca"}
    monkeypatch.setenv(mine.ENV, str(tmp_path / "elsewhere"))      # `--plugins` alone: that home
    with pytest.raises(SystemExit):
        main(["serve", "--plugins"])
    assert f"plugins='{tmp_path / 'elsewhere'}'" in capsys.readouterr().err


def test_the_learners_loop_serves_requests_as_they_arrive(package, tiny_llm):
    """Poisson arrivals: each request is scheduled no earlier than it arrives, and every one is served."""
    pieces = mine.load(package)
    trace = paper_trace(6, 200.0, 0, scale=0.04, vocab_size=tiny_llm.cfg.vocab_size)
    engine = tiny_llm.new_engine("orca")
    plug.assemble(engine, pieces)
    result = arrivals.run_arriving(engine, pieces["loop"], trace)
    engine.close()
    assert [r.n_generated for r in result.requests] == [it.max_gen_tokens for it in trace]
    assert all(r.t_scheduled >= r.arrival for r in engine.requests)
    assert max(r.arrival for r in result.requests) > 0


# -- the batch formation grader: wrong versions, each caught with its hint ----------------------------
def take(waiting, kv, n, max_seq_len, reserve=None):
    batch = []
    while waiting and len(batch) < n and kv.can_reserve(max_seq_len):
        req = waiting.popleft()
        kv.reserve(req, max_seq_len if reserve is None else reserve(req))
        batch.append(req)
    return batch


def shortest(batch):
    return min((len(r.prompt) for r in batch), default=0)


def right(waiting, kv, max_bs, max_seq_len):
    batch = take(waiting, kv, max_bs, max_seq_len)
    return batch, shortest(batch)


def one_too_many(waiting, kv, max_bs, max_seq_len):
    batch = take(waiting, kv, max_bs + 1, max_seq_len)
    return batch, shortest(batch)


def longest_prompt(waiting, kv, max_bs, max_seq_len):
    batch = take(waiting, kv, max_bs, max_seq_len)
    return batch, max((len(r.prompt) for r in batch), default=0)


def reserves_max_tokens(waiting, kv, max_bs, max_seq_len):
    batch = take(waiting, kv, max_bs, max_seq_len, reserve=lambda r: r.max_tokens)
    return batch, shortest(batch)


def newest_first(waiting, kv, max_bs, max_seq_len):
    batch = take(deque(reversed(waiting)), kv, max_bs, max_seq_len)
    for r in batch:
        waiting.remove(r)
    return batch, shortest(batch)


def never_returns(waiting, kv, max_bs, max_seq_len):
    while True:
        time.sleep(0.01)


WRONG = [(one_too_many, "more than max_bs"), (longest_prompt, "shortest prompt"),
         (reserves_max_tokens, "reserve max_seq_len"), (newest_first, "in arrival order"),
         (lambda w, kv, b, m: ([], 0), "no batch at iteration 0")]


def test_the_batch_formation_grader_passes_the_solution():
    ch02.check_form_batch(right)


@pytest.mark.parametrize("fn, hint", WRONG, ids=[h for _, h in WRONG])
def test_the_batch_formation_grader_names_each_wrong_version(fn, hint):
    t0 = time.perf_counter()
    with pytest.raises(AssertionError, match=hint):
        ch02.check_form_batch(fn)
    assert time.perf_counter() - t0 < 30


def test_a_formation_that_never_returns_stops_the_check_in_bounded_time(monkeypatch):
    monkeypatch.setattr(harness, "CASE_S", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(harness.Stuck, match="did not return within 0.5 s on case 0"):
        ch02.check_form_batch(never_returns)
    assert time.perf_counter() - t0 < 5


def test_a_formation_that_raises_goes_through_as_the_learners_own_naming_the_case():
    def raises(waiting, kv, max_bs, max_seq_len):
        raise KeyError("oops")
    with pytest.raises(KeyError) as e:
        ch02.check_form_batch(raises)
    assert any(n.startswith("(raised by your code on case 0 ") for n in e.value.__notes__), e.value.__notes__


# -- the block allocator and eviction-order graders --------------------------------------------------
Allocator = solution("11", "BlockAllocator")       # the course's own, which the wrong ones below vary


class LowestBlocks(Allocator):
    def take(self, n):
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return taken


class NeverFrees(Allocator):
    def free(self, blocks):
        pass


class TakesWithoutRemoving(Allocator):
    def take(self, n):
        return self.free_blocks[:n]


class Descending(Allocator):
    def take(self, n):
        return super().take(n)[::-1]


class MissesTheLastRun(Allocator):
    def take(self, n):
        f = self.free_blocks
        i = next((i for i in range(len(f) - n) if f[i + n - 1] - f[i] == n - 1), 0)    # not len(f) - n + 1
        taken, f[i:i + n] = f[i:i + n], []
        return taken


class FreesTwice(Allocator):
    def free(self, blocks):
        self.free_blocks = sorted(self.free_blocks + list(blocks) + list(blocks))


class LRU:
    def __init__(self):
        self.blocks = []

    def freed(self, block):
        self.blocks.append(block)

    def used(self, block):
        self.blocks.remove(block)

    def evict(self):
        return self.blocks.pop(0)

    def __len__(self):
        return len(self.blocks)


class Stack(LRU):
    def evict(self):
        return self.blocks.pop()


class UsedStays(LRU):
    def used(self, block):
        pass


class LenOffByOne(LRU):
    def __len__(self):
        return len(self.blocks) + 1


class UsedRaises(LRU):
    def used(self, block):
        raise KeyError(block)


GRADED = [(ch11.check_block_allocator, Allocator, None),
          (ch11.check_block_allocator, LowestBlocks, "one run of n consecutive free blocks"),
          (ch11.check_block_allocator, NeverFrees, "free\(blocks\) must give them back"),
          (ch11.check_block_allocator, TakesWithoutRemoving, "a block handed out twice"),
          (ch11.check_block_allocator, Descending, "in increasing order"),
          (ch11.check_block_allocator, MissesTheLastRun, "the last possible run .* never tried"),
          (ch11.check_block_allocator, FreesTwice, "a double free: free\\(blocks\\)"),
          (ch12.check_block_lru, LRU, None),
          (ch12.check_block_lru, Stack, "evict the least recently freed block"),
          (ch12.check_block_lru, UsedStays, "leaves the list"),
          (ch12.check_block_lru, LenOffByOne, "len\(\) counts the free cached blocks"),
          (ch12.check_block_lru, UsedRaises, "your used\(\) raised .*KeyError")]


@pytest.mark.parametrize("check, cls, hint", GRADED, ids=[c.__name__ for _, c, _ in GRADED])
def test_the_block_graders_pass_the_right_one_and_name_each_wrong_one(check, cls, hint):
    if hint is None:
        check(cls)
        return
    with pytest.raises(AssertionError, match=hint):
        check(cls)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_allocator_grader_names_the_last_run_at_other_seeds(seed):
    with pytest.raises(AssertionError, match="the last possible run .* never tried"):
        ch11.check_block_allocator(MissesTheLastRun, seed=seed)


def test_the_batch_formation_grader_refuses_the_packages_own():
    def wraps(waiting, kv, max_bs, max_seq_len):
        sched = RequestLevelScheduler(kv, max_bs, max_seq_len)
        sched.waiting = waiting
        return sched.form_batch()
    with pytest.raises(AssertionError, match="the package's own .*RequestLevelScheduler.form_batch"):
        ch02.check_form_batch(wraps)


def test_the_allocator_grader_refuses_its_own_reference():
    with pytest.raises(AssertionError, match="own"):
        ch11.check_block_allocator(ch11._Reference)
