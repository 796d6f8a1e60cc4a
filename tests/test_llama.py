"""The Llama family (Llama, Qwen2) against transformers on the same random weights: grouped and not,
tied and not, Llama 3's rope scaling, Qwen2's q/k/v bias, one checkpoint sharded; logits, greedy
tokens, and batched requests equal to each alone on every system; ``orca-lab serve --checkpoint``;
Llama 3's list of EOS ids."""
import json
import re
import shutil

import pytest
import torch
from helpers import first_iteration_logits, hf_greedy, hf_llama, random_prompts

from orca_lab import LLM
from orca_lab.cli import main
from orca_lab.config import EngineConfig, ModelConfig
from orca_lab.engine.executor import split_layers
from orca_lab.engine.policies import SYSTEMS
from orca_lab.model.families import checkpoint_weights, from_pretrained
from orca_lab.model.gpt import StateDictWeights
from orca_lab.model.tensor_parallel import stage_model
from orca_lab.serving.launch import ServerProcess

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# name: (architecture, shape, max_shard_size)
SHAPES = {
    "llama-gqa-untied-llama3": ("LlamaForCausalLM", dict(rope_scaling=LLAMA3, rope_theta=500000.0), None),
    "llama-mha-tied": ("LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True), None),
    "qwen2-mqa-tied-sharded": ("Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                        num_hidden_layers=3), "20KB"),
    "qwen2-gqa-untied": ("Qwen2ForCausalLM", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                                  intermediate_size=56), None),
}
N_GEN = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``name -> (transformers model, its checkpoint directory)``, each made once for the module."""
    made = {}

    def get(name):
        if name not in made:
            arch, shape, shard = SHAPES[name]
            path = tmp_path_factory.mktemp(name)
            made[name] = hf_llama(path, arch, max_shard_size=shard, **shape), path
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, saved):
    return saved(request.param)


@pytest.fixture(scope="module")
def prompts(checkpoint):
    return random_prompts(4, checkpoint[0].config.vocab_size, 1, 24, seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """transformers' greedy tokens of each prompt alone."""
    return [hf_greedy(checkpoint[0], p, N_GEN) for p in prompts]


def test_sharded_checkpoint_is_sharded(tmp_path):
    hf_llama(tmp_path, "Qwen2ForCausalLM", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1


def test_last_token_logits_match_transformers(checkpoint, prompts):
    hf, path = checkpoint
    llm = LLM.from_pretrained(path, engine=EngineConfig(max_bs=4, n_slots=512))
    assert llm.cfg.family == "llama" and llm.cfg.n_kv_heads == hf.config.num_key_value_heads
    with torch.inference_mode():
        for row, p in zip(first_iteration_logits(llm, prompts), prompts):
            torch.testing.assert_close(row, hf(torch.tensor([p])).logits[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("system", SYSTEMS)
def test_batched_greedy_equals_transformers_alone(checkpoint, prompts, reference, system):
    """Every system batches the prompts (prefills and decodes mixed, or ft's padded steps) and gives
    each one transformers' tokens of it alone."""
    llm = LLM.from_pretrained(checkpoint[1], engine=EngineConfig(max_bs=3, n_slots=512, block_size=8,
                                                                  max_num_batched_tokens=16))
    assert llm.generate(prompts, N_GEN, system=system, ignore_eos=True) == reference


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
@pytest.mark.parametrize("name", ["llama-gqa-untied-llama3", "qwen2-mqa-tied-sharded"])
def test_workers_equal_in_process(saved, name, degrees):
    """Tensor-parallel workers split the K/V heads (2 of 2) or replicate them (1 K/V head on 2 ranks),
    each reading only its slices of the checkpoint; pipeline stages read only their layers."""
    hf, path = saved(name)
    prompts = random_prompts(4, hf.config.vocab_size, 1, 24, seed=5)
    tp, pp = degrees
    llm = LLM.from_pretrained(path, engine=EngineConfig(max_bs=3, n_slots=512, tensor_parallel=tp,
                                                         pipeline_parallel=pp, executor="workers"))
    alone = LLM.from_pretrained(path, engine=EngineConfig(max_bs=3, n_slots=512))
    assert llm.generate(prompts, N_GEN, ignore_eos=True) == alone.generate(prompts, N_GEN, ignore_eos=True)


@pytest.mark.parametrize("name", ["llama-gqa-untied-llama3", "qwen2-mqa-tied-sharded"])
@pytest.mark.parametrize("T,P", [(2, 2), (4, 1)])
def test_checkpoint_shards_equal_slices_of_the_whole_model(saved, name, T, P):
    """Each (stage, rank) reads only its layers, and of them only its heads' rows (the K/V heads
    split, or one replicated head per rank past their number), equal to the same slices of the
    whole model."""
    path = saved(name)[1]
    weights = checkpoint_weights(path)
    cfg = weights.cfg
    whole = StateDictWeights(from_pretrained(path).state_dict())
    for s, layers in enumerate(split_layers(cfg.n_layers, P)):
        for t in range(T):
            where = dict(first=s == 0, last=s == P - 1, all_reduce=lambda x: x)
            read = []
            mine = stage_model(_Recording(weights, read), cfg, layers, t, T, **where).state_dict()
            cut = stage_model(whole, cfg, layers, t, T, **where).state_dict()
            assert mine.keys() == cut.keys()
            for k in mine:
                assert torch.equal(mine[k], cut[k]), k
            assert {int(n.split(".")[1]) for n, _ in read if n.startswith("blocks.")} == set(range(*layers))
            assert all(ranges is not None for n, ranges in read if n.endswith(("c_attn.weight", "c_fc.weight")))
            assert mine["blocks.0.c_attn.weight"].shape[0] == (cfg.n_heads // T + 2 * cfg.kv_heads_on(T)) * cfg.head_dim


class _Recording:
    def __init__(self, inner, read):
        self.inner, self.read_names = inner, read

    def read(self, name, shape, ranges=None):
        self.read_names.append((name, ranges))
        return self.inner.read(name, shape, ranges)


def _config(path, **changes):
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**c, **changes}))


@pytest.mark.parametrize("changes,match", [
    (dict(architectures=["MistralForCausalLM"]), r"architectures=\['MistralForCausalLM'\] is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), r"rope_scaling.rope_type='yarn'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), r"rope_scaling.factor=None"),
    (dict(num_key_value_heads=3), r"n_kv_heads=3 must divide n_heads=4"),
    (dict(intermediate_size=None), r"'intermediate_size' is missing"),
    (dict(use_sliding_window=True), r"use_sliding_window=True is not supported"),
    (dict(head_dim=16), r"head_dim=16 is not supported"),
])
def test_bad_or_unsupported_configs_are_refused_naming_the_field(saved, tmp_path, changes, match):
    shutil.copytree(saved("llama-mha-tied")[1], tmp_path, dirs_exist_ok=True)
    _config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        LLM.from_pretrained(tmp_path)


def test_a_missing_tensor_or_shard_is_named(saved, tmp_path):
    shutil.copytree(saved("qwen2-mqa-tied-sharded")[1], tmp_path, dirs_exist_ok=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_proj.bias"):
        LLM.from_pretrained(tmp_path)
    next(tmp_path.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-"):
        LLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_heads=0), r"n_kv_heads=0 is out of range"),
    (dict(n_kv_heads=2), r"n_kv_heads=2 is not allowed with family='gpt2'"),
    (dict(family="llama", rope_theta=0.5), r"rope_theta=0.5 is out of range"),
    (dict(family="llama", intermediate_size=0), r"intermediate_size=0 is out of range"),
    (dict(family="opt"), r"family='opt' is not allowed"),
])
def test_bad_model_config_fields_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig("x", n_layers=1, d_model=32, n_heads=4, **kw)


