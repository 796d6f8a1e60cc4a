"""The policies after ORCA (paged K/V with recompute preemption, chunked prefill): batched greedy =
alone under forced preemption and prompts longer than the budget, seeded sampling = alone however a
prompt is chunked, no leaks, FCFS, the simulator's batches, a pipeline of worker processes, and their
refusals of bad settings."""
import pytest
from helpers import random_prompts

from orca_lab import LLM, EngineConfig, SamplingParams
from orca_lab.distributed.pool import WorkerPool
from orca_lab.engine.blocks import BlockManager
from orca_lab.engine.request import Request
from orca_lab.sim.cost import AnalyticalCost
from orca_lab.sim.sweep import Curve
from orca_lab.sim.backends import SimBackend
from orca_lab.workload import TraceItem

# (system, pool, budget): a pool too small for every context at once forces preemption; a budget
# below the longest prompt splits it over iterations
SETTINGS = {"paged-preempting": ("paged", 64, 512), "chunked-preempting": ("chunked", 64, 16),
            "chunked-roomy": ("chunked", 4096, 24)}


def trace_of(vocab, n=9, seed=0, lo=1, hi=50):
    prompts = random_prompts(n, vocab, lo, hi, seed)
    return [TraceItem(0.0, tuple(p), 2 + (5 * i + seed) % 11) for i, p in enumerate(prompts)]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def expected(tiny_llm):
    """Each request of the module's trace run alone (ORCA, one request in the engine)."""
    trace = trace_of(tiny_llm.cfg.vocab_size)
    return trace, [tiny_llm.generate([list(t.prompt)], max_gen_tokens=t.max_gen_tokens)[0] for t in trace]


@pytest.fixture(scope="module")
def sampled(tiny_llm):
    """Seeded, sampled requests whose prompts (30 to 45 tokens) exceed a 16-token budget, and each
    one's tokens alone (ORCA, one request in the engine, its prompt in one pass)."""
    prompts = random_prompts(3, tiny_llm.cfg.vocab_size, 30, 45, seed=7)
    params = [SamplingParams(max_gen_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in (1, 2, 3)]
    return prompts, params, [tiny_llm.generate([p], sampling_params=[sp])[0] for p, sp in zip(prompts, params)]


def engine_for(tiny_llm, setting, n_workers=1, executor="local", max_bs=4):
    system, n_slots, budget = SETTINGS[setting]
    cfg = EngineConfig(max_bs=max_bs, n_slots=n_slots, block_size=8, max_num_batched_tokens=budget,
                       pipeline_parallel=n_workers, executor=executor)
    return LLM(gpt=tiny_llm.model, engine=cfg).new_engine(system)


def assert_no_leak(engine):
    kv = engine.scheduler.kv
    assert (kv.n_reserved, kv.n_holders, kv._spans) == (0, 0, [[0, kv.n_slots]])
    assert all(r.slots is None for r in engine.requests)


@pytest.mark.parametrize("n_workers", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batched_greedy_equals_each_request_alone(tiny_llm, expected, setting, n_workers):
    trace, alone = expected
    engine = engine_for(tiny_llm, setting, n_workers)
    result = engine.run(trace)
    assert [list(r.output) for r in result.requests] == alone
    df = result.requests_df()
    system, n_slots, budget = SETTINGS[setting]
    if n_slots == 64:
        assert df["n_preemptions"].sum() > 0, "the pool should be too small for every context at once"
    if system == "chunked":
        assert max(it.n_tokens for it in result.iterations) <= budget
        long = [r for r in result.requests if r.prompt_len > budget]
        assert long and all(r.n_iterations > r.n_generated for r in long)   # prompts over several chunks
        mixed = [it for it in result.iterations if {"prefill", "decode"} <= set(it.phases)]
        assert mixed, "decodes should run beside prefill chunks"
    if n_slots > 64:               # room for n_workers batches at once
        assert max(it.in_flight for it in result.iterations) == n_workers
    assert_no_leak(engine)


def test_sampled_requests_draw_nothing_for_prefill_chunks(tiny_llm, sampled):
    """A seeded request draws once per token it gets: split into chunks (chunked) or fed one token per
    iteration beside shorter prompts (ft), its prompt yields no token and no draw, so it gets the
    tokens it gets alone (vLLM and SGLang sample no partial prefill either)."""
    prompts, params, alone = sampled
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=4, n_slots=4096, block_size=8,
                                                      max_num_batched_tokens=16))
    for system in ("orca", "paged", "chunked", "ft"):
        assert llm.generate(prompts, system=system, sampling_params=params) == alone, system
    assert alone != llm.generate(prompts, max_gen_tokens=6)          # sampled, not greedy


