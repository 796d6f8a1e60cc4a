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

A timed choice is also kept on disk (``ChoiceStore``, under ``tuning_cache()``), per GPU model,
software and kernel source: the next process on the same GPU takes it untimed, so a server's restart,
the benchmark after a figure, or a worker beside its engine time nothing already timed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch

import triton  # noqa: E402  (callers import _backend first, which picks the interpreter on CPU)


def timing_allowed() -> bool:
    """``ORCA_LAB_TUNE=0``: every bucket takes its kernel's first candidate untimed, as under the
    interpreter. For runs that compare tokens across processes (the GPU check's workers): tuned
    separately, two processes may pick different tiles, whose rounding can part greedy tokens, and each
    pays its own timing (the workers' step was cut at its limit compiling candidates)."""
    return os.environ.get("ORCA_LAB_TUNE", "1") != "0"


def tuning_cache() -> Path | None:
    """Where timed choices are kept between processes: ``$ORCA_LAB_TUNING_CACHE`` (``0``: nowhere,
    every process times its own), or where it is unset or empty ``~/.cache/orca_lab/tuning``."""
    where = os.environ.get("ORCA_LAB_TUNING_CACHE")
    if where == "0":
        return None
    return Path(where).expanduser() if where else Path.home() / ".cache" / "orca_lab" / "tuning"


@lru_cache(maxsize=None)
def _sources_digest() -> str:
    """The kernels' source: a change to any kernel (or to its candidate tiles) times anew."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint() -> dict:
    """What a timed choice holds for: the GPU model, CUDA, Triton, torch and the kernels' source."""
    name = torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return {"device": name, "cuda": torch.version.cuda, "triton": triton.__version__,
            "torch": torch.__version__, "kernels": _sources_digest()}


class ChoiceStore:
    """Timed choices on disk, one JSON file per (``fingerprint``, key), written whole under a temporary
    name and then renamed: processes tuning at once never read half a file, and the last to finish
    leaves a choice as well timed as the others'. A choice is recalled only where it is still one of
    the candidates (matched by its repr), so a changed table of tiles cannot hand back a stale one."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, key) -> Path:
        name = json.dumps([fingerprint(), [str(k) for k in key]], sort_keys=True)
        return self.folder / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.json"

    def recall(self, key, candidates):
        """``(choice, {candidate: ms})`` as timed by an earlier process, or None (no record, or one
        of another shape: a file is data, never trusted to be ours)."""
        try:
            saved = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        by_name = {repr(c): c for c in candidates}
        choice = saved.get("choice") if isinstance(saved, dict) else None
        if not isinstance(choice, str) or choice not in by_name:
            return None
        timed = saved.get("timed_ms")
        timed = timed.items() if isinstance(timed, dict) else ()
        return by_name[choice], {by_name[n]: float(ms) for n, ms in timed
                                 if n in by_name and isinstance(ms, (int, float))}

    def keep(self, key, choice, timed: dict):
        """Write the choice; a folder that cannot be written leaves only this process's memory of it
        (and no half-written file)."""
        record = {"key": [str(k) for k in key], **fingerprint(), "choice": repr(choice),
                  "timed_ms": {repr(c): ms for c, ms in timed.items()}}
        written = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as f:
                written = f.name
                json.dump(record, f, indent=1)
            os.replace(written, self._path(key))
        except OSError as e:
            if written is not None:
                with contextlib.suppress(OSError):
                    os.unlink(written)
            warnings.warn(f"tuning cache {self.folder}: {e}; the choice is kept in this process only",
                          RuntimeWarning, stacklevel=3)

    def forget(self, key):
        with contextlib.suppress(OSError):
            self._path(key).unlink()


def bucket(n: int) -> int:
    """Shapes up to the next power of two share a launch configuration."""
    return 1 << max(0, int(n) - 1).bit_length()


class LaunchTuner:
    """``choose(key, candidates, launch)``: the fastest candidate for this bucket, timed once."""

    def __init__(self):
        self.best: dict = {}
        self.timed: dict = {}      # key -> {configuration: ms} of every candidate timed for it
        self.recalled: set = set()     # keys whose choice an earlier process timed (``ChoiceStore``)
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
        timing = on_gpu and len(candidates) > 1 and timing_allowed()
        capturing = timing and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        folder = tuning_cache() if timing else None
        store = ChoiceStore(folder) if folder else None
        recalled = store.recall(key, candidates) if store and not capturing else None
        if recalled and (failed := _fails(recalled[0], launch)):   # another driver, say: time anew
            warnings.warn(f"launch configuration {recalled[0]}, timed by an earlier process, fails here "
                          f"({failed}): timing anew", RuntimeWarning, stacklevel=3)
            store.forget(key)
            recalled = None
        near = self.borrow(key, candidates, like, as_own) if self.settled and not recalled else None
        if recalled:
            got, self.timed[key] = recalled
            self.recalled.add(key)
        elif near is not None:
            got = near
        elif not timing:
            got = candidates[0]
        elif capturing:
            return candidates[0]           # no timing inside a CUDA graph capture: warm up first
        else:
            self.timed[key] = _timings(candidates, launch, answer)
            got = min(self.timed[key], key=self.timed[key].get)
            if store:
                store.keep(key, got, self.timed[key])
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


def _fails(cfg, launch) -> str:
    """'' where ``launch(cfg)`` runs, else what it raised."""
    try:
        launch(cfg)
    except Exception as e:  # noqa: BLE001  (any failure: the caller times the candidates anew)
        return f"{type(e).__name__}: {e}"
    return ""


def _timings(candidates, launch, answer=None) -> dict:
    """``{candidate: ms}``: each candidate that compiles and fits the device, timed (one that needs too
    much shared memory is skipped).
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
