"""What detokenizing costs per token as a request's output grows: before (the whole output decoded
again after every token) and after (``orca_lab.engine.detokenizer.Detokenizer``, a window of a few
tokens per token), side by side in one run.

    python benchmarks/detokenization.py [--lengths 64 1024 4096] [--repeats 7] [--min-tokens 8192]
                                        [--out docs/results/detokenization_cpu.json]

One request with stop strings, streamed: per token, the engine checks its stop strings and the
endpoint makes the text the client is shown. Before, each was a full decode of the output so far
(``Request._stop_reason`` and ``visible_text`` as of commit 498df67, reproduced below); after, each
side feeds the token to its own ``Detokenizer``. Token streams: English text (this repository's
docs) through the ``tiny`` preset's byte tokenizer and GPT-2's BPE (tiktoken). One measurement streams
a request of that length again and again until ``--min-tokens`` tokens have passed (so a short
stream is timed over as long as a long one); every length and both ways take turns, ``--repeats``
rounds, and the time per token is the median of its rounds (a shared host's load moves between
rounds, not between the figures compared). The goal: at most 1.5x at 4k tokens of the time at 64.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from orca_lab.config import check_range, parsed_args
from orca_lab.engine.detokenizer import Detokenizer
from orca_lab.results import write_report
from orca_lab.tokenizer import ByteTokenizer, gpt2_tokenizer

ROOT = Path(__file__).resolve().parents[1]
STOP = ("\n\n## Never", "<|stop|>")      # never in the text: every token is checked to the end


def text_tokens(tok, n: int) -> list[int]:
    """The first ``n`` tokens of this repository's docs (repeated if they are too short)."""
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tok.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def before(decode, ids: list[int]) -> str:
    """Per token: the engine's stop check and the endpoint's visible text, each a full decode."""
    shown = ""
    for k in range(1, len(ids) + 1):
        out = ids[:k]
        text = decode(out)                                    # Request._stop_reason
        if any(text.find(s) >= 0 for s in STOP):
            break
        text = decode(out).rstrip("\ufffd")                   # visible_text, while running
        shown += text[len(shown):max(0, len(text) - (max(map(len, STOP)) - 1))]
    return shown


def after(decode, ids: list[int]) -> str:
    """Per token: the engine's detokenizer checks the stop strings, the endpoint's makes the text."""
    engine, endpoint, shown = Detokenizer(decode, STOP), Detokenizer(decode, STOP), []
    for t in ids:
        if engine.add(t) is not None:
            break
        shown.append(endpoint.update([t]))
    return "".join(shown) + endpoint.take(final=True)


def per_token_us(fn, decode, ids, min_tokens: int) -> float:
    """Microseconds per token over whole streams of ``ids``, at least ``min_tokens`` of them."""
    runs = -(-min_tokens // len(ids))
    t0 = time.perf_counter()
    for _ in range(runs):
        fn(decode, ids)
    return (time.perf_counter() - t0) / (runs * len(ids)) * 1e6


def check_args(args):
    """Every number where it enters (an empty length divides by zero, no round has no median): out of
    range, a ValueError names the flag, its value and the allowed range (check_range's words): exit 2
    (``parsed_args``)."""
    for n in args.lengths:
        check_range("--lengths", n, 1)
    check_range("--repeats", args.repeats, 1)
    check_range("--min-tokens", args.min_tokens, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 4096])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-tokens", type=int, default=8192, help="tokens per measurement")
    p.add_argument("--out", default="docs/results/detokenization_cpu.json")
    args = parsed_args(p, argv, check_args)
    tokenizers = {"bytes (tiny)": ByteTokenizer(), "gpt2 BPE (tiktoken)": gpt2_tokenizer()}
    cases = {(name, n): text_tokens(tok, n) for name, tok in tokenizers.items() for n in args.lengths}
    for (name, _), ids in cases.items():
        text = tokenizers[name].decode(ids)               # what the client has once the request ends
        assert after(tokenizers[name].decode, ids) == text and text.startswith(before(tokenizers[name].decode, ids))
    ways = {"before_us_per_token": before, "after_us_per_token": after}
    times = {(case, way): [] for case in cases for way in ways}
    for _ in range(args.repeats):                          # rounds: every case and way takes its turn
        for (name, n), ids in cases.items():
            for way, fn in ways.items():
                times[(name, n), way].append(per_token_us(fn, tokenizers[name].decode, ids, args.min_tokens))
    rows = [{"tokenizer": name, "tokens": n, **{way: statistics.median(times[(name, n), way]) for way in ways}}
            for name, n in cases]
    print(f"{'tokenizer':<22}{'tokens':>8}{'before us/token':>17}{'after us/token':>16}")
    for r in rows:
        print(f"{r['tokenizer']:<22}{r['tokens']:>8}{r['before_us_per_token']:>17.2f}{r['after_us_per_token']:>16.2f}")
    growth = {}
    for name in tokenizers:
        mine = {r["tokens"]: r for r in rows if r["tokenizer"] == name}
        lo, hi = min(mine), max(mine)
        growth[name] = {k: mine[hi][k] / mine[lo][k] for k in ("before_us_per_token", "after_us_per_token")}
        print(f"{name}: per-token time at {hi} over {lo} tokens: before {growth[name]['before_us_per_token']:.2f}x, "
              f"after {growth[name]['after_us_per_token']:.2f}x (goal <= 1.5x)")
    write_report(args.out, args, {"stop": STOP, "rows": rows, "growth_longest_over_shortest": growth})


if __name__ == "__main__":
    main()
