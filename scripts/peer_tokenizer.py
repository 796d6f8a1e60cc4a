"""Write a Hugging Face tokenizer directory that counts as the ``tiny`` preset's ByteTokenizer does:
one token per UTF-8 byte, id = byte value, EOS 256. Peer load generators (GuideLLM, AIPerf) need a
tokenizer to size their prompts; with this one, offline, an N-token prompt is N tokens on the server.

    python scripts/peer_tokenizer.py /tmp/byte_tok
    HF_HUB_OFFLINE=1 python -c "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('/tmp/byte_tok')"
"""
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet), by byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:                      # unprintable bytes move past 255, in order
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def byte_tokenizer(eos: str = "<|endoftext|>") -> PreTrainedTokenizerFast:
    vocab = {c: b for b, c in enumerate(byte_chars())} | {eos: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))        # no merges: a token is a byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, model_max_length=1 << 20)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: peer_tokenizer.py OUT_DIR")
    tok = byte_tokenizer()
    text = "héllo, wörld\n\t"
    assert tok.encode(text) == list(text.encode("utf-8")), "not one token per UTF-8 byte"
    tok.save_pretrained(sys.argv[1])
    print(f"wrote {sys.argv[1]} ({len(tok)} tokens)")