def test_preemption_frees_the_latest_arrival_and_admission_is_fcfs(tiny_llm):
    """Seven 16-token prompts growing to 40 tokens in a pool of 8 blocks of 16."""
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=8, n_slots=128))
    engine = llm.new_engine("paged")
    trace = [TraceItem(0.0, tuple(p), 24) for p in random_prompts(7, llm.cfg.vocab_size, 16, 16, 3)]
    result = engine.run(trace)
    its = sorted((it for it in result.iterations), key=lambda it: it.iteration)
    first_in = {}
    for it in its:
        for rid in it.rids:
            first_in.setdefault(rid, it.iteration)
    assert list(first_in) == sorted(first_in)                   # first admitted in arrival order
    assert its[0].rids == (0, 1, 2, 3, 4, 5, 6)                 # 7 prompts x 1 block: the pool holds all
    grown = next(i for i, it in enumerate(its) if len(it.rids) < 7)
    assert its[grown].rids == (0, 1, 2, 3)                      # the three latest arrivals gave way
    df = result.requests_df().set_index("rid")
    assert df.loc[[4, 5, 6], "n_preemptions"].min() >= 1 and df.loc[0, "n_preemptions"] == 0
    assert engine.scheduler.n_preemptions == df["n_preemptions"].sum()
    recompute = [it for it in its[grown + 1:] if 4 in it.rids]
    assert recompute[0].q_lens[recompute[0].rids.index(4)] > 16   # prompt + generated tokens again
    assert_no_leak(engine)


def test_chunked_schedules_decodes_first_and_fills_the_budget_with_the_oldest_prompt(tiny_llm):
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=8, n_slots=1024, max_num_batched_tokens=32))
    engine = llm.new_engine("chunked")
    trace = [TraceItem(0.0, tuple(range(1, 11)), 6), TraceItem(0.0, tuple(range(1, 81)), 3),
             TraceItem(0.0, tuple(range(1, 21)), 2)]
    its = [(it.rids, it.q_lens, it.phases) for it in engine.run(trace).iterations]
    assert its[0] == ((0, 1), (10, 22), ("prefill", "prefill"))
    assert its[1] == ((0, 1), (1, 31), ("decode", "prefill"))      # the decode first, then 31 of 80
    assert its[2] == ((0, 1, 2), (1, 27, 4), ("decode", "prefill", "prefill"))  # prompt 1 done: 2 starts
    assert_no_leak(engine)


@pytest.mark.parametrize("setting", ["paged-preempting", "chunked-preempting"])
def test_simulator_and_real_engine_make_the_same_batches(tiny_llm, setting):
    system, n_slots, budget = SETTINGS[setting]
    trace = trace_of(tiny_llm.cfg.vocab_size, n=8, seed=4)
    real = engine_for(tiny_llm, setting, n_workers=2).run(trace)
    sim = SimBackend(tiny_llm.cfg, cost=AnalyticalCost(tiny_llm.cfg, pipeline_parallel=2), n_slots=n_slots,
                     block_size=8, max_num_batched_tokens=budget)
    simulated = sim.serve(Curve.parse(f"{system}(4)"), trace)
    key = lambda res: [(it.iteration, it.rids, it.q_lens, it.kv_reserved, it.kv_used)
                       for it in res.iterations if it.stage == 0]
    assert key(simulated) == key(real)
    assert list(simulated.requests_df()["n_preemptions"]) == list(real.requests_df()["n_preemptions"])
    assert simulated.requests_df()["n_preemptions"].sum() > 0


def test_a_pipeline_of_worker_processes_gives_the_same_tokens(tiny_llm, expected, sampled):
    """1 x 2 workers over gloo: blocks grow and preempted requests come back with new slots; the last
    stage draws nothing for a sampled request's prefill chunks."""
    trace, alone = expected
    prompts, params, sampled_alone = sampled
    cfg = EngineConfig(max_bs=4, n_slots=64, block_size=8, max_num_batched_tokens=16, pipeline_parallel=2)
    llm = LLM(gpt=tiny_llm.model, engine=cfg)
    with WorkerPool(llm):
        for system in ("paged", "chunked"):
            result = llm.serve(trace, system=system)
            assert [list(r.output) for r in result.requests] == alone, system
            assert result.requests_df()["n_preemptions"].sum() > 0
        assert llm.generate(prompts, system="chunked", sampling_params=params) == sampled_alone