def test_tensor_parallel_must_split_the_kv_heads_or_replicate_them():
    cfg = ModelConfig("x", n_layers=2, d_model=96, n_heads=6, family="llama", n_kv_heads=3, intermediate_size=60)
    cfg.check_tensor_parallel(3)
    cfg.check_tensor_parallel(6)                   # one K/V head on each pair of ranks
    with pytest.raises(ValueError, match="tensor_parallel=2 is not allowed: it must divide n_kv_heads=3"):
        cfg.check_tensor_parallel(2)


def test_tiny_llama_preset_equals_transformers_and_batches_like_alone(tmp_path):
    """The preset: seeded random weights, byte vocabulary, 4 query heads on 2 K/V heads, nothing
    downloaded; saved, transformers loads it and gives the same greedy tokens."""
    llm = LLM("tiny-llama", engine=EngineConfig(max_bs=4, n_slots=1024, block_size=8, max_num_batched_tokens=16))
    assert (llm.cfg.family, llm.cfg.vocab_size, llm.cfg.n_heads, llm.cfg.n_kv_heads) == ("llama", 257, 4, 2)
    assert llm.engine_config.n_slots * llm.cfg.kv_bytes_per_token(4) == 1024 * 2 * 4 * 2 * 64 * 4
    prompts = random_prompts(4, 257, 1, 20, seed=8)
    llm.save_pretrained(tmp_path)
    hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reference = [hf_greedy(hf, p, 6) for p in prompts]
    for system in SYSTEMS:
        assert llm.generate(prompts, 6, system=system, ignore_eos=True) == reference, system


