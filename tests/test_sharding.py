"""Each worker builds or reads only its own shard, and the shards equal slices of the one-process model:
seeded random weights drawn chunk by chunk, checkpoints read slice by slice."""
import pytest
import torch

from orca_lab import LLM, EngineConfig
from orca_lab.config import PRESETS, ModelConfig, check_degrees
from orca_lab.engine.executor import split_layers
from orca_lab.model.gpt import GPT, CheckpointWeights, RandomWeights, StateDictWeights
from orca_lab.model.tensor_parallel import stage_model

TINY = PRESETS["tiny"]


def stages(cfg, T, P):
    for s, layers in enumerate(split_layers(cfg.n_layers, P)):
        for t in range(T):
            yield dict(layers=layers, t=t, T=T, first=s == 0, last=s == P - 1)


def part(weights, cfg, layers, t, T, first, last):
    return stage_model(weights, cfg, layers, t, T, first=first, last=last, all_reduce=lambda x: x)


class Recording:
    """A weight source that remembers what was read from it."""
    def __init__(self, inner):
        self.inner, self.names = inner, []

    def read(self, name, shape, ranges=None):
        self.names.append(name)
        return self.inner.read(name, shape, ranges)


@pytest.mark.parametrize("T,P", [(2, 2), (4, 1), (1, 3)])
def test_random_shards_equal_slices_of_the_full_model(T, P, monkeypatch):
    monkeypatch.setattr(RandomWeights, "CHUNK", 3000)   # chunks far smaller than the shards: many boundaries
    full = GPT.random(TINY, seed=4)
    for where in stages(TINY, T, P):
        drawn = Recording(RandomWeights(seed=4))
        mine = part(drawn, TINY, **where).state_dict()
        cut = part(StateDictWeights(full.state_dict()), TINY, **where).state_dict()
        assert mine.keys() == cut.keys()
        for k in mine:
            assert torch.equal(mine[k], cut[k]), k
        lo, hi = where["layers"]                      # only this stage's layers were drawn
        assert {int(n.split(".")[1]) for n in drawn.names if n.startswith("blocks.")} == set(range(lo, hi))
        assert ("wpe.weight" in drawn.names) == where["first"]


def test_a_slice_is_drawn_alone_across_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(RandomWeights, "CHUNK", 50)      # 50 // 13 = 3 rows per chunk
    w = RandomWeights(seed=9, dtype=torch.float64)
    for name, dim in (("blocks.0.c_fc.weight", 0), ("blocks.0.mlp_proj.weight", 1)):
        shape = (37, 13) if dim == 0 else (13, 37)
        whole = w.read(name, shape)
        ranges = ((3, 17), (20, 37), (0, 1))
        expected = torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim)
        assert torch.equal(w.read(name, shape, ranges), expected)
    assert not torch.equal(w.read("a.weight", (8,)), RandomWeights(seed=10, dtype=torch.float64).read("a.weight", (8,)))


def test_checkpoint_shards_read_only_their_slices(tmp_path):
    full = GPT.random(TINY, seed=2)
    full.save_pretrained(tmp_path)
    for where in stages(TINY, 2, 2):
        read = Recording(CheckpointWeights(tmp_path))
        mine = part(read, TINY, **where).state_dict()
        cut = part(StateDictWeights(full.state_dict()), TINY, **where).state_dict()
        for k in mine:
            assert torch.equal(mine[k], cut[k]), k
        lo, hi = where["layers"]
        assert {int(n.split(".")[1]) for n in read.names if n.startswith("blocks.")} == set(range(lo, hi))


def test_random_init_keeps_its_distribution():
    cfg = ModelConfig("mid", n_layers=2, d_model=384, n_heads=6, vocab_size=3001, max_seq_len=512)
    model = GPT.random(cfg, seed=0)
    for name, p in model.named_parameters():
        gain = ".ln" in f".{name}" and name.endswith("weight")
        assert abs(p.mean().item() - (1.0 if gain else 0.0)) < 0.02, name
        assert abs(p.std().item() - 0.1) < 0.01, name
    assert not torch.equal(model.blocks[0].c_fc.weight[:100], model.blocks[1].c_fc.weight[:100])
    assert torch.equal(model.blocks[0].c_fc.weight, GPT.random(cfg, seed=0).blocks[0].c_fc.weight)


def test_workers_build_their_own_shards_and_give_the_one_process_tokens(tiny_llm):
    llm = LLM("tiny", seed=1, engine=EngineConfig(max_bs=4, n_slots=4096, tensor_parallel=2, pipeline_parallel=2))
    assert llm.model.wte.weight.is_meta                 # the master holds no weights
    prompts = [[5, 6, 7, 8, 9], [200, 3], list(range(40, 71))]
    assert llm.generate(prompts, max_gen_tokens=6) == tiny_llm.generate(prompts, max_gen_tokens=6)


def test_degrees_under_a_launcher_follow_its_world_not_the_local_gpus(monkeypatch):
    def no_gpu_query():
        raise AssertionError("the local GPU count must not decide a launcher's world")
    monkeypatch.setattr("torch.cuda.device_count", no_gpu_query)
    for k, v in dict(RANK="0", WORLD_SIZE="32", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8").items():
        monkeypatch.setenv(k, v)
    cfg = PRESETS["gpt3-175b"]
    check_degrees(cfg, EngineConfig(tensor_parallel=8, pipeline_parallel=4, device="cuda"))
    with pytest.raises(ValueError, match=r"8 x 2 = 16 must equal the launcher's world size WORLD_SIZE=32"):
        check_degrees(cfg, EngineConfig(tensor_parallel=8, pipeline_parallel=2, device="cuda"))
