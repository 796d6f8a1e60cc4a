"""A learner's piece that is wrong where it runs (``course/guards.py``): each package below carries
one bug a grader may miss; assembled into the engine, the engine stops within its bound naming the
piece, and served with ``--plugins`` no request gets 200 OK with wrong text."""
import textwrap
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.course import mine, plug
from orca_lab.course.guards import PieceFault
from orca_lab.course.bounded import describe, run_bounded
from orca_lab.serving.launch import ServerProcess


SLOT_LEAK = '''
class SlotManager:
    def __init__(self, n_slots):
        self.n_slots, self.n_reserved = n_slots, 0
        self.free = list(range(n_slots))

    def can_reserve(self, n):
        return self.n_reserved + n <= self.n_slots

    def reserve(self, req, n):
        req.slots, self.free = self.free[:n], self.free[n:]
        self.n_reserved += n

    def release(self, req):              # the bug: the slots never go back on the free list
        self.n_reserved -= len(req.slots)
        req.slots = None
'''

SKIPPING_SELECT = '''
from orca_lab.engine.request import RequestState


def select(pool, n_rsrv, max_bs, n_slots):
    batch = []
    for req in sorted((r for r in pool if r.state is not RequestState.RUNNING), key=lambda r: r.arrival):
        if len(batch) == max_bs:
            break
        if req.state is RequestState.INITIATION:
            if n_rsrv + req.max_tokens > n_slots:
                continue                     # the bug: skips, and a later request overtakes
            n_rsrv += req.max_tokens
        batch.append(req)
    return batch, n_rsrv
'''

ENDLESS_SELECT = '''
def select(pool, n_rsrv, max_bs, n_slots):
    while True:
        n_rsrv += 0
'''

def sleeping(signature: str) -> str:
    """A piece whose body is one C call no stop lands in before it returns."""
    return f"import time\ndef {signature}:\n    time.sleep(120)\n"


SLEEPING = [("select", "orca", "select(pool, n_rsrv, max_bs, n_slots)", EngineConfig(max_bs=2, n_slots=256)),
            ("form_batch", "ft", "form_batch(waiting, kv, max_bs, max_seq_len)", EngineConfig(max_bs=2, n_slots=4096)),
            ("victim", "paged", "victim(running, req, chosen)", EngineConfig(max_bs=4, n_slots=20 * 4, block_size=4)),
            ("fill_budget", "chunked", "fill_budget(decodes, prompts, budget, max_bs, run)",
             EngineConfig(max_bs=4, n_slots=512, block_size=4, max_num_batched_tokens=16))]

RAISING_SELECT = '''
def select(pool, n_rsrv, max_bs, n_slots):
    raise IndexError("my bug")
'''

ENDLESS_ANSWER = '''
class Batch(list):
    def __iter__(self):                  # the answer's own code, run when the engine reads it
        while True:
            pass


def select(pool, n_rsrv, max_bs, n_slots):
    return Batch(), n_rsrv
'''

ENDLESS_COUNT = '''
class SlotManager:
    def __init__(self, n_slots):
        self.n_slots, self.held, self.free = n_slots, 0, list(range(n_slots))

    @property
    def n_reserved(self):                # right until a slot is held, then never returns
        while self.held:
            pass
        return 0

    def can_reserve(self, n):
        return self.held + n <= self.n_slots

    def reserve(self, req, n):
        req.slots, self.free = self.free[:n], self.free[n:]
        self.held += n

    def release(self, req):
        self.free, self.held, req.slots = sorted(self.free + req.slots), self.held - len(req.slots), None
'''

DOUBLE_FREE = '''
class BlockAllocator:
    def __init__(self, n_blocks):
        self.free_blocks = list(range(n_blocks))

    def take(self, n):
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return taken

    def free(self, blocks):              # the bug: the first block goes back twice
        self.free_blocks = sorted(self.free_blocks + list(blocks) + list(blocks[:1]))
'''

LONGEST_FIRST = '''
def form_batch(waiting, kv, max_bs, max_seq_len):
    batch = []                           # the bug: once a prompt is long, the last request first
    while waiting and len(batch) < max_bs and kv.can_reserve(max_seq_len):
        req = waiting.pop() if max(len(r.prompt) for r in waiting) > 9 else waiting.popleft()
        kv.reserve(req, max_seq_len)
        batch.append(req)
    return batch, min(len(r.prompt) for r in batch)
'''

EARLIEST_VICTIM = '''
def victim(running, req, chosen):
    for r in running:                    # the bug: the earliest holder, whoever it is
        if r is not req and r.slots is not None:
            return r
    return None
'''


def package(folder, name, source):
    folder.mkdir()
    (folder / f"{name.lower()}.py").write_text(f"__all__ = [{name!r}]\n" + textwrap.dedent(source))
    return folder


