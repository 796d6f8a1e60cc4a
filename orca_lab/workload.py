"""Request traces: the paper's synthetic workload, homogeneous traces, traces shaped like real
workloads (``real_trace``: lengths from published statistics), and their files (ORCA §6).

The paper draws input lengths from U{32..512} and max_gen_tokens from U{1..128}, never stops early
(no EOS), and sends requests as a Poisson process whose rate is swept. ``scale`` shrinks the lengths
for small machines while keeping their shape.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from orca_lab.config import check_range
from orca_lab.engine.fields import check_arrival
from orca_lab.engine.sampling_params import SamplingParams

MAX_TRACE_REQUESTS = 10_000_000     # requests a trace may hold
SCALE_RANGE = (1e-3, 1000.0)        # what a trace's lengths may be multiplied by


@dataclass(frozen=True)
class TraceItem:
    arrival: float            # seconds after the start of the run
    prompt: tuple[int, ...]
    max_gen_tokens: int

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_gen_tokens=self.max_gen_tokens)

    @property
    def max_tokens(self) -> int:
        return len(self.prompt) + self.max_gen_tokens


def check_rate(rate, name: str = "rate", offline: str = "None"):
    """``rate`` if it is a finite number of requests/s > 0, or None (an offline trace, which the
    caller's users write ``offline``: a command line's ``inf``)."""
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate)
                             or rate <= 0):
        raise ValueError(f"{name}={rate!r} is not allowed: a finite number of requests/s > 0, "
                         f"or {offline} for an offline trace")
    return rate


def arrivals(n: int, rate: float | None, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Arrival times of ``n`` requests at ``rate`` req/s; None = offline (all at time 0).
    ``cv`` is the inter-arrival coefficient of variation: 1 is Poisson, above 1 is bursty (gamma)."""
    if check_rate(rate) is None:
        return np.zeros(n)
    check_range("cv", cv, 1e-3, 100.0, kind=float)
    shape = 1.0 / cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    return np.cumsum(gaps) - gaps[0]


def paper_trace(n: int, rate: float | None = None, seed: int = 0, input_range=(32, 512),
                gen_range=(1, 128), scale: float = 1.0, vocab_size: int = 50257,
                cv: float = 1.0) -> list[TraceItem]:
    """The paper's workload: input ~ U{input_range}, max_gen_tokens ~ U{gen_range}, lengths
    multiplied by ``scale``."""
    check_range("n", n, 1, MAX_TRACE_REQUESTS)
    check_range("scale", scale, *SCALE_RANGE, kind=float)
    lo_in, hi_in = (_scaled(x, scale) for x in input_range)
    lo_gen, hi_gen = (_scaled(x, scale) for x in gen_range)
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(lo_in, hi_in + 1, size=n)
    gen_lens = rng.integers(lo_gen, hi_gen + 1, size=n)
    return _items(rng, arrivals(n, rate, rng, cv), in_lens, gen_lens, vocab_size)


@dataclass(frozen=True)
class LengthShape:
    """Lognormal prompt and output lengths (tokens) shaped like a real trace. ``sigma`` is the
    log-space spread; the median is ``exp(mu)``. The medians are the published ones (ShareGPT: read
    off the paper's histogram); each sigma is fitted to the data by maximum likelihood with the median
    held. A lognormal is a rough shape here (the Azure conversation outputs are bimodal, the coding
    prompts capped near 7.4K tokens): see the comments for where its mean departs from the data's."""
    name: str
    in_median: float
    out_median: float
    in_sigma: float
    out_sigma: float
    source: str


