"""Launch configurations chosen per shape bucket: timed once on a GPU, fixed in the interpreter.

A kernel's best block sizes, ``num_warps`` and ``num_stages`` depend on its shape (how many programs,
how long the loop over keys), so the choice is cached per *bucket* of shapes: nearby shapes share
it, and each bucket is timed only the first time it is seen (every candidate launched on the real
arguments, which is safe because the attention kernels only read their inputs). Under Triton's
interpreter timing says nothing, so the first candidate (a small fixed configuration) is used.

Timing is for a warm-up, not for a served run: a bucket first met mid-run was timed inside it (on an
H200, Figure 10's first ORCA curve ran 10x its predicted time, tuning and compiling as it met new
lengths). So an engine warms its shapes up (``LLM.warm_up``) and then ``settle``s the tuner: past
that, a bucket not yet seen borrows the choice of the nearest bucket timed for the same kernel and
model shape, and only a shape with no such neighbour is still timed.
"""
from __future__ import annotations

import os
import warnings

import torch

import triton  # noqa: E402  (callers import _backend first, which picks the interpreter on CPU)


def timing_allowed() -> bool:
    """``ORCA_LAB_TUNE=0``: every bucket takes its kernel's first candidate untimed, as under the
    interpreter. For runs that compare tokens across processes (the GPU check's workers): tuned
    separately, two processes may pick different tiles, whose rounding can part greedy tokens, and each
    pays its own timing (the workers' step was cut at its limit compiling candidates)."""
    return os.environ.get("ORCA_LAB_TUNE", "1") != "0"


def bucket(n: int) -> int:
    """Shapes up to the next power of two share a launch configuration."""
    return 1 << max(0, int(n) - 1).bit_length()


class LaunchTuner:
    """``choose(key, candidates, launch)``: the fastest candidate for this bucket, timed once."""

    def __init__(self):
        self.best: dict = {}
        self.timed: dict = {}      # key -> {configuration: ms} of every candidate timed for it
        self.settled = False

    def settle(self):
        """From now on a new bucket borrows from its nearest timed neighbour rather than timing."""
        self.settled = True

    def choose(self, key, candidates, launch, on_gpu: bool, like=(), as_own=None, answer=None):
        """``like``: the keys of other paths of the same kernel and shapes (a fresh prompt's, for
        prompts that read earlier keys too), whose timed buckets lend a choice
        once settled when ``key``'s own kind has none: a warm-up that met only one path times nothing
        mid-run. ``as_own``: the borrower's equivalent of another path's choice (the same tile read
        another way), if it has one. ``answer()``: the tensor a launch writes, compared across the
        candidates timed (``_timings``)."""
        got = self.best.get(key)
        if got is not None:
            return got
        near = self.borrow(key, candidates, like, as_own) if self.settled else None
        if near is not None:
            got = near
        elif not on_gpu or len(candidates) == 1 or not timing_allowed():
            got = candidates[0]
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return candidates[0]           # no timing inside a CUDA graph capture: warm up first
        else:
            self.timed[key] = _timings(candidates, launch, answer)
            got = min(self.timed[key], key=self.timed[key].get)
        self.best[key] = got
        return got

    def borrow(self, key, candidates, like=(), as_own=None):
        """The nearest timed choice of ``key``'s kind, else the first of ``like``'s (keys tried in order)
        that is among ``candidates`` (``as_own``: after translating it)."""
        near = self.nearest(key)
        if near is not None:
            return near
        for other in like:
            near = self.nearest(other)
            near = as_own(near) if as_own and near is not None else near
            if near in candidates:
                return near
        return None

    def nearest(self, key):
        """The choice of the timed bucket closest to ``key`` (a key ends in its shape buckets, powers
        of two, and begins with what must match: kernel, device, heads, head size, dtype), or None."""
        kind, buckets = key[:-2], key[-2:]

        def distance(other):
            return sum(abs(int(a).bit_length() - int(b).bit_length()) for a, b in zip(other[-2:], buckets))

        same = [k for k in self.best if k[:-2] == kind]
        return self.best[min(same, key=distance)] if same else None


def _timings(candidates, launch, answer=None) -> dict:
    """``{candidate: ms}``: each candidate that compiles and fits the device, timed (too much shared memory is skipped).
    One that fails otherwise here (a driver refusing a tensor descriptor, say) is skipped and named,
    so a run on an untried GPU goes on with the others. So is one whose ``answer()`` differs from the
    first candidate's that ran (the tile that also serves untuned): a tile that compiled but computes
    wrongly is never picked for being fast."""
    times, failed, first = {}, [], None
    for cfg in candidates:
        try:
            launch(cfg)                    # compiles; raises if the configuration cannot run here
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError):
            continue
        except Exception as e:  # noqa: BLE001  (named below, and raised if nothing else runs)
            failed.append(f"{cfg}: {type(e).__name__}: {e}")
            warnings.warn(f"launch configuration {failed[-1]} (skipped)", RuntimeWarning, stacklevel=3)
            continue
        if answer is not None:
            got = answer().clone()
            if first is None:
                first = (cfg, got)
            elif off := _disagreement(got, first[1]):
                warnings.warn(f"launch configuration {cfg} answers other than {first[0]} ({off}): skipped",
                              RuntimeWarning, stacklevel=3)
                continue
        times[cfg] = triton.testing.do_bench(lambda cfg=cfg: launch(cfg), warmup=5, rep=20)
    if not times:
        raise RuntimeError(f"no launch configuration of {candidates} runs on this device"
                           + "".join(f"; {f}" for f in failed))
    return times


def _disagreement(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'' where two tiles' answers agree up to their accumulation order (rows no launch wrote hold the
    same bytes in both, NaNs included), else the largest difference. fp32 allows TF32's rounding: a
    tile's blocks round the probabilities at other maxima."""
    tol = 2e-2 if got.element_size() <= 2 else 1e-2
    got, ref = got.float(), ref.float()
    if torch.allclose(got, ref, rtol=tol, atol=tol, equal_nan=True):
        return ""
    same = (got == ref) | (got.isnan() & ref.isnan())
    diff = torch.where(same, 0.0, (got - ref).abs()).nan_to_num(float("inf"))
    return f"largest difference {diff.max().item():.3g}"