def run_assembled(folder, system, cfg, prompts, gen, bound_s=None):
    """The engine of ``system`` with the package's pieces plugged, serving ``prompts`` greedily."""
    engine = LLM("tiny", seed=0, engine=cfg).new_engine(system)
    assert plug.assemble(engine, mine.load(folder), bound_s=bound_s)
    try:
        for p, n in zip(prompts, gen):
            engine.add_request(p, SamplingParams(max_gen_tokens=n, ignore_eos=True))
        return engine.run()
    finally:
        engine.close()


# the solved pieces run under their guards: tests/test_capstone.py (orca, ft, paged with prefix caching)
CASES = [("slot leak", "SlotManager", SLOT_LEAK, "orca", EngineConfig(max_bs=2, n_slots=256),
          r"your SlotManager\.release \(.*slotmanager\.py:\d+\) does not give every slot back"),
         ("skipping select", "select", SKIPPING_SELECT, "orca", EngineConfig(max_bs=4, n_slots=64),
          r"your select \(.*select\.py:\d+\) chose request 2, which arrived after request 1 .*break, never skip"),
         ("double free", "BlockAllocator", DOUBLE_FREE, "paged", EngineConfig(max_bs=8, n_slots=512, block_size=4),
          r"your BlockAllocator\.take \(.*blockallocator\.py:\d+\) handed out block \d+ while .* still holds it"),
         ("formation out of order", "form_batch", LONGEST_FIRST, "ft", EngineConfig(max_bs=2, n_slots=4096),
          r"your form_batch \(.*form_batch\.py:\d+\) took requests \[\d+, \d+\] of waiting .*the first ones"),
         ("wrong victim", "victim", EARLIEST_VICTIM, "paged", EngineConfig(max_bs=4, n_slots=20 * 4, block_size=4),
          r"your victim \(.*victim\.py:\d+\) chose request \d+ to give way to request \d+, which arrived before")]


