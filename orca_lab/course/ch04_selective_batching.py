"""Chapter 04, selective batching: the grader of the flattening of a batch into the model's flat
metadata, and its plug point, ``use_flatten``."""
from __future__ import annotations

import random

import numpy as np
import torch

from orca_lab.course.bounded import ints, refuse_package_code, run_bounded
from orca_lab.course.forked import grader
from orca_lab.course.guards import answer_of, fault_of
from orca_lab.course.harness import N_CASES, Piece, check_by_hand, correct, differ, place_on, read, request
from orca_lab.engine.batch import Batch, BatchTensors
from orca_lab.engine.request import Request


FLAT_FIELDS = ("input_ids", "positions", "slot_mapping", "kv_slot_ids", "cu_seqlens_q", "cu_seqlens_k", "last_idx")


def random_requests(rng, g, b: int, scale: int = 1) -> list[Request]:
    """``b`` requests part way through (some cached tokens, some new), slots scattered in a pool;
    ``scale`` times longer prompts and a larger pool (positions and slot ids past 255)."""
    reqs, pool = [], torch.randperm(400 * scale, generator=g)
    for rid in range(b):
        prompt, cached, generated = rng.randint(1, 9 * scale), None, rng.randint(0, 4)
        req = request(rid, prompt, generated + 2)
        req.output = [rng.randrange(256) for _ in range(generated)]
        req.prompt = [rng.randrange(256) for _ in range(prompt)]
        cached = rng.randint(0, prompt - 1) if generated == 0 else prompt + generated - 1
        req.n_cached = cached
        req.slots, pool = pool[:req.max_tokens], pool[req.max_tokens:]
        reqs.append(req)
    return reqs


_FLAT_HINTS = {
    "input_ids": "each request's new tokens (pending_tokens()), requests one after another",
    # in words, never the code: a wrong field is shown what it means, not its answer
    "positions": "a new token's position counts every token of its request before it, the cached ones too",
    "slot_mapping": "where each new token's K/V is written: its request's own slots, one per new token, "
                    "those after the slots its cached tokens already hold",
    "kv_slot_ids": "the whole context attention reads: the slots of each request's cached and new tokens, "
                   "request after request",
    "cu_seqlens_q": "0, then the running sum of each request's new tokens",
    "cu_seqlens_k": "0, then the running sum of each request's context (cached + new tokens)",
    "last_idx": "the row of each request's last new token in the flat batch, counted from 0"}


@grader
def check_flatten(flatten, seed: int = 0):
    """``flatten(requests) -> {field: list}`` for the fields of ``BatchTensors``; graded against
    ``Batch.selective(requests).tensors("cpu")`` on random batches of prompts and decodes."""
    refs = (BatchTensors, Batch.tensors)
    refuse_package_code(flatten, *refs)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for case in range(N_CASES):      # the last with long contexts: no field fits in a byte
        reqs = random_requests(rng, g, rng.randint(1, 5), scale=60 if case == N_CASES - 1 else 1)
        bt = Batch.selective(reqs).tensors("cpu")
        label = (f"case {case} (new tokens {[len(r.pending_tokens()) for r in reqs]}, "
                 f"cached {[r.n_cached for r in reqs]}, slots {[r.slots[:6].tolist() for r in reqs]}...)")
        got = read("the flat metadata", label, run_bounded(flatten, reqs, case=label, references=refs), _read_flat,
                   f"a dict of lists of ints, keys {list(FLAT_FIELDS)}")
        for name in FLAT_FIELDS:
            if got[name] != getattr(bt, name).tolist():
                differ(name, label, getattr(bt, name).tolist(), got[name], _FLAT_HINTS[name])
    correct(N_CASES, "BatchTensors.build")


def _read_flat(got) -> dict:
    """The learner's flat metadata as the grader and the plug point read it: each field's ints."""
    return {name: ints(got[name]) if name in got else None for name in FLAT_FIELDS}


