"""Tokenizers. Any object with ``encode(text) -> list[int]`` and ``decode(ids) -> str`` works; an
``eos_token_id`` attribute, when it has one, is the EOS a request stops at; ``token_name(id)`` and
``token_bytes(id)``, when it has them, name a token in answers (``token_name`` below). Nothing is
downloaded:

- ``ByteTokenizer``: the ``tiny`` preset's vocabulary, ids 0-255 are bytes and 256 is EOS.
- ``gpt2_tokenizer()``: GPT-2's byte-level BPE through ``tiktoken``, from a local ranks file. The
  ``openai-whisper`` package ships GPT-2's ranks as ``whisper/assets/gpt2.tiktoken``
  (``pip install tiktoken`` and ``pip install --no-deps openai-whisper``; whisper itself is never imported).
- ``load_tokenizer(path)``: a Hugging Face tokenizer saved next to a checkpoint (``tokenizer.json``,
  or GPT-2's ``vocab.json`` + ``merges.txt``), read with ``tokenizers`` (which ``transformers`` installs).
"""
from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

GPT2_VOCAB_SIZE, GPT2_EOS = 50257, 50256
# GPT-2's pre-tokenizer split, as tiktoken writes it (r50k_base): contractions, letters, digits,
# punctuation, each with an optional leading space, then whitespace runs.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_RANKS_ENV = "ORCA_LAB_GPT2_RANKS"


def token_name(tokenizer, token: int) -> str:
    """The one name of ``token`` wherever an answer names a token (completions' ``tokens`` and
    ``top_logprobs`` keys, the chat's ``token``, ``prompt_logprobs``' ``decoded_token``, /tokenize's
    ``token_strs``): the tokenizer's own ``token_name``, made from its own token strings, so that
    distinct ids have distinct names (``top_logprobs`` with k ids has k keys). A tokenizer with
    encode/decode only: the token's decoded text, unless empty or a piece of a character. A token
    without a name: vLLM's ``token_id:<id>``."""
    own = getattr(tokenizer, "token_name", None)
    if own is not None:
        name = own(token)
    else:
        name = tokenizer.decode([token])
        name = None if "\ufffd" in name else name
    return name or f"token_id:{token}"


def bytes_name(raw: bytes) -> str:
    """A token of these bytes as OpenAI names it: its text when they are whole UTF-8, else
    ``bytes:\\xNN...`` (a piece of a character, whose text U+FFFD many tokens share)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return escaped_bytes(raw)


def escaped_bytes(raw: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class ByteTokenizer:
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (a piece of a character too, whose text is U+FFFD)."""
        return bytes([token]) if token < 256 else b""

    def token_name(self, token: int) -> str | None:
        """An ASCII byte is its character, any other byte ``bytes:\\xNN``; EOS has no name."""
        return bytes_name(bytes([token])) if token < 256 else None


class TiktokenTokenizer:
    """A ``tiktoken.Encoding`` behind the encode/decode interface. Special tokens written in the text
    (``<|endoftext|>``) encode as themselves, as Hugging Face's GPT-2 tokenizer does."""

    def __init__(self, encoding, eos_token_id: int):
        self.encoding, self.eos_token_id = encoding, eos_token_id
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))       # an incomplete character decodes to U+FFFD

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token)

    def token_name(self, token: int) -> str:
        """Its bytes as OpenAI names them (`` the``, ``bytes:\\xe2\\x80``): every token has bytes of its own."""
        return bytes_name(self.token_bytes(token))


def gpt2_ranks_path() -> Path | None:
    """GPT-2's BPE ranks on this machine: ``$ORCA_LAB_GPT2_RANKS``, else the openai-whisper package's
    asset (found without importing whisper, which would import numba)."""
    if os.environ.get(GPT2_RANKS_ENV):
        return Path(os.environ[GPT2_RANKS_ENV])
    spec = importlib.util.find_spec("whisper")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "assets" / "gpt2.tiktoken"
        if path.is_file():
            return path
    return None


def gpt2_tokenizer(path: str | os.PathLike | None = None) -> TiktokenTokenizer:
    """GPT-2's tokenizer (50257 ids, EOS ``<|endoftext|>`` = 50256) from a local ranks file."""
    if importlib.util.find_spec("tiktoken") is None:
        raise RuntimeError("GPT-2's tokenizer needs tiktoken: pip install tiktoken")
    path = Path(path) if path is not None else gpt2_ranks_path()
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"GPT-2's BPE ranks not found{f' at {path}' if path else ''}: `pip install --no-deps "
            f"openai-whisper` ships them (whisper/assets/gpt2.tiktoken), or set {GPT2_RANKS_ENV} to a "
            "ranks file (one 'base64-token rank' per line)")
    return _gpt2_from(path.resolve())


@functools.lru_cache(maxsize=4)
def _gpt2_from(path: Path) -> TiktokenTokenizer:
    import tiktoken
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != GPT2_EOS:
        raise ValueError(f"{path} holds {len(ranks)} BPE ranks: GPT-2 has {GPT2_EOS} (plus EOS)")
    encoding = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": GPT2_EOS})
    return TiktokenTokenizer(encoding, GPT2_EOS)


