"""A Hugging Face checkpoint's safetensors on disk, one file (``model.safetensors``) or sharded
(``model.safetensors.index.json`` naming each tensor's file): tensors are read by name, slice by
slice (``get_slice``), and a shard file is opened only when one of its tensors is read."""
from __future__ import annotations

import json
from pathlib import Path

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def has_weights(path: Path) -> bool:
    return (path / SINGLE).is_file() or (path / INDEX).is_file()


class SafetensorFiles:
    def __init__(self, path):
        self.path, self.files = Path(path), {}
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{self.path / INDEX} has no weight_map: it must map each tensor to its file")
            self.where = dict(weight_map)
        elif (self.path / SINGLE).is_file():
            self.where = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            raise FileNotFoundError(f"{self.path} holds neither {SINGLE} nor {INDEX}")

    def _open(self, file: str):
        from safetensors import safe_open
        if file not in self.files:
            if not (self.path / file).is_file():
                raise FileNotFoundError(f"{self.path / file} not found (named by {INDEX})")
            try:
                self.files[file] = safe_open(str(self.path / file), framework="pt")     # reads the header only
            except Exception as e:     # noqa: BLE001  (SafetensorError: an empty, cut or foreign file)
                raise ValueError(f"{self.path / file} is not a safetensors file ({e})") from None
        return self.files[file]

    def check(self) -> "SafetensorFiles":
        """Every file's header read now (a bad one refused before a model is built)."""
        for file in set(self.where.values()):
            self._open(file)
        return self

    def keys(self):
        return self.where.keys()

    def get_slice(self, name: str):
        return self._open(self.where[name]).get_slice(name)
