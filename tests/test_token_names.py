"""Token names in answers (logprobs' tokens and keys, the chat's token and bytes, prompt_logprobs'
decoded_token, /tokenize's token_strs): one function, distinct ids distinct names, for every
tokenizer the package loads: the byte tokenizer, GPT-2's BPE (tiktoken's, and the same in the Hugging
Face layout), a byte-level BPE and a Llama-2-style SentencePiece BPE with byte fallback, both built
here in memory (nothing downloaded)."""
import importlib.util

import pytest

from orca_lab.model.logprobs import TokenLogprob
from orca_lab.serving.logprob_text import ChatLogprobs, LogprobText, TokenNames, prompt_entries
from orca_lab.tokenizer import ByteTokenizer, HFTokenizer, gpt2_tokenizer, load_tokenizer

from test_tokenizer import needs_gpt2, train_bpe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs `tokenizers`")

# A Llama-2-style vocabulary in small: "▁a", "a" and "<0x61>" all decode to "a".
PIECES = ["<unk>", "<s>", "</s>", "<0x61>", "<0x62>", "<0xC3>", "<0xA9>", "▁", "a", "b", "▁a", "▁b"]


def sentencepiece_bpe():
    """Llama 2's tokenizer.json, in small: BPE over ``▁``-marked words with byte fallback, decoded by
    Replace("▁", " "), ByteFallback, Fuse, Strip (as transformers converts Llama 2's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    bpe = models.BPE({p: i for i, p in enumerate(PIECES)}, [("▁", "a"), ("▁", "b")], unk_token="<unk>",
                     byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in PIECES[:3]])
    return tok


def tokenizer(kind):
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "sentencepiece":
        return HFTokenizer(sentencepiece_bpe(), eos_token_id=2)
    return HFTokenizer(train_bpe(), eos_token_id=None)              # byte-level, as GPT-2's, Qwen2's


@pytest.mark.parametrize("kind", ["bytes", pytest.param("gpt2", marks=needs_gpt2), "byte-level", "sentencepiece"])
def test_every_token_of_a_vocabulary_has_a_name_of_its_own(kind):
    tok = tokenizer(kind)
    names = TokenNames(tok)
    assert len({names.name(t) for t in range(tok.vocab_size)}) == tok.vocab_size


def test_sentencepiece_names_are_its_pieces_and_byte_fallback_is_bytes(tmp_path):
    """As ``convert_ids_to_tokens`` gives them: ``▁a`` and ``a`` stay two names, a byte-fallback piece
    is its byte in OpenAI's ``bytes:`` form (even an ASCII one: ``<0x61>`` is not ``a``); the chat's
    ``bytes`` are what each token stands for, so a character's pieces join into it. The tokenizer as
    a server loads it, from the tokenizer.json beside a checkpoint (/tokenize's token_strs)."""
    sentencepiece_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("ab a é")
    names = TokenNames(tok)
    assert [names.name(t) for t in ids] == ["▁a", "b", "▁a", "▁", "bytes:\\xc3", "bytes:\\xa9"]
    assert [names.name(PIECES.index(p)) for p in ("a", "<0x61>", "</s>")] == ["a", "bytes:\\x61", "</s>"]
    chat = ChatLogprobs(tok)
    assert b"".join(bytes(chat.item(t, 0.0)["bytes"]) for t in ids).decode() == " ab a é"


def test_top_logprobs_hold_k_names_where_the_tokens_decode_alike():
    """The issue's case: ``logprobs=4`` on tokens that decode to the same text gives 4 keys, not 2."""
    tok = HFTokenizer(sentencepiece_bpe(), eos_token_id=2)
    top = tuple((PIECES.index(p), -1.0 - i) for i, p in enumerate(["▁a", "a", "<0x61>", "▁"]))
    entry = TokenLogprob(PIECES.index("a"), -2.0, top)
    got = LogprobText(tok, k=4).chunk([(entry.token, entry)])
    assert got["top_logprobs"] == [{"▁a": -1.0, "a": -2.0, "bytes:\\x61": -3.0, "▁": -4.0}]
    assert got["tokens"] == ["a"]
    chat = ChatLogprobs(tok, k=4).chunk([(entry.token, entry)])["content"][0]
    assert [x["token"] for x in chat["top_logprobs"]] == ["▁a", "a", "bytes:\\x61", "▁"]
    prompt = prompt_entries(TokenNames(tok), [1, entry.token], [None, entry], 4)[1]
    assert [e["decoded_token"] for e in prompt.values()] == ["▁a", "a", "bytes:\\x61", "▁"]


@needs_gpt2
def test_gpt2_names_are_its_bytes_from_tiktoken_and_from_its_hugging_face_strings():
    """GPT-2's names are OpenAI's (`` the``, ``bytes:\\xe2\\x80`` for a piece of a character), not
    the byte-level strings (``Ġthe``) a client would have to map back to bytes; the same whichever way
    GPT-2's tokenizer is loaded (tiktoken's ranks, or a tokenizer.json of transformers' strings)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tiktoken = gpt2_tokenizer()
    char = bytes_to_unicode()
    strings = {"".join(char[b] for b in tiktoken.token_bytes(t)): t for t in range(50256)}
    hf = Tokenizer(models.BPE(strings, []))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    names, hf_names = TokenNames(tiktoken), TokenNames(HFTokenizer(hf, 50256))
    assert [names.name(t) for t in range(50257)] == [hf_names.name(t) for t in range(50257)]
    assert [names.name(t) for t in (262, 50256)] == [" the", "<|endoftext|>"]
    assert hf.id_to_token(262) == "Ġthe" and names.name(447) == "bytes:\\xe2\\x80"