def test_serve_a_llama_checkpoint_directory(saved):
    """``orca-lab serve --checkpoint DIR`` over a sharded Qwen2 checkpoint gives transformers' tokens
    through the official client."""
    openai = pytest.importorskip("openai")
    hf, path = saved("qwen2-mqa-tied-sharded")
    prompts = random_prompts(3, hf.config.vocab_size, 1, 20, seed=4)
    s = ServerProcess("--checkpoint", path, "--max-bs", "4", "--n-slots", "512").start()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [str(path)]
        resp = client.completions.create(model=str(path), prompt=prompts, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        got = [c.model_extra["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)]
        assert got == [hf_greedy(hf, p, 6) for p in prompts]
    finally:
        assert s.stop() < 10


REFUSED = {"missing": r"--checkpoint \S+/ckpt: \S+ is not a checkpoint directory: it must hold config.json",
           "no-weights": r"--checkpoint \S+: \S+ is not a checkpoint directory",
           "unsupported": r"--checkpoint \S+: \S+config.json: hidden_act='gelu' is not supported",
           "and-model": r"--model tiny and --checkpoint \S+: give one of them"}


@pytest.mark.parametrize("case", REFUSED)
def test_serve_refuses_a_bad_checkpoint_naming_the_flag(saved, tmp_path, capsys, case):
    """Refused before a server or an engine process starts, with the flag and what is wrong."""
    path = tmp_path / "ckpt"
    if case != "missing":
        shutil.copytree(saved("llama-mha-tied")[1], path)
    if case == "no-weights":
        (path / "model.safetensors").unlink()
    if case == "unsupported":
        _config(path, hidden_act="gelu")
    flags = ["--model", "tiny"] if case == "and-model" else []
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags, "--checkpoint", str(path)])
    assert e.value.code == 2 and re.search(REFUSED[case], capsys.readouterr().err)


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_every_eos_id_of_a_list_ends_a_request_as_in_transformers(saved, tmp_path, where):
    """Llama 3 lists several EOS ids (config.json's ``eos_token_id``, or generation_config.json's,
    which transformers' ``generate`` reads first): a request that does not ignore EOS stops at the
    second id of the list, where transformers stops, that id included; batched with others as alone."""
    hf, src = saved("llama-gqa-untied-llama3")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    prompts = random_prompts(3, hf.config.vocab_size, 4, 12, seed=7)
    free = hf_greedy(hf, prompts[0], 12)
    k = next(i for i in range(2, 12) if free[i] not in free[:i])      # an id first generated at k >= 2
    eos = [next(t for t in range(hf.config.vocab_size) if t not in free), free[k]]    # the first never comes
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    if where == "config.json":
        _config(tmp_path, eos_token_id=eos)
        (tmp_path / "generation_config.json").unlink()
    else:
        _config(tmp_path, eos_token_id=eos[0])
        (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([prompts[0]])
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, len(prompts[0]):].tolist() == free[:k + 1]
    llm = LLM.from_pretrained(tmp_path, engine=EngineConfig(max_bs=3, n_slots=512))
    batched = llm.complete(prompts, 12, ignore_eos=False)
    assert (batched[0].token_ids, batched[0].finish_reason) == (free[:k + 1], "stop")
    assert llm.eos_token_ids == tuple(eos)
    assert batched == [llm.complete([p], 12, ignore_eos=False)[0] for p in prompts]
