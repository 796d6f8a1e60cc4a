"""The distributed engine on CPU (gloo): worker processes give the single-process engine's tokens,
keep P batches in flight, fail fast and leave nothing behind when a worker dies."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import random_prompts

from orca_lab import LLM, EngineConfig
from orca_lab.config import check_degrees
from orca_lab.distributed.pool import WorkerPool
from orca_lab.workload import TraceItem, paper_trace

DEGREES = [(2, 1), (1, 2), (2, 2)]          # (tensor_parallel, pipeline_parallel)


def ragged_trace(vocab, n=8, seed=0):
    prompts = random_prompts(n, vocab, 1, 40, seed)
    gens = [random.Random(seed + i).randint(1, 10) for i in range(n)]
    return [TraceItem(0.0, tuple(p), g) for p, g in zip(prompts, gens)]


@pytest.fixture(scope="module", params=DEGREES, ids=lambda d: f"tp{d[0]}xpp{d[1]}")
def parallel_llm(request, tiny_llm):
    """An LLM whose engines share one pool of tp x pp workers for the whole module."""
    tp, pp = request.param
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=3, n_slots=4096, tensor_parallel=tp,
                                                      pipeline_parallel=pp))
    with WorkerPool(llm):
        yield llm


@pytest.mark.parametrize("system", ["orca", "ft"])
def test_greedy_tokens_equal_the_single_process_engine(parallel_llm, tiny_llm, system):
    ec = parallel_llm.engine_config
    trace = ragged_trace(tiny_llm.cfg.vocab_size, seed=10 * ec.tensor_parallel + ec.pipeline_parallel)
    expected = [list(r.output) for r in tiny_llm.serve(trace).requests]
    mbs = -(-ec.max_bs // ec.pipeline_parallel) if system == "ft" else None   # a micro-batch per stage
    result = parallel_llm.serve(trace, system=system, mbs=mbs)
    assert [list(r.output) for r in result.requests] == expected
    assert result.config["tensor_parallel"] == ec.tensor_parallel


def test_p_batches_in_flight_run_concurrently_on_the_stages(parallel_llm, tiny_llm):
    P = parallel_llm.engine_config.pipeline_parallel
    if P == 1:
        pytest.skip("one stage: one batch in flight")
    result = parallel_llm.serve(ragged_trace(tiny_llm.cfg.vocab_size, n=10, seed=7))
    its = result.iterations
    assert max(it.in_flight for it in its) == P
    assert {it.stage for it in its} == set(range(P))
    by_iter = {}
    for it in its:
        by_iter.setdefault(it.iteration, {})[it.stage] = it
    for stages in by_iter.values():          # one clock: stage s + 1 starts on what stage s computed
        assert all(stages[s].start < stages[s + 1].start < stages[s + 1].end for s in range(P - 1))
    first, last = [it for it in its if it.stage == 0], [it for it in its if it.stage == P - 1]
    overlaps = [(a, b) for a in first for b in last if a.iteration > b.iteration and a.start < b.end and b.start < a.end]
    assert overlaps, "stage 0 should run a later batch while the last stage runs an earlier one"


def test_sampled_tokens_follow_each_requests_seed_on_workers(parallel_llm, tiny_llm):
    if parallel_llm.engine_config.tensor_parallel > 1:
        pytest.skip("tensor parallel sums in another order: sampled tokens may differ at a tie")
    prompts = random_prompts(3, tiny_llm.cfg.vocab_size, seed=3)
    kw = dict(temperature=0.9, top_k=20, seed=11)
    assert parallel_llm.generate(prompts, max_gen_tokens=5, **kw) == tiny_llm.generate(prompts, max_gen_tokens=5, **kw)


def test_unseeded_requests_on_workers_draw_from_os_entropy(parallel_llm, tiny_llm):
    """The last stage samples: without a seed, two calls (each a new engine, its rids from 0 again)
    draw different tokens there too."""
    prompt = random_prompts(1, tiny_llm.cfg.vocab_size, 8, 8, seed=9)[0]
    a, b = (parallel_llm.generate([prompt], max_gen_tokens=32, temperature=1.0)[0] for _ in range(2))
    assert a != b


# -- lifecycle ---------------------------------------------------------------------------------------
def descendants(pid=None):
    """Every process below ``pid`` (this one by default), from /proc."""
    out, todo = set(), [pid or os.getpid()]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else ():
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out.update(kids)
            todo.extend(kids)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def assert_nothing_left(before, pids, ports, timeout=10):
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "worker processes outlived their pool"
    # the fork server (and its resource tracker) stay for the next pool; nothing else may
    extra = [p for p in descendants() - before if alive(p) and "multiprocessing" not in cmdline(p)]
    assert not extra, [cmdline(p) for p in extra]
    for port in ports:                                 # nothing listens on the pool's ports any more
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


def test_killing_a_worker_raises_within_seconds_and_leaves_no_process(tiny_llm):
    before = descendants()
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=4096, pipeline_parallel=2))
    pool = WorkerPool(llm)
    pids, ports = pool.pids, pool.ports
    engine = llm.new_engine()
    for item in ragged_trace(llm.cfg.vocab_size, n=6, seed=5):
        engine.add_request(list(item.prompt), item.sampling_params())
    for _ in range(4):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(stage 1.*SIGKILL"):
        engine.run()
    assert time.monotonic() - t0 < 5
    engine.close()
    with pytest.raises(RuntimeError, match="SIGKILL"):             # the broken pool stays refused
        pool.claim(None)
    assert_nothing_left(before, pids, ports)
    # the LLM recovers: its next engine starts a pool of its own
    assert llm.generate([[4, 5]], max_gen_tokens=2) == tiny_llm.generate([[4, 5]], max_gen_tokens=2)


def test_close_stops_workers_and_frees_ports(tiny_llm):
    """The pool's ports listen on loopback only (the rendezvous store too: TCPStore's own server binds
    every interface), and the weights file the workers map is gone once they are ready."""
    import psutil
    before = descendants()
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=4096, tensor_parallel=2))
    with WorkerPool(llm) as pool:
        pids, ports = pool.pids, pool.ports
        bound = {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}
        assert {port: bound.get(port) for port in ports} == {port: "127.0.0.1" for port in ports}
        assert not os.path.exists(pool._weights_dir)
        assert llm.generate([[1, 2, 3]], max_gen_tokens=2) == tiny_llm.generate([[1, 2, 3]], max_gen_tokens=2)
    assert_nothing_left(before, pids, ports)
    with pytest.raises(RuntimeError, match="closed"):
        pool.claim(None)


def test_a_send_interrupted_between_tensor_ranks_ends_the_pool_not_the_next_request(tiny_llm):
    """Rank 0 holding a message rank 1 never got would wait in its all-reduce for ever: an interrupt
    there breaks the pool at once, and the next request runs on a fresh one, with its tokens."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=2, n_slots=4096, tensor_parallel=2))
    pool = WorkerPool(llm)
    pids = pool.pids

    class Interrupted:                    # tensor rank 1's channel, its send cut by Ctrl-C
        def __init__(self, conn):
            self.conn = conn

        def send_raw(self, raw):
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.conn, name)

    pool._control[1] = Interrupted(pool._control[1])
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], max_gen_tokens=2)
    assert "a send to the workers was interrupted" in pool.broken
    assert_nothing_left(set(), pids, [])
    assert llm.generate([[1, 2, 3]], max_gen_tokens=2) == tiny_llm.generate([[1, 2, 3]], max_gen_tokens=2)