@pytest.mark.parametrize("name, piece, source, system, cfg, fault", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_piece_stops_the_engine_naming_it(tmp_path, name, piece, source, system, cfg, fault):
    prompts = [[i + 1] * (4 + 3 * i) for i in range(6)]
    gen = [30, 30, 5, 10, 10, 10]                   # 34 and 37 slots: the second does not fit beside the first
    with pytest.raises(PieceFault, match=fault) as e:
        run_assembled(package(tmp_path / "p", piece, source), system, cfg, prompts, gen)
    assert e.value.piece == piece


def test_a_piece_that_never_returns_is_stopped_within_its_bound_naming_the_line(tmp_path):
    folder = package(tmp_path / "p", "select", ENDLESS_SELECT)
    with pytest.raises(PieceFault, match=r"your select \(.*select\.py:3\) did not return within 0\.3 s "
                                         r"\(stopped at .*select\.py:[45]\)"):
        run_assembled(folder, "orca", EngineConfig(max_bs=2, n_slots=256), [[1, 2]], [3], bound_s=0.3)
    for piece, source in (("select", ENDLESS_ANSWER), ("SlotManager", ENDLESS_COUNT)):   # read, not called
        with pytest.raises(PieceFault, match=r"did not return within 0\.3 s") as e:
            # (the folder "select" is named as the standard library's module)
            run_assembled(package(tmp_path / piece, piece, source), "orca", EngineConfig(max_bs=2, n_slots=256),
                          [[1, 2]], [3], bound_s=0.3)
        assert e.value.piece == piece
    import select
    assert callable(select.select)          # the learner's folder "select" replaced no module of the process
    # a grader run after that (profiled, in a thread) is not disturbed: cancelling the landed stop
    # once left CPython spinning there, and the grader reported a stub raising at once as too slow
    def stub():
        raise NotImplementedError("a stub")
    with pytest.raises(NotImplementedError):
        run_bounded(stub, timeout_s=5.0, references=(describe,))


@pytest.mark.parametrize("piece, system, signature, cfg", SLEEPING, ids=[c[1] for c in SLEEPING])
def test_a_piece_blocked_in_one_c_call_is_named_at_its_line_though_it_cannot_be_stopped(tmp_path, piece, system,
                                                                                        signature, cfg):
    """``time.sleep`` holds the thread in C, where the watcher's stop waits for the call's end: the
    engine's run (a thread of its own, ``guards.watched``) is given up after the grace, named, in
    each system's engine; the process goes on (the next engine serves, with the learner's loop)."""
    from orca_lab.course import ch03_iteration_level_scheduling as ch03
    from orca_lab.workload import TraceItem
    prompts = [[i + 1] * (4 + 3 * i) for i in range(6)]
    gen = [30, 30, 5, 10, 10, 10]                   # the paged pool runs out: a victim is asked for
    t = time.monotonic()
    with pytest.raises(PieceFault, match=rf"your {piece} \(.*\.py:3\) did not return within 0\.3 s and cannot be "
                                         rf"stopped: it is blocked in one call \(blocked at .*\.py:4\)") as e:
        run_assembled(package(tmp_path / "p", piece, sleeping(signature)), system, cfg, prompts, gen, bound_s=0.3)
    assert e.value.piece == piece and time.monotonic() - t < 30
    if system != "orca":
        return

    def sleeping_loop(scheduler, executor, n_workers):
        time.sleep(120)
    engine = LLM("tiny", seed=0, engine=EngineConfig(max_bs=2, n_slots=256)).new_engine()
    t = time.monotonic()
    with pytest.raises(PieceFault, match=r"your loop \(.*\) made no progress .* within 0\.3 s and cannot be stopped: "
                                         r"it is blocked in one call \(blocked at .*test_piece_guards\.py:\d+\)"):
        ch03.run_loop(engine, sleeping_loop, [TraceItem(0.0, (1, 2, 3), 3)], bound_s=0.3)
    assert time.monotonic() - t < 30
    from tests.test_graders import loop_with
    engine = LLM("tiny", seed=0, engine=EngineConfig(max_bs=2, n_slots=256)).new_engine()
    done = ch03.run_loop(engine, loop_with(), [TraceItem(0.0, (1, 2, 3), 3)], bound_s=0.3)
    assert [len(r.output) for r in done.requests] == [3]


def drops_full_batches(scheduler, executor, n_workers):
    """Algorithm 1's loop that drops a full batch: it selects on and on, submitting nothing."""
    while scheduler.has_work():
        batch = scheduler.select(executor.clock.now())
        if batch is None or len(batch) >= 2:
            continue
        executor.submit(batch)
        done = executor.wait()
        scheduler.on_batch_return(done.batch, done.tokens, executor.clock.now())


def test_a_loop_that_makes_no_progress_is_stopped_though_it_keeps_calling_the_scheduler():
    """The loop's bound runs between batches submitted or come back: each select used to restart
    it, so a loop spinning on selects ran (and a server hung) for ever."""
    from orca_lab.course import ch03_iteration_level_scheduling as ch03
    from orca_lab.workload import TraceItem
    engine = LLM("tiny", seed=0, engine=EngineConfig(max_bs=2, n_slots=256)).new_engine()
    trace = [TraceItem(0.0, (1, 2, 3), 3), TraceItem(0.0, (4, 5), 3)]
    t = time.monotonic()
    with pytest.raises(PieceFault, match=r"your loop \(.*\) made no progress \(no batch submitted, come back or "
                                         r"handed back\) within 0\.3 s") as e:
        ch03.run_loop(engine, drops_full_batches, trace, bound_s=0.3)
    assert e.value.piece == "loop" and time.monotonic() - t < 10
    engine = LLM("tiny", seed=0, engine=EngineConfig(max_bs=2, n_slots=256)).new_engine()
    from tests.test_graders import loop_with
    done = ch03.run_loop(engine, loop_with(), trace, bound_s=0.3)     # each batch is progress
    assert [len(r.output) for r in done.requests] == [3, 3]


@contextmanager
def serving(folder, *args):
    s = ServerProcess("--plugins", folder, "--drain-s", "0", *args).start()
    try:
        yield s
    finally:
        s.kill()


def ask_at_once(url, prompts, max_tokens):
    """The answers (status, body) to ``prompts``, sent at once."""
    def ask(p):
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def test_served_a_double_freeing_allocator_gives_errors_naming_it_never_wrong_text(tmp_path):
    prompts = [f"request {i}: " + "abcdefgh"[: i % 8] * 3 for i in range(16)]
    expected = [c.text for c in LLM("tiny", seed=0).complete(prompts, 16, ignore_eos=True)]
    with serving(package(tmp_path / "p", "BlockAllocator", DOUBLE_FREE), "--system", "paged", "--n-slots", 512,
                 "--block-size", 4, "--max-bs", 8) as s:
        answers = ask_at_once(s.url, prompts, 16)
        for (status, body), text in zip(answers, expected):
            if status == 200:
                assert body["choices"][0]["text"] == text             # served before the fault: right
            else:
                assert status == 503 and "your BlockAllocator.take (" in body["error"]["message"], body
        assert any(status == 503 for status, _ in answers)
        assert s.proc.wait(30) == 1 and "your BlockAllocator.take (" in s.output


def test_served_a_select_that_raises_ends_the_requests_naming_its_line(tmp_path):
    folder = package(tmp_path / "p", "select", RAISING_SELECT)
    with serving(folder) as s:
        for status, body in ask_at_once(s.url, ["a", "b"], 2):
            assert status == 503 and f"your code at {folder / 'select.py'}:4 raised IndexError: my bug" in \
                body["error"]["message"], body
        assert s.proc.wait(30) == 1


def test_served_a_select_that_never_returns_ends_the_requests_with_its_name(tmp_path):
    folder = package(tmp_path / "p", "select", ENDLESS_SELECT)
    with serving(folder, "--stall-s", 1) as s:
        for status, body in ask_at_once(s.url, ["a", "b"], 2):      # answered, not left to time out
            assert status == 503 and f"your select ({folder / 'select.py'}:3) did not return within 1 s" in \
                body["error"]["message"], body
        assert s.proc.wait(30) == 1 and "stopped at" in s.output