def test_block_manager_hands_out_whole_blocks_and_takes_them_all_back():
    kv = BlockManager(64, 8, watermark=0.25)
    a, b = Request(0, [1] * 5, SamplingParams()), Request(1, [1] * 5, SamplingParams())
    kv.grow(a, 5)
    kv.grow(b, 9)
    kv.grow(a, 17)
    table = lambda r: [s // kv.block_size for s in r.slots[::kv.block_size]]     # its blocks, in order
    assert table(a) == [0, 3, 4] and table(b) == [1, 2]
    assert a.slots[8:16] == list(range(24, 32))                 # block 3, slot by slot
    assert kv.n_free_blocks == 3 and kv.watermark_blocks == 2
    assert kv.can_admit(8) and not kv.can_admit(9)               # 2 blocks would leave 1 < watermark
    kv.release(a)
    kv.release(b)
    assert kv._spans == [[0, 64]] and kv.n_reserved == 0


@pytest.mark.parametrize("changes,match", [
    (dict(block_size=0), r"block_size=0 is out of range"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 is out of range"),
    (dict(block_size=32, max_num_batched_tokens=16), r"max_num_batched_tokens=16 is out of range: allowed \[32,"),
    (dict(n_slots=100, block_size=16), r"block_size=16 must divide n_slots=100"),
])
def test_bad_block_size_or_token_budget_is_refused(tiny_llm, changes, match):
    with pytest.raises(ValueError, match=match):
        LLM(gpt=tiny_llm.model, engine=EngineConfig(**changes)).new_engine("paged")
    with pytest.raises(ValueError, match="system='vllm' is not allowed"):
        tiny_llm.new_engine("vllm")


def test_a_request_that_cannot_fit_alone_is_refused_at_submission(tiny_llm):
    engine = LLM(gpt=tiny_llm.model, engine=EngineConfig(n_slots=64, block_size=16)).new_engine("chunked")
    with pytest.raises(ValueError, match=r"\(60 tokens\) \+ max_gen_tokens \(20\) = 80 tokens, for which chunked "
                                         r"reserves 80 K/V slots, more than the n_slots=64") as e:
        engine.add_request([1] * 60, SamplingParams(max_gen_tokens=20))
    assert e.value.field == "max_gen_tokens"
    with pytest.raises(ValueError, match=r"reserves 80 K/V slots") as e:      # whole blocks of 16
        engine.add_request([1] * 70, SamplingParams(max_gen_tokens=1))
    assert e.value.field == "prompt"
    engine.add_request([1] * 40, SamplingParams(max_gen_tokens=4))     # the engine keeps serving
    assert [len(r.output) for r in engine.run().requests] == [4]


def test_timeline_and_animation_mark_chunks_and_recomputations(tiny_llm):
    from orca_lab.viz.animation import ScheduleFrames
    from orca_lab.viz.timeline import timeline_figure
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=8, n_slots=128, max_num_batched_tokens=32))
    trace = [TraceItem(0.0, tuple(p), g) for p, g in
             zip(random_prompts(5, llm.cfg.vocab_size, 10, 16, 5), (20, 24, 24, 24, 20))]
    trace[1] = TraceItem(0.0, tuple(range(70)), 4)                # 70 tokens: three chunks of <= 32
    result = llm.serve(trace, system="chunked")
    assert result.requests_df()["n_preemptions"].sum() > 0
    hover = " ".join(h for tr in timeline_figure(result).data if tr.hovertext for h in tr.hovertext)
    assert "prefill (chunk 2/3), 31 new token(s)" in hover and "prefill (recompute)" in hover
    frames = ScheduleFrames(result)
    lines = [frames.describe(k) for k in range(len(frames))]
    assert "B chunk 1/3" in lines[0] and any("recompute" in line for line in lines)
    assert "chunk 2/3" in frames.to_html(1)


@pytest.mark.parametrize("system", ["paged", "chunked"])
def test_two_batches_in_flight_do_not_livelock_a_tight_pool(system):
    """Eight blocks, prompts of up to 51 tokens, two batches in flight. Before, a request whose later
    neighbours were in flight gave way itself (or an earlier request gave way to a later one), and
    three requests took each other's blocks for ever: the engine never finished. A request now only
    preempts later arrivals, and waits, keeping its blocks, for one in flight to come back."""
    from orca_lab.config import model_config
    from orca_lab.workload import paper_trace
    cfg = model_config("tiny")
    sim = SimBackend(cfg, cost=AnalyticalCost(cfg, pipeline_parallel=2), n_slots=64, block_size=8,
                     max_num_batched_tokens=16)
    engine = sim.new_engine(Curve.parse(f"{system}(4)"))
    trace = [it for it in paper_trace(40, None, 0, scale=0.1, vocab_size=cfg.vocab_size)
             if len(it.prompt) + it.max_gen_tokens <= 64]
    reqs = [engine.add_request(list(it.prompt), it.sampling_params(), 0.0) for it in trace]
    for _ in range(20_000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), f"still serving after 20,000 steps: {engine.stats()}"
    assert [len(r.output) for r in reqs] == [it.max_gen_tokens for it in trace]
    assert engine.scheduler.n_preemptions > 0
    assert_no_leak(engine)