def tensors_from(flat: dict, device) -> BatchTensors:
    """The learner's flattening (notebook 04: a dict of lists) as the ``BatchTensors`` the model reads."""
    host = {name: np.asarray(flat[name], dtype=np.int64) for name in FLAT_FIELDS}
    cu = torch.from_numpy(np.stack([host["cu_seqlens_q"], host["cu_seqlens_k"]]).astype(np.int32)).to(device)
    on = {name: torch.from_numpy(host[name]).to(device)
          for name in ("input_ids", "positions", "slot_mapping", "kv_slot_ids", "last_idx")}
    return BatchTensors(on["input_ids"], on["positions"], on["slot_mapping"], on["kv_slot_ids"], cu[0], cu[1],
                        on["last_idx"], host["cu_seqlens_q"], host["cu_seqlens_k"],
                        np.concatenate([host["slot_mapping"], host["kv_slot_ids"]]))


def use_flatten(engine, flatten):
    """Every batch ``engine`` (ORCA's, in this process) selects builds its iteration's tensors with the
    learner's ``flatten(requests)`` in place of ``BatchTensors.build``."""
    if engine.scheduler.name != "orca":
        raise ValueError(f"use_flatten takes an engine of system 'orca', not {engine.scheduler.name!r}")
    select = engine.scheduler.select

    def select_flattened(now: float = 0.0):
        batch = select(now)
        if batch is not None:
            batch.tensors = lambda device: tensors_from(_checked_flat(flatten, batch.requests), device)
        return batch

    engine.scheduler.select = select_flattened
    return engine


def _checked_flat(flatten, requests) -> dict:
    """``flatten(requests)``, every field the package's (``Batch.tensors``): one that differs (a batch
    its grader never met: a long context, a large slot id) stops the engine naming the field, before
    the model runs on it (wrong text otherwise)."""
    got = answer_of(flatten, "flatten", flatten(requests), _read_flat)
    want = Batch.selective(requests).tensors("cpu")
    for name in FLAT_FIELDS:
        if got[name] != getattr(want, name).tolist():
            raise fault_of(flatten, "flatten", f"gave {name} other than the package's for requests "
                           f"{[r.rid for r in requests]} (cached {[r.n_cached for r in requests]}, new tokens "
                           f"{[len(r.pending_tokens()) for r in requests]}): {_FLAT_HINTS[name]}")
    return got


def _reads_tensors(engine) -> bool:
    return getattr(engine.scheduler.kv, "k", None) is not None      # the simulator reads none


PIECES = (Piece("flatten", "04", "orca", check_flatten, use_flatten, place=place_on("orca", when=_reads_tensors)),)


def check_offsets(q_lens, cached, cu_q, cu_k, padded_rows):
    """Notebook 04's by-hand batch: requests with ``q_lens`` new and ``cached`` earlier tokens, read
    from the package's batches: the selective one's offsets, and the rows of the padded one
    (FasterTransformer's). A wrong answer is named with its hint, never the package's (the answer)."""
    reqs = []
    for rid, (q, c) in enumerate(zip(q_lens, cached)):
        req = request(rid, c + q, 1)
        req.n_cached, req.slots = c, torch.arange(req.max_tokens)
        reqs.append(req)
    bt = Batch.selective(reqs).tensors("cpu")
    check_by_hand(f"q_lens {list(q_lens)}, cached {list(cached)}", {
        "ex_cu_q": (cu_q, bt.cu_seqlens_q.tolist(), _FLAT_HINTS["cu_seqlens_q"]),
        "ex_cu_k": (cu_k, bt.cu_seqlens_k.tolist(), _FLAT_HINTS["cu_seqlens_k"]),
        "ex_padded_rows": (padded_rows, Batch.padded_step(reqs, 0, max(q_lens)).n_tokens,
                           "a padded batch gives every request as many rows as the longest one has")})
    print(f"correct: selective batching computes {sum(q_lens)} rows where padding computes {padded_rows}")
