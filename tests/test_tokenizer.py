"""Tokenizers: GPT-2's BPE offline, a Hugging Face tokenizer beside a checkpoint, any encode/decode."""
import importlib.util

import pytest

from orca_lab import LLM, EngineConfig, ModelConfig, PRESETS
from orca_lab.tokenizer import GPT2_RANKS_ENV, default_tokenizer, gpt2_ranks_path, gpt2_tokenizer, load_tokenizer

needs_gpt2 = pytest.mark.skipif(
    importlib.util.find_spec("tiktoken") is None or gpt2_ranks_path() is None,
    reason="GPT-2's BPE needs `pip install tiktoken` and `pip install --no-deps openai-whisper` (scripts/test.sh)")
SMALL = dict(n_layers=1, d_model=32, n_heads=2, max_seq_len=64)


@needs_gpt2
@pytest.mark.parametrize("text,ids", [
    ("Hello world", [15496, 995]),
    ("Hello, my dog is cute", [15496, 11, 616, 3290, 318, 13779]),     # Hugging Face's GPT-2 example
    (" the", [262]),
    ("<|endoftext|>", [50256]),
])
def test_gpt2_bpe_gives_gpt2s_ids(text, ids):
    tok = gpt2_tokenizer()
    assert tok.encode(text) == ids and tok.decode(ids) == text
    assert tok.vocab_size == 50257 and tok.eos_token_id == 50256


@needs_gpt2
def test_gpt2_vocabulary_takes_and_returns_text():
    """The gpt2 preset's vocabulary gets GPT-2's BPE by default (here on a one-layer model)."""
    assert isinstance(default_tokenizer(PRESETS["gpt2"].vocab_size), type(gpt2_tokenizer()))
    llm = LLM(ModelConfig("gpt2-shaped", vocab_size=50257, **SMALL), engine=EngineConfig(n_slots=256))
    c = llm.complete(["Hello world"], 4)[0]
    assert c.prompt_token_ids == [15496, 995] and c.text == gpt2_tokenizer().decode(c.token_ids)
    assert llm.eos_token_id == 50256
    # a stop string that ends inside a BPE token: the text stops before it, the token stays in token_ids
    full = llm.complete(["Hello world"], 12)[0]
    first = len(gpt2_tokenizer().decode(full.token_ids[:1]))
    stop = full.text[first + 1:first + 4]
    cut = llm.complete(["Hello world"], 12, stop=stop)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12


@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("gpt2", marks=needs_gpt2)])
def test_a_tokens_bytes_add_up_to_the_text_pieces_of_a_character_included(tokenizer):
    """``token_bytes`` (the chat's logprobs ``bytes``): a token's own bytes, so a character split over
    tokens (each decoding to U+FFFD alone) is whole again when its tokens' bytes are joined."""
    tok = gpt2_tokenizer() if tokenizer == "gpt2" else default_tokenizer(257)
    text = "orca 🐋 schedules — every iteration"
    ids = tok.encode(text)
    assert any(tok.decode([t]) == "\ufffd" for t in ids)
    assert b"".join(tok.token_bytes(t) for t in ids).decode("utf-8") == text


def test_missing_gpt2_ranks_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv(GPT2_RANKS_ENV, str(tmp_path / "none.tiktoken"))
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("tiktoken not installed: the error names it instead")
    with pytest.raises(FileNotFoundError, match="openai-whisper"):
        gpt2_tokenizer()
    assert default_tokenizer(50257) is None             # no ranks: token ids only, no error


def train_bpe(vocab_size=300):
    """A byte-level BPE trained here on a few sentences: nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["iteration-level scheduling runs one iteration at a time",
            "selective batching flattens the tokens of every request", "the orca serves requests"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs `tokenizers`")
@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.json+merges.txt"])
def test_from_pretrained_picks_up_the_tokenizer_beside_the_checkpoint(tmp_path, layout):
    import json
    tok = train_bpe()
    cfg = ModelConfig("bpe", vocab_size=tok.get_vocab_size(), **SMALL)
    LLM(cfg, seed=3).save_pretrained(tmp_path)
    eos = tok.token_to_id("<|endoftext|>")
    if layout == "tokenizer.json":
        tok.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    else:
        tok.model.save(str(tmp_path))                    # GPT-2's slow layout: vocab.json + merges.txt
        (tmp_path / "config.json").write_text(json.dumps(
            {**json.loads((tmp_path / "config.json").read_text()), "eos_token_id": eos}))
    llm = LLM.from_pretrained(tmp_path, engine=EngineConfig(n_slots=256))
    text = "the orca schedules every iteration"
    assert llm.tokenizer.encode(text) == tok.encode(text).ids and llm.eos_token_id == eos
    c = llm.complete([text], 5, ignore_eos=False)[0]
    assert c.prompt_token_ids == tok.encode(text).ids and c.text == tok.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids)
    if layout == "tokenizer.json":                       # saved with the weights, found again
        LLM.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
        assert load_tokenizer(tmp_path / "again").encode(text) == tok.encode(text).ids


def test_a_checkpoint_without_tokenizer_files_takes_token_ids(tmp_path):
    LLM(ModelConfig("ids", vocab_size=300, **SMALL)).save_pretrained(tmp_path)
    llm = LLM.from_pretrained(tmp_path)
    assert llm.tokenizer is None and load_tokenizer(tmp_path) is None
    with pytest.raises(TypeError, match="a string prompt needs a tokenizer"):
        llm.generate(["text"], 2)
    assert len(llm.generate([[1, 2]], 2)[0]) == 2