def test_torchrun_runs_the_same_engine(tmp_path):
    """The documented multi-node command, on one machine: rank 0 is the master and worker 0."""
    # TMPDIR: torch's elastic agent leaves its run directory behind; keep it in pytest's tmp tree.
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp_path),
               ORCA_LAB_SECRET="the operator's control secret, 32+ characters")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "orca_lab.torchrun", "--tp", "1", "--pp", "2", "--device", "cpu", "--systems", "orca",
           "--n-requests", "4", "--scale", "0.05", "--seed", "3", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((tmp_path / "torchrun.json").read_text())["runs"][0]
    assert {it["stage"] for it in run["iterations"]} == {0, 1}
    llm = LLM("tiny", seed=3, engine=EngineConfig(max_bs=8, n_slots=4096))
    expected = llm.serve(paper_trace(4, seed=3, scale=0.05, vocab_size=llm.cfg.vocab_size))
    assert [r["output"] for r in run["requests"]] == [list(r.output) for r in expected.requests]


# -- invalid degrees ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel=3), r"tensor_parallel=3 is not allowed: it must divide n_heads=4 \(allowed: 1, 2, 4\)"),
    (dict(pipeline_parallel=5), r"pipeline_parallel=5 is out of range: allowed \[1, 4\]"),
    (dict(tensor_parallel=2, executor="local"), r"tensor_parallel=2 needs worker processes"),
])
def test_invalid_degrees_are_refused(tiny_llm, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(gpt=tiny_llm.model, engine=EngineConfig(**kw))


def test_more_workers_than_gpus_is_refused(tiny_llm, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel x pipeline_parallel = 2 x 2 = 4 exceeds the 2 "
                                         r"GPU\(s\) available: allowed tensor_parallel \* pipeline_parallel in \[1, 2\]"):
        LLM(gpt=tiny_llm.model, engine=EngineConfig(tensor_parallel=2, pipeline_parallel=2, device="cuda"))
    check_degrees(tiny_llm.cfg, EngineConfig(tensor_parallel=2, device="cuda"))     # 2 fit
    with pytest.raises(ValueError, match="executor='threads'"):
        EngineConfig(executor="threads")


def test_abort_and_per_request_sampling_on_workers(parallel_llm, tiny_llm):
    """The workers sample with each request's own params and seed (top-p included), an aborted
    request's slots are released to them and reused, and the others' tokens do not change."""
    from orca_lab import SamplingParams
    prompts = random_prompts(5, tiny_llm.cfg.vocab_size, 3, 20, seed=21)
    params = [SamplingParams(max_gen_tokens=6, temperature=1.0, top_p=0.8, seed=1), SamplingParams(max_gen_tokens=5),
              SamplingParams(max_gen_tokens=6, temperature=0.7, top_k=40, seed=2),
              SamplingParams(max_gen_tokens=4, stop_token_ids=[7, 9]), SamplingParams(max_gen_tokens=9)]
    engine = parallel_llm.new_engine()
    try:
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        engine.step()
        assert engine.abort(reqs[1])              # in flight with pp > 1, between iterations otherwise
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert reqs[1].finish_reason == "abort" and engine.scheduler.kv.n_reserved == 0
    for i in (0, 2, 3, 4):
        assert reqs[i].output == tiny_llm.generate([prompts[i]], sampling_params=params[i])[0]
    assert parallel_llm.generate(prompts, sampling_params=params) == tiny_llm.generate(prompts, sampling_params=params)
