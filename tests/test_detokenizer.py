"""The incremental detokenizer against the plain full decode, on random token streams (hypothesis):
split UTF-8 characters, invalid bytes, EOS (which decodes to nothing), stop strings spanning tokens.

The reference decodes the whole output again after every token, as the engine and the endpoint did
before: what a client may see after k tokens is that text without its incomplete end (U+FFFD) and
without the end that could begin a stop string; a stop string ends the text at the first token whose
text holds it, where it begins; a request that ends otherwise shows its whole text."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from orca_lab.engine.detokenizer import INCOMPLETE, Detokenizer
from orca_lab.tokenizer import ByteTokenizer, gpt2_tokenizer

BYTES = ByteTokenizer()
try:
    GPT2 = gpt2_tokenizer()
except (RuntimeError, FileNotFoundError):
    GPT2 = None
TOKENIZERS = [pytest.param(BYTES, id="bytes"),
              pytest.param(GPT2, id="gpt2", marks=pytest.mark.skipif(GPT2 is None, reason="GPT-2's BPE ranks not installed"))]
TEXT = st.text(st.sampled_from("ab é€😀\n."), max_size=12)     # 1- to 4-byte characters


@st.composite
def streams(draw, tok):
    """Token ids: pieces of encoded text (multi-byte characters whose bytes split across tokens)
    and random ids (invalid bytes, partial characters, EOS), and stop strings: pieces of the whole
    text (so they are hit, spanning tokens) or random."""
    vocab = tok.vocab_size if hasattr(tok, "vocab_size") else 257
    ids = []
    for _ in range(draw(st.integers(1, 6))):
        ids += draw(st.one_of(TEXT.map(tok.encode), st.lists(st.integers(0, vocab - 1), max_size=6)))
    full = tok.decode(ids).replace(INCOMPLETE, "")
    pieces = st.tuples(st.integers(0, len(full)), st.integers(1, 4)).map(lambda p: full[p[0]:p[0] + p[1]])
    stops = draw(st.lists(st.one_of(pieces, TEXT), max_size=3).map(lambda ss: [s for s in ss if s]))
    return ids, tuple(stops)


def held(text: str, stops) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if s.startswith(text[-k:])), default=0)


def reference(decode, ids, stops):
    """(visible text after each token, stop_at, the final text) by full decodes."""
    visible = []
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k]).rstrip(INCOMPLETE)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return visible, min(hits), text[:min(hits)]
        visible.append(text[:len(text) - held(text, stops)])
    return visible, None, decode(ids)


@pytest.mark.parametrize("tok", TOKENIZERS)
def test_incremental_text_equals_the_full_decode(tok):
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(streams(tok))
    def check(case):
        ids, stops = case
        visible, stop_at, final = reference(tok.decode, ids, stops)
        d, shown = Detokenizer(tok.decode, stops), ""
        for k, t in enumerate(ids):
            if d.add(t) is not None:
                break
            shown += d.take()
            assert shown == visible[k], (k, ids[:k + 1])
        assert d.stop_at == stop_at and len(d.ids) == len(visible) + (stop_at is not None)
        shown += d.take(final=True)
        assert shown == d.text == final
        assert d.take(final=True) == ""
    check()


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    d = Detokenizer(BYTES.decode)
    for b in "a€".encode():          # 'a', then the euro sign's three bytes
        d.add(b)
        if b == 0xE2:
            assert d.take() == "a"
    assert d.take() == "€"


def test_the_end_that_could_begin_a_stop_string_is_held_back_then_shown():
    d = Detokenizer(BYTES.decode, ("STOP",))
    shown = "".join(d.update([b]) for b in b"a ST")
    assert shown == "a " and d.update(list(b"ar")) == "STar"      # "STa" begins no stop string
    assert d.update(list(b"xSTOPy")) == "x" and d.stop_at == 7 and d.update([], "stop") == ""


def test_a_stop_token_is_no_text_and_an_abort_shows_what_was_held():
    d = Detokenizer(BYTES.decode, ("END",))
    assert d.update(list(b"okEN")) == "ok"
    assert d.update([256], "stop") == "EN" and d.ids == list(b"okEN")      # stop_at None: a stop token


class CountingDecode:
    """The byte tokenizer's decode, counting the token ids it is given."""

    def __init__(self):
        self.n_ids = 0

    def __call__(self, ids):
        self.n_ids += len(ids)
        return BYTES.decode(ids)


def test_a_request_decodes_each_token_a_bounded_number_of_times():
    """Stop strings are checked after every token, and the text streamed by differences: the tokens
    decoded stay a few per token (it was the whole output again after every token: O(n^2))."""
    from orca_lab.engine.request import Request
    from orca_lab.engine.sampling_params import SamplingParams
    decode, n = CountingDecode(), 2000
    req = Request(0, [1], SamplingParams(max_gen_tokens=n, stop=("\x00never",)), detokenize=decode)
    shown = ""
    for i in range(n):
        req.append(ord("a") + i % 26, now=None)
        assert req.text.startswith(shown)
        shown = req.text
    assert len(shown) == n and req.finish_reason == "length"
    assert decode.n_ids <= 4 * n, decode.n_ids
