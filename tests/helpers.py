"""Small shared pieces of the tests."""
import random


def random_prompts(n, vocab, lo=1, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