def save_gpt2_hf(directory, ranks: str | os.PathLike | None = None) -> Path:
    """GPT-2's tokenizer written in the Hugging Face layout (``tokenizer.json`` and
    ``tokenizer_config.json``) from the local ranks file, for a client that loads its tokenizer with
    ``transformers.AutoTokenizer`` (lm-evaluation-harness's ``tokenizer=`` argument): nothing is
    downloaded. It encodes as ``gpt2_tokenizer()`` does. Needs ``transformers``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    path = Path(ranks) if ranks is not None else gpt2_ranks_path()
    gpt2_tokenizer(path)                               # the same checks, the same errors
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    converted = TikTokenConverter(vocab_file=str(path), pattern=GPT2_PATTERN,
                                  extra_special_tokens={"<|endoftext|>": GPT2_EOS}).converted()
    converted.save(str(directory / "tokenizer.json"))
    eos = "<|endoftext|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos, "unk_token": eos,
         "model_max_length": 1024}))
    return directory


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the encode/decode interface; ``chat_template``: the Jinja
    template of its ``tokenizer_config.json``, if it has one (``/v1/chat/completions`` renders it).

    A token's name is its own string in the vocabulary (transformers' ``convert_ids_to_tokens``),
    turned into what it stands for only where that is one to one, so names are as distinct as the
    vocabulary's strings: a byte-fallback piece ``<0xNN>`` is ``bytes:\\xNN`` (never its character:
    ``<0x61>`` and ``a`` are two tokens); a byte-level BPE string (GPT-2, Llama 3, Qwen2: ``Ġthe``) is
    named by its bytes as ``bytes_name`` names them (`` the``, as tiktoken's GPT-2 and OpenAI name
    it); any other string is itself: SentencePiece's ``▁the`` keeps its ``▁`` (its decoded text,
    ``the``, is also the piece ``the``'s; made a space, ``▁`` could meet a piece holding one)."""

    def __init__(self, tokenizer, eos_token_id: int | None, chat_template: str | None = None):
        self.tokenizer, self.eos_token_id, self.chat_template = tokenizer, eos_token_id, chat_template
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token = tokenizer.id_to_token(eos_token_id) if eos_token_id is not None else None
        self._byte_level, self._byte_fallback, self._space = _decoding_of(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def token_name(self, token: int) -> str | None:
        piece, raw, fallback = self._piece(token)
        if raw is None:
            return piece
        return escaped_bytes(raw) if fallback else bytes_name(raw)

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes the token stands for (the chat's logprobs ``bytes``), a space for ``▁``."""
        piece, raw, _ = self._piece(token)
        if raw is not None or piece is None:
            return raw
        return (piece.replace(self._space, " ") if self._space else piece).encode("utf-8")

    def _piece(self, token: int) -> tuple[str | None, bytes | None, bool]:
        """The token's string in the vocabulary (None: no such id); the bytes it stands for where the
        decoder maps strings to bytes one to one (a byte-fallback piece, a byte-level BPE string; an
        added token, ``<|im_start|>``, is not one), else None; whether it is a byte-fallback piece."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return None, None, False
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece) if self._byte_fallback else None
        if m:
            return piece, bytes([int(m[1], 16)]), True
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return piece, bytes(_BYTE_OF_CHAR[c] for c in piece), False
        return piece, None, False


def _decoding_of(tokenizer) -> tuple[bool, bool, str | None]:
    """What its decoder makes of a token's string: byte-level BPE's bytes, byte-fallback pieces'
    bytes, and the character that stands for a space (SentencePiece's ``▁``), if any."""
    state = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
    steps = [state, *state.get("decoders", [])]
    kinds = {d.get("type") for d in steps}
    space = next((d["replacement"] if d["type"] == "Metaspace" else d.get("pattern", {}).get("String") for d in steps
                  if d.get("type") == "Metaspace" or (d.get("type") == "Replace" and d.get("content") == " ")), None)
    return "ByteLevel" in kinds, "ByteFallback" in kinds, space


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (its ``bytes_to_unicode``): each byte a printable character,
    itself when it is one, else the next free one from U+0100."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(0x100, 0x200))
    return {chr(b if b in printable else next(extra)): b for b in range(256)}


_BYTE_OF_CHAR = _byte_level_alphabet()


def load_tokenizer(path) -> HFTokenizer | None:
    """The Hugging Face tokenizer saved in directory ``path``, or None if there is none."""
    path = Path(path)
    files = {f for f in ("tokenizer.json", "vocab.json", "merges.txt") if (path / f).is_file()}
    if "tokenizer.json" not in files and not {"vocab.json", "merges.txt"} <= files:
        return None
    if importlib.util.find_spec("tokenizers") is None:
        warnings.warn(f"{path} holds a tokenizer, but reading it needs `tokenizers` (pip install tokenizers): "
                      "the model takes token ids only", stacklevel=3)
        return None
    import tokenizers
    if "tokenizer.json" in files:
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        tok = tokenizers.ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    return HFTokenizer(tok, _eos_of(path, tok), _chat_template_of(path))


def _chat_template_of(path: Path) -> str | None:
    """``chat_template`` of tokenizer_config.json (a string, or the "default" of a list of named ones),
    else a ``chat_template.jinja`` file beside it (newer transformers save it there)."""
    f = path / "tokenizer_config.json"
    value = json.loads(f.read_text()).get("chat_template") if f.is_file() else None
    if isinstance(value, list):
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    if value is None and (path / "chat_template.jinja").is_file():
        value = (path / "chat_template.jinja").read_text()
    return value if isinstance(value, str) else None


def _eos_of(path: Path, tok) -> int | None:
    """``eos_token`` of tokenizer_config.json, else ``eos_token_id`` of the model's config.json."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        f = path / name
        value = json.loads(f.read_text()).get(key) if f.is_file() else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            value = tok.token_to_id(value)
        if isinstance(value, int):
            return value
    return None


def default_tokenizer(vocab_size: int):
    """The tokenizer a model of this vocabulary gets when none is given: bytes for ``tiny``, GPT-2's
    BPE for a 50257-id vocabulary when its ranks are on this machine; else None (token ids only)."""
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    if vocab_size == GPT2_VOCAB_SIZE:
        try:
            return gpt2_tokenizer()
        except (RuntimeError, FileNotFoundError):
            return None
    return None