REAL_SHAPES: dict[str, LengthShape] = {
    # vLLM (Kwon et al., SOSP'23, arXiv 2309.06180), §6.1: "the ShareGPT dataset has 8.4x longer input
    # prompts and 5.8x longer outputs on average than the Alpaca dataset, with higher variance"; Fig. 11a
    # legend: input mean 161.31, output mean 337.99 tokens (Alpaca 19.31, 58.45). The medians and spreads
    # are not printed: they come from Fig. 11a's bars (the arXiv HTML's sharegpt_hist.svg, 128 bins up to
    # ~2030 tokens, whose means come out 161.4 and 338.0): medians 36 and 271 tokens; sigma by
    # maximum likelihood on the binned, range-truncated lognormal. Clipped at 2048 tokens this lognormal
    # has means 172 (input) and 484 (output): the real outputs' tail is shorter than a lognormal's.
    "sharegpt": LengthShape("sharegpt", 36, 271, 1.95, 1.23,
                            "vLLM (SOSP'23) Fig. 11a, ShareGPT: medians 36 / 271 read off the histogram "
                            "(printed means 161.31 / 337.99)"),
    # Splitwise (Patel et al., ISCA'24, arXiv 2311.18677), §III-A, on the Azure LLM inference trace 2023:
    # coding "median prompt size of 1500 tokens", "median number of output token is 13"; conversation
    # "median number of prompt tokens ... 1020", "a median of 129 tokens generated". Spreads fitted to
    # the released sample (github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_{conv,code}.csv,
    # ContextTokens / GeneratedTokens): sigma = sqrt(mean((ln x - ln median)^2)). That sample's medians are
    # 1020 / 129 (conversation, 19,366 requests) and 1469 / 13 (coding, 8,819 requests); its means are
    # 1155 / 211 and 2048 / 28, against the lognormals' 1734 / 188 and 3997 / 19 before clipping.
    "azure-conv": LengthShape("azure-conv", 1020, 129, 1.03, 0.87,
                              "Splitwise (ISCA'24) §III-A, Azure conversation trace: median prompt 1020, output 129"),
    "azure-code": LengthShape("azure-code", 1500, 13, 1.40, 0.88,
                              "Splitwise (ISCA'24) §III-A, Azure coding trace: median prompt 1500, output 13"),
}


def real_trace(shape: str, n: int, rate: float | None = None, seed: int = 0, scale: float = 1.0,
               max_len: int = 2048, vocab_size: int = 50257, cv: float = 1.0) -> list[TraceItem]:
    """Lengths drawn from ``REAL_SHAPES[shape]`` (multiplied by ``scale``); a prompt longer than
    ``max_len`` (the model's context) less its max_gen_tokens is cut to fit; arrivals Poisson, or gamma with ``cv`` > 1 (bursty).
    As in the paper's workload, every request generates exactly its max_gen_tokens."""
    from orca_lab.config import check_choice
    check_choice("shape", shape, tuple(REAL_SHAPES))
    check_range("n", n, 1, MAX_TRACE_REQUESTS)
    check_range("scale", scale, *SCALE_RANGE, kind=float)
    check_range("max_len", max_len, 2, 1 << 20)
    s = REAL_SHAPES[shape]
    rng = np.random.default_rng(seed)
    draw = lambda median, sigma: np.maximum(1, np.round(scale * median * rng.lognormal(0.0, sigma, n))).astype(int)
    in_lens, gen_lens = draw(s.in_median, s.in_sigma), np.minimum(draw(s.out_median, s.out_sigma), max_len - 1)
    in_lens = np.minimum(in_lens, max_len - gen_lens)     # the context truncated to fit, as a front-end does
    return _items(rng, arrivals(n, rate, rng, cv), in_lens, gen_lens, vocab_size)


def homogeneous_trace(n: int, input_len: int, gen_len: int, rate: float | None = None, seed: int = 0,
                      vocab_size: int = 50257, cv: float = 1.0) -> list[TraceItem]:
    """Every request with the same input length and max_gen_tokens (the paper's Figure 11)."""
    check_range("n", n, 1, MAX_TRACE_REQUESTS)
    check_range("input_len", input_len, 1, 1 << 20)
    check_range("gen_len", gen_len, 1, 1 << 20)
    rng = np.random.default_rng(seed)
    return _items(rng, arrivals(n, rate, rng, cv), np.full(n, input_len), np.full(n, gen_len), vocab_size)


# -- traces that share prefixes (prefix caching, engine/prefix_cache.py) --------------------------
# ShareGPT as tabulated by ShareChat (Yan et al., arXiv 2512.17843, Table 1): 94,145 conversations,
# 330,239 turns, 3.51 turns per conversation on average.
SHAREGPT_MEAN_TURNS = 3.51


