"""A byte-level tokenizer for the ``tiny`` preset: ids 0-255 are bytes, 256 is EOS. Nothing to download."""


class ByteTokenizer:
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
