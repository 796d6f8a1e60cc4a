"""Which model family a config or a checkpoint is: the one place that dispatches on it.

``ModelConfig.family`` picks the module (``gpt.GPT``, ``llama.Llama``); a Hugging Face checkpoint's
``config.json`` picks the family by its ``architectures``. The engine, the batch and the schedulers
never ask: they run whatever ``model_class`` built.
"""
from __future__ import annotations

import json
from pathlib import Path

from orca_lab.config import ModelConfig
from orca_lab.model import gpt, llama
from orca_lab.model.checkpoint import INDEX, SINGLE, has_weights

CLASSES = {"gpt2": gpt.GPT, "llama": llama.Llama}
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", **{a: "llama" for a in llama.ARCHITECTURES}}


def model_class(cfg: ModelConfig) -> type[gpt.GPT]:
    return CLASSES[cfg.family]


def read_config(path) -> dict:
    """``config.json`` of checkpoint directory ``path``, checked to hold weights and a known architecture."""
    path = Path(path)
    if not (path / "config.json").is_file() or not has_weights(path):
        raise FileNotFoundError(f"{path} is not a checkpoint directory: it must hold config.json and "
                                f"{SINGLE} (or a sharded {INDEX})")
    c = json.loads((path / "config.json").read_text())
    archs = c.get("architectures") or ["GPT2LMHeadModel" if c.get("model_type") == "gpt2" else None]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{path / 'config.json'}: architectures={c.get('architectures')!r} is not supported "
                         f"(allowed: one of {', '.join(ARCHITECTURES)})")
    return {**c, "architectures": archs}


def checkpoint_config(path) -> ModelConfig:
    """The shape of the checkpoint in directory ``path``, named after it."""
    c = read_config(path)
    family = ARCHITECTURES[c["architectures"][0]]
    from_hf = gpt.config_from_hf if family == "gpt2" else llama.config_from_hf
    try:
        return from_hf(c, name=Path(path).name)
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None


def checkpoint_weights(path, device="cpu", dtype=None):
    """A weight source (``read(name, shape, ranges)``) over the checkpoint in ``path``."""
    import torch
    dtype = dtype or torch.float32
    cfg = checkpoint_config(path)
    if cfg.family == "gpt2":
        return gpt.CheckpointWeights(path, device, dtype)
    return llama.LlamaCheckpointWeights(path, cfg, device, dtype)


def from_pretrained(path, device="cpu", dtype=None, **kw) -> gpt.GPT:
    """The model of checkpoint ``path``, every tensor read once onto ``device``."""
    weights = checkpoint_weights(path, device, dtype)
    return model_class(weights.cfg).build(weights.cfg, weights, **kw)


def random_model(cfg: ModelConfig, seed: int = 0, device="cpu", **kw) -> gpt.GPT:
    return model_class(cfg).random(cfg, seed, device, **kw)