def few_shot_trace(n: int, prefix_len: int = 512, question_len=(16, 64), gen_len=(8, 32),
                   rate: float | None = None, seed: int = 0, vocab_size: int = 50257,
                   cv: float = 1.0) -> list[TraceItem]:
    """Every request is one shared prefix (the same few-shot examples or system prompt) followed by
    its own question, lengths ~ U{question_len}, max_gen_tokens ~ U{gen_len}. The defaults are
    assumptions chosen to make the prefix dominate the prompt, not measurements."""
    check_range("n", n, 1, MAX_TRACE_REQUESTS)
    check_range("prefix_len", prefix_len, 0, 1 << 20)
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    q = rng.integers(question_len[0], question_len[1] + 1, size=n)
    g = rng.integers(gen_len[0], gen_len[1] + 1, size=n)
    times = arrivals(n, rate, rng, cv)
    return [TraceItem(float(t), tuple(prefix + rng.integers(0, vocab_size, size=int(L)).tolist()), int(m))
            for t, L, m in zip(times, q, g)]


@dataclass(frozen=True)
class Conversation:
    """A chat: it starts at ``start``; turn ``k`` sends ``users[k]`` after the history (the system
    prompt, then every earlier user message and answer) and asks for ``answer_lens[k]`` tokens; the
    user writes the next turn ``gaps[k]`` seconds after receiving that answer."""
    start: float
    system: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]
    answer_lens: tuple[int, ...]
    gaps: tuple[float, ...]


