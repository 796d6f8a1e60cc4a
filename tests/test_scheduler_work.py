"""Per iteration, the engine does work in proportion to its batch, not to its queue: with 20,000
requests waiting, one step (select, the batch's return, the gauges a server reads) touches a few
batches' worth of requests. Counted, not timed (``benchmarks/select_scaling.py`` times it)."""
import pytest

from orca_lab import SamplingParams
from orca_lab.config import model_config
from orca_lab.engine import engine as engine_mod
from orca_lab.engine.engine import Engine
from orca_lab.engine.policies import new_kv, new_scheduler
from orca_lab.engine.request import Request
from orca_lab.sim.cost import AnalyticalCost
from orca_lab.sim.executor import SimExecutor

N_WAITING, MAX_BS = 20_000, 8
TOUCHED: set[int] = set()


class Counted(Request):
    """A request that notes every read of its attributes (by any code) in ``TOUCHED``."""
    def __getattribute__(self, name):
        TOUCHED.add(id(self))
        return object.__getattribute__(self, name)


# (system, n_slots): room for the batch (ft reserves max_seq_len = 1024 each); "tight" pools make
# paged and chunked preempt while the queue waits
CASES = {"orca": ("orca", 8192), "ft": ("ft", 8192), "paged": ("paged", 8192), "chunked": ("chunked", 8192),
         "paged-tight": ("paged", 256), "chunked-tight": ("chunked", 256)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_touches_the_batch_not_the_queue(case, monkeypatch):
    system, n_slots = CASES[case]
    cfg = model_config("tiny")
    kv = new_kv(system, n_slots, 16)
    scheduler = new_scheduler(system, kv, MAX_BS, cfg.max_seq_len, None, 64)
    engine = Engine(scheduler, SimExecutor(AnalyticalCost(cfg)), cfg.vocab_size, cfg.max_seq_len)
    monkeypatch.setattr(engine_mod, "Request", Counted)
    engine.add_requests([([1 + i % 7] * 24, SamplingParams(max_gen_tokens=150), 0.0) for i in range(N_WAITING)])
    for _ in range(40):                   # past the prompts (and, tight, into preemption)
        engine.step()
    assert engine.stats().waiting > N_WAITING - 4 * MAX_BS
    preempted = sum(r.n_preemptions for r in engine.requests[:4 * MAX_BS])
    for _ in range(20):
        TOUCHED.clear()
        engine.step()
        engine.stats()
        assert len(TOUCHED) <= 4 * MAX_BS, f"one step touched {len(TOUCHED)} of {N_WAITING} requests"
    if case.endswith("tight"):
        assert sum(r.n_preemptions for r in engine.requests[:4 * MAX_BS]) > preempted, "the pool should be tight"
    kv_used = sum(min(r.n_cached, len(r.slots)) for r in engine.requests if r.slots is not None)
    assert engine.stats().kv_used == kv.stats().used == kv_used     # the counter agrees with the sum


@pytest.mark.parametrize("system", ["orca", "ft", "paged", "chunked"])
def test_the_kept_counts_agree_with_the_requests_at_every_step(system):
    """``stats()`` reads counters; at every step they equal what the requests say, through
    admissions, preemptions and aborts of requests waiting, between iterations and in flight."""
    cfg = model_config("tiny")
    kv = new_kv(system, 2048 if system == "ft" else 192, 16)
    engine = Engine(new_scheduler(system, kv, 4, cfg.max_seq_len, None, 32),
                    SimExecutor(AnalyticalCost(cfg, pipeline_parallel=2)), cfg.vocab_size, cfg.max_seq_len)
    reqs = [engine.add_request([3] * (5 + 7 * i % 40), SamplingParams(max_gen_tokens=4 + i % 9)) for i in range(24)]
    step = 0
    while engine.has_work():
        if step % 5 == 2:                    # the oldest or the newest: in flight, between, waiting
            engine.abort(list(engine.live)[-(step % 2)])
        engine.step()
        step += 1
        live = list(engine.live.values())
        s = engine.stats()
        assert s.kv_used == kv.stats().used and s.kv_reserved == kv.n_reserved
        assert s.waiting == sum(r.t_scheduled is None for r in live) and s.waiting + s.running == len(live)
    reasons = [r.finish_reason for r in reqs]
    assert "abort" in reasons and set(reasons) <= {"abort", "length"} and kv.n_used == kv.n_reserved == 0