def test_a_new_system_is_one_registry_entry(tiny_llm, monkeypatch):
    """Every place that builds or checks a system reads its entry: a new one (chunked prefill that
    takes only SGLang's longest-prefix order) is served by ``LLM``, checked by the entry, and an
    entry that reserves slots refuses prefix caching."""
    from orca_lab.engine import policies
    from orca_lab.engine.prefix_cache import PrefixCachingBlockManager
    entry = policies.System("chunked-lpm", lambda kv, max_bs, _len, _mbs, budget, policy:
                            policies.ChunkedScheduler(kv, max_bs, budget, policy), paged=True, policies=("lpm",))
    monkeypatch.setitem(policies.REGISTRY, entry.name, entry)
    prompts = random_prompts(3, 256, 10, 40, seed=2)
    want = tiny_llm.generate(prompts, 3)
    llm = LLM(gpt=tiny_llm.model, engine=EngineConfig(max_bs=4, n_slots=1024, max_num_batched_tokens=16,
                                                      prefix_caching=True, schedule_policy="lpm"))
    engine = llm.new_engine("chunked-lpm")
    assert isinstance(engine.scheduler, policies.ChunkedScheduler) and engine.scheduler.budget == 16
    assert isinstance(engine.scheduler.kv, PrefixCachingBlockManager)
    engine.close()
    assert llm.generate(prompts, 3, "chunked-lpm") == want
    with pytest.raises(ValueError, match="schedule_policy='fcfs' is not allowed with system='chunked-lpm'"):
        LLM(gpt=tiny_llm.model, engine=EngineConfig(n_slots=1024, prefix_caching=True)).new_engine("chunked-lpm")
    with pytest.raises(ValueError, match="prefix_caching=True is not allowed with system='orca'.*'chunked-lpm'"):
        policies.system("orca").check(prefix_caching=True)


# -- the registry is the only list of systems ---------------------------------------------------
def test_one_more_registry_entry_is_a_system_of_the_cli_the_simulator_and_torchrun(monkeypatch, capsys):
    """A new policy is one entry: ``orca-lab serve`` lists and takes it, a Curve takes it (with a
    micro-batch size when it schedules whole requests), torchrun lists it."""
    import dataclasses
    from orca_lab import cli, torchrun
    from orca_lab.engine.policies import REGISTRY
    monkeypatch.setitem(REGISTRY, "orca2", dataclasses.replace(REGISTRY["orca"], name="orca2"))
    monkeypatch.setitem(REGISTRY, "ft2", dataclasses.replace(REGISTRY["ft"], name="ft2"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0 and "orca2" in capsys.readouterr().out
    served = []
    monkeypatch.setattr(cli, "serve", lambda args: served.append(args.system))
    cli.main(["serve", "--system", "orca2"])
    assert served == ["orca2"]
    assert Curve("orca2", 8).label == Curve.parse("orca2(8)").label == "orca2(8)"
    assert Curve.parse("ft2(8,4)") == Curve("ft2", 8, 4) and Curve.of("ft2", 8) == Curve("ft2", 8, 8)
    with pytest.raises(ValueError, match=r"mbs=None must be an integer in \[1, 8\]"):
        Curve("ft2", 8)
    assert "ft2" in torchrun.parse_args([])[0].format_help()


def test_no_module_outside_the_registry_tells_a_system_by_its_name():
    """What sets a system apart is a field of its entry (``paged``, ``request_level``), never
    ``system == "ft"``. (The course's plug points check the scheduler whose piece they replace.)"""
    import re
    from pathlib import Path
    import orca_lab
    from orca_lab.engine.policies import REGISTRY
    names = "|".join(REGISTRY)
    test = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    root = Path(orca_lab.__file__).parent
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}" for path in sorted(root.rglob("*.py"))
             if path.name != "policies.py" and "course" not in path.parts
             for i, line in enumerate(path.read_text().splitlines(), 1) if test.search(line)]
    assert found == []