def multi_turn_conversations(n: int, rate: float | None = None, mean_turns: float = SHAREGPT_MEAN_TURNS,
                             max_turns: int = 8, scale: float = 1.0, think_s: float = 1.0, system_len: int = 0,
                             seed: int = 0, vocab_size: int = 50257, max_len: int = 2048) -> list[Conversation]:
    """Chats whose every turn re-sends the whole history (after a shared system prompt of
    ``system_len`` tokens). Turns per chat: geometric with mean ``mean_turns`` (3.51, ShareGPT's mean
    as tabulated by ShareChat, arXiv 2512.17843, Table 1; the geometric shape is an assumption), at
    most ``max_turns`` and while the history fits ``max_len``. User messages and answers: lognormal
    lengths of ``REAL_SHAPES["sharegpt"]`` (medians 36 and 271 tokens, vLLM's Fig. 11a) times
    ``scale``, an answer at most a quarter of ``max_len``. Chats start at ``rate`` (Poisson; None:
    all at 0); the user thinks ``think_s`` seconds (exponential mean) before each next turn."""
    check_range("n", n, 1, 1_000_000)
    check_range("mean_turns", mean_turns, 1.0, 1000.0, kind=float)
    check_range("max_turns", max_turns, 1, 1000)
    check_range("scale", scale, *SCALE_RANGE, kind=float)
    check_range("think_s", think_s, 0.0, 1e6, kind=float)
    check_range("system_len", system_len, 0, max_len - 2)
    shape, rng = REAL_SHAPES["sharegpt"], np.random.default_rng(seed)
    length = lambda median, sigma: max(1, int(round(scale * median * rng.lognormal(0.0, sigma))))
    tokens = lambda k: tuple(rng.integers(0, vocab_size, size=k).tolist())
    system, chats = tokens(system_len), []
    for start in arrivals(n, rate, rng):
        users, answers, used = [], [], system_len
        for _ in range(min(max_turns, int(rng.geometric(1.0 / mean_turns)))):
            user, answer = length(shape.in_median, shape.in_sigma), min(length(shape.out_median, shape.out_sigma),
                                                                        max_len // 4)
            if used + user + answer > max_len:
                break
            users.append(tokens(user))
            answers.append(answer)
            used += user + answer
        gaps = tuple(float(rng.exponential(think_s)) if think_s else 0.0 for _ in users)
        if users:
            chats.append(Conversation(float(start), system, tuple(users), tuple(answers), gaps))
    return chats


def multi_turn_trace(n_conversations: int, rate: float | None = None, seed: int = 0, vocab_size: int = 50257,
                     **shape) -> list[TraceItem]:
    """``multi_turn_conversations`` as an open-loop trace: turn ``k`` arrives ``gaps[k - 1]`` after
    turn ``k - 1``, and the answer written into its history is the trace's own tokens (as replaying a
    recorded conversation does), so a cache finds the previous turn's prompt, not its answer (a closed
    loop that re-sends the engine's own answers, ``benchmarks/prefix_caching.py``, finds both). Every
    request generates exactly its max_gen_tokens."""
    rng = np.random.default_rng([seed, 1])
    items = []
    for c in multi_turn_conversations(n_conversations, rate, seed=seed, vocab_size=vocab_size, **shape):
        history, t = list(c.system), c.start
        for user, answer, gap in zip(c.users, c.answer_lens, c.gaps):
            history += user
            items.append(TraceItem(t, tuple(history), answer))
            history += rng.integers(0, vocab_size, size=answer).tolist()
            t += gap
    return sorted(items, key=lambda it: it.arrival)


def serve_conversations(engine, chats: list[Conversation]):
    """Serve ``chats`` in a closed loop on ``engine`` (real or simulated, ``Engine``): each turn is sent
    once the previous answer has come back and the user has thought, and re-sends the history with
    the engine's own answers, as a chat client does. Returns the engine's ``RunResult``, times from
    the start. A turn due while an iteration runs is sent when it returns, stamped with its due time."""
    import heapq
    t0 = engine.clock.now()
    due = [(t0 + c.start, i) for i, c in enumerate(chats)]
    heapq.heapify(due)
    turn, history, of = [0] * len(chats), [list(c.system) for c in chats], {}
    while due or engine.has_work():
        now = engine.clock.now()
        while due and due[0][0] <= now:
            t, i = heapq.heappop(due)
            c, k = chats[i], turn[i]
            history[i] += c.users[k]
            req = engine.add_request(history[i], SamplingParams(max_gen_tokens=c.answer_lens[k]), arrival=t)
            of[req.rid] = i
        if not engine.has_work():
            engine.clock.sleep_until(due[0][0])
            continue
        for req, _ in engine.step(timeout=max(0.0, due[0][0] - now) if due else None):
            if req.finished:
                i = of.pop(req.rid)
                history[i] += req.output
                turn[i] += 1
                if turn[i] < len(chats[i].users):
                    heapq.heappush(due, (engine.clock.now() + chats[i].gaps[turn[i] - 1], i))
    return engine.result(t0)


def mooncake_trace(records, block_size: int = 512, vocab_size: int = 50257, seed: int = 0) -> list[TraceItem]:
    """A trace in Mooncake's released format (kvcache-ai/Mooncake, FAST'25: one JSON object per
    request, ``timestamp`` in ms, ``input_length``, ``output_length``, and ``hash_ids``, one id per
    block of 512 tokens, equal ids meaning equal blocks) as token prompts: every hash id becomes the
    same ``block_size`` random tokens wherever it appears, so the prefixes the trace shares are shared
    here too. ``records``: dicts, or a path to the JSONL file."""
    if isinstance(records, (str, Path)):
        records = [json.loads(line) for line in Path(records).read_text().splitlines() if line.strip()]
    blocks: dict[int, list[int]] = {}
    block = lambda h: blocks.setdefault(h, np.random.default_rng([seed, h]).integers(0, vocab_size, block_size).tolist())
    items = []
    for r in records:
        prompt = [t for h in r["hash_ids"] for t in block(int(h))][:int(r["input_length"])]
        prompt += np.random.default_rng([seed, len(items), 1 << 30]).integers(
            0, vocab_size, int(r["input_length"]) - len(prompt)).tolist()     # past the last listed block
        items.append(TraceItem(float(r["timestamp"]) / 1e3, tuple(prompt), max(1, int(r["output_length"]))))
    return sorted(items, key=lambda it: it.arrival)


def mooncake_reuse(records, block_size: int = 512) -> dict:
    """What a Mooncake trace (``mooncake_trace``'s format) offers a cache that never evicts, read off
    its ``hash_ids`` alone: per request, the leading blocks an earlier request already listed (short
    of its last token), in tokens, over all input tokens; with the trace's size and mean lengths.

    Measured on kvcache-ai/Mooncake at commit 3b5a594 (FAST25-release/traces; block 512): the
    conversation trace, 12,031 requests of mean input 12,035 and output 343 tokens, offers 0.373 of
    its input tokens; the synthetic one, 3,993 requests of 15,325 and 149, offers 0.650 (its README
    gives the same counts and means)."""
    if isinstance(records, (str, Path)):
        records = [json.loads(line) for line in Path(records).read_text().splitlines() if line.strip()]
    seen, hit, total = set(), 0, 0
    for r in sorted(records, key=lambda r: r["timestamp"]):
        n = 0
        while n < len(r["hash_ids"]) and r["hash_ids"][n] in seen and (n + 1) * block_size <= r["input_length"] - 1:
            n += 1
        hit, total = hit + n * block_size, total + r["input_length"]
        seen.update(r["hash_ids"])
    k = max(len(records), 1)
    return {"n_requests": len(records), "mean_input_len": total / k,
            "mean_output_len": sum(r["output_length"] for r in records) / k,
            "reuse": hit / total if total else 0.0}


def prefix_reuse(trace, block_size: int = 16) -> float:
    """The share of prompt tokens in full blocks that an earlier request's prompt already held: the
    hit rate of a cache that never evicts (each prompt's last token excluded, as the engine always
    computes it). What a trace offers; ``requests_df()["prefix_hit_tokens"]`` is what a run got."""
    seen, hit, total = set(), 0, 0
    for it in sorted(trace, key=lambda it: it.arrival):
        p, parent = list(it.prompt), None
        total += len(p)
        found = True
        for i in range((len(p) - 1) // block_size):
            parent = hash((0 if parent is None else parent, tuple(p[i * block_size:(i + 1) * block_size])))
            found = found and parent in seen
            hit += block_size * found
            seen.add(parent)
    return hit / total if total else 0.0


def _scaled(x: int, scale: float) -> int:
    return max(1, int(round(x * scale)))


def _items(rng, times, in_lens, gen_lens, vocab_size) -> list[TraceItem]:
    check_range("vocab_size", vocab_size, 2, 1 << 24)
    return [TraceItem(float(t), tuple(rng.integers(0, vocab_size, size=int(L)).tolist()), int(g))
            for t, L, g in zip(times, in_lens, gen_lens)]


def warm_up_traces(max_bs: int, max_seq_len: int, n_slots: int, vocab_size: int,
                   graph_sizes=(), longest: int | None = None) -> tuple[list[list[TraceItem]], list[list[TraceItem]]]:
    """The shapes an engine meets, each in a short trace served before any timed run: a batch of up to
    4 prompts of 16, 64, 256, 1,024... tokens and of the longest the model takes, or ``longest``
    when the runs to come are known to be shorter (as far as the K/V pool allows), then one-token
    steps at each of ``graph_sizes`` up to ``max_bs`` (the batch sizes CUDA graphs are captured at):
    ``(prompt traces, one-token-step traces)``. The prompts are random, so a prefix cache skips none
    of them."""
    rng = np.random.default_rng(0)
    top = min(vocab_size, 1 << 15)

    def batch(b: int, length: int, gen: int) -> list[TraceItem]:
        return [TraceItem(0.0, tuple(int(t) for t in rng.integers(1, top, length)), gen) for _ in range(b)]

    b = min(4, max_bs)
    top_len = max_seq_len - 2 if longest is None else max(1, min(longest, max_seq_len - 2))
    lens = [n for n in (16, 64, 256, 1024, 4096, 16384, top_len) if 0 < n <= top_len]
    lens = sorted({n for n in lens if b * (n + 2) <= n_slots})
    sizes = sorted({min(s, max_bs) for s in graph_sizes})       # a batch of max_bs takes the graph above it
    return [batch(b, n, 2) for n in lens], [batch(s, 4, 3) for s in sizes if s * 7 <= n_slots]


def save_trace(items, path):
    """One JSON object per line: ``{"arrival": s, "prompt": [ids], "max_gen_tokens": n}``."""
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps({**asdict(it), "prompt": list(it.prompt)}) + "\n")


def load_trace(path) -> list[TraceItem]:
    """Read a trace file, refusing a malformed line with its number and the field at fault."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(_parse_item(json.loads(line)))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{n}: malformed trace line: {e}") from None
    if not items:
        raise ValueError(f"{path}: the trace holds no request")
    return items


def _parse_item(obj) -> TraceItem:
    if not isinstance(obj, dict):
        raise TypeError("each line must be a JSON object with arrival, prompt, max_gen_tokens")
    arrival = check_arrival(obj["arrival"])
    prompt = obj["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        raise ValueError("prompt must be a non-empty list of token ids >= 0")
    check_range("max_gen_tokens", obj["max_gen_tokens"], 1, 1 << 20)
    return TraceItem(arrival, tuple(prompt), obj["max_gen_tokens"])
