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
from orca_lab.engine.request import SamplingParams


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


def arrivals(n: int, rate: float | None, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Arrival times of ``n`` requests at ``rate`` req/s; None = offline (all at time 0).
    ``cv`` is the inter-arrival coefficient of variation: 1 is Poisson, above 1 is bursty (gamma)."""
    if rate is None:
        return np.zeros(n)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate={rate!r} is not allowed: a finite number of requests/s > 0, "
                         "or None for an offline trace")
    check_range("cv", cv, 1e-3, 100.0, kind=float)
    shape = 1.0 / cv ** 2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    return np.cumsum(gaps) - gaps[0]


def paper_trace(n: int, rate: float | None = None, seed: int = 0, input_range=(32, 512),
                gen_range=(1, 128), scale: float = 1.0, vocab_size: int = 50257,
                cv: float = 1.0) -> list[TraceItem]:
    """The paper's workload: input ~ U{input_range}, max_gen_tokens ~ U{gen_range}, lengths
    multiplied by ``scale``."""
    check_range("n", n, 1, 10_000_000)
    check_range("scale", scale, 1e-3, 1000.0, kind=float)
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
    check_range("n", n, 1, 10_000_000)
    check_range("scale", scale, 1e-3, 1000.0, kind=float)
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
    check_range("n", n, 1, 10_000_000)
    check_range("input_len", input_len, 1, 1 << 20)
    check_range("gen_len", gen_len, 1, 1 << 20)
    rng = np.random.default_rng(seed)
    return _items(rng, arrivals(n, rate, rng, cv), np.full(n, input_len), np.full(n, gen_len), vocab_size)


def _scaled(x: int, scale: float) -> int:
    return max(1, int(round(x * scale)))


def _items(rng, times, in_lens, gen_lens, vocab_size) -> list[TraceItem]:
    check_range("vocab_size", vocab_size, 2, 1 << 24)
    return [TraceItem(float(t), tuple(rng.integers(0, vocab_size, size=int(L)).tolist()), int(g))
            for t, L, g in zip(times, in_lens, gen_lens)]


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
    arrival = obj["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) \
            or arrival < 0:
        raise ValueError(f"arrival={arrival!r} must be a finite number >= 0")
    prompt = obj["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        raise ValueError("prompt must be a non-empty list of token ids >= 0")
    check_range("max_gen_tokens", obj["max_gen_tokens"], 1, 1 << 20)
    return TraceItem(float(arrival), tuple(prompt), obj["max_gen_tokens"])
