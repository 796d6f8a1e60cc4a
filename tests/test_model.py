"""The model against Hugging Face transformers' GPT-2 on the same weights, and its checkpoints."""
import copy

import pytest
import torch
from helpers import engine_config, first_iteration_logits, random_prompts

from orca_lab import LLM, PRESETS, EngineConfig, ModelConfig
from orca_lab.model.gpt import GPT


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory):
    """A GPT-2 of odd sizes (3 layers, width 96, 3 heads of 32, vocab 301) saved in the HF layout."""
    cfg = ModelConfig("odd", n_layers=3, d_model=96, n_heads=3, vocab_size=301, max_seq_len=128)
    path = tmp_path_factory.mktemp("ckpt")
    GPT.random(cfg, seed=7).save_pretrained(path)
    return path


def test_greedy_output_equals_transformers_gpt2(odd_checkpoint):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(odd_checkpoint).eval()
    llm = LLM.from_pretrained(odd_checkpoint, engine=EngineConfig(max_bs=3, n_slots=2048))
    prompts = random_prompts(5, 301, 1, 30, seed=9)
    ours = llm.generate(prompts, max_gen_tokens=10)
    for prompt, out in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()


def test_last_token_logits_match_transformers(odd_checkpoint):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(odd_checkpoint).eval()
    llm = LLM.from_pretrained(odd_checkpoint, engine=EngineConfig(max_bs=4, n_slots=512))
    prompts = random_prompts(3, 301, 2, 40, seed=1)
    with torch.inference_mode():
        for row, p in zip(first_iteration_logits(llm, prompts), prompts):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4)


def test_checkpoint_round_trip(odd_checkpoint, tmp_path):
    a = LLM.from_pretrained(odd_checkpoint)
    a.save_pretrained(tmp_path)
    b = LLM.from_pretrained(tmp_path)
    for (n, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), n


def test_missing_checkpoint_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        (tmp_path / "config.json").write_text("{}")
        LLM.from_pretrained(tmp_path)


def test_seeded_random_weights_are_reproducible_and_not_zero():
    a, b = GPT.random(PRESETS["tiny"], seed=5), GPT.random(PRESETS["tiny"], seed=5)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q) and p.abs().min() > 0 or p.abs().mean() > 1e-3, n


@pytest.mark.parametrize("name", ["gpt2", "gpt3-13b", "gpt3-101b", "gpt3-175b", "gpt3-341b"])
def test_presets_build_on_the_meta_device(name):
    cfg = PRESETS[name]
    model = GPT.random(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    if name.startswith("gpt3"):
        assert cfg.head_dim == 128 and cfg.max_seq_len == 2048


def test_preset_shapes_follow_the_paper():
    shapes = {n: (PRESETS[n].n_layers, PRESETS[n].d_model) for n in PRESETS}
    assert shapes["gpt3-101b"] == (80, 10240) and shapes["gpt3-175b"] == (96, 12288)
    assert shapes["gpt3-341b"] == (120, 15360) and shapes["gpt3-13b"] == (40, 5120)
    assert round(PRESETS["gpt3-175b"].n_params / 1e9) == 175 and PRESETS["tiny"].n_layers == 4


@pytest.mark.parametrize("kw,match", [
    (dict(n_layers=0), "n_layers=0"), (dict(d_model=100, n_heads=3), "divisible"),
    (dict(vocab_size=1), "vocab_size=1"), (dict(max_seq_len=0), "max_seq_len=0"),
])
def test_bad_model_config_names_the_field(kw, match):
    base = dict(name="x", n_layers=2, d_model=64, n_heads=4)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **kw})


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="model='gpt5'"):
        LLM("gpt5")


@pytest.mark.parametrize("system,prefix_caching", [("orca", False), ("ft", False), ("paged", True),
                                                   ("chunked", True)])
def test_triton_backend_gives_the_torch_backends_tokens(tiny_llm, system, prefix_caching):
    """The whole engine on the Triton kernels (compiled on a GPU, interpreted on a CPU) against the
    PyTorch path on the same device, for each system: whole prompts read their keys from the step
    (through the TMA where it can: the interpreter runs that code too), and with prefix caching a
    prompt whose first 32 tokens are cached, and chunks after a prompt's first (16 new tokens an
    iteration), read theirs through their slots."""
    shared = random_prompts(1, tiny_llm.cfg.vocab_size, 32, 32, seed=3)[0]
    prompts = random_prompts(2, tiny_llm.cfg.vocab_size, 2, 12, seed=8) + [shared + [7, 8, 9]]
    kw = dict(max_bs=3, n_slots=2048, block_size=16, max_num_batched_tokens=16, prefix_caching=prefix_caching)
    outputs = []
    for backend in ("triton", "torch"):
        llm = LLM(gpt=copy.deepcopy(tiny_llm.model),
                  engine=engine_config(**kw, attention_backend=backend, fused_ops_backend=backend))
        first = llm.generate([shared + [1, 2]], max_gen_tokens=2, system=system) if prefix_caching else []
        outputs.append(first + llm.generate(prompts, max_gen_tokens=3, system=system))   # first: cached blocks
    assert outputs[0] == outputs[1]
