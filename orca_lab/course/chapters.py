"""The site's chapters: the course's notebooks, then the reproductions of the paper's figures.

A reproduction runs at the sizes ``reproduce/README.md`` gives for a CPU (its defaults simulate the
paper's GPUs; ``sim_fidelity`` and ``policies`` shrunk, else they take 7 and 3 minutes), exporting its
figures under the build directory instead of ``results/``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from orca_lab.course import solve

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Chapter:
    path: str                  # relative to the repository: notebooks/01_....ipynb
    parameters: tuple = ()     # (name, value) pairs given to papermill

    @property
    def part(self) -> str:
        return Path(self.path).parent.name

    @property
    def stem(self) -> str:
        return Path(self.path).stem

    def title(self, root: Path = ROOT) -> str:
        """The notebook's first heading."""
        nb = json.loads((root / self.path).read_text())
        for cell in nb["cells"]:
            for line in "".join(cell["source"]).splitlines():
                if cell["cell_type"] == "markdown" and line.startswith("# "):
                    return line[2:].strip()
        return self.stem


PAPER_ORDER = ("fig9_engine", "fig_e2e", "fig11_homogeneous", "kv_memory", "policies", "sim_fidelity")
SMALL = {   # reproduce/README.md's CPU sizes for the two long ones
    "sim_fidelity": (("n_requests", 48), ("repeats", 2), ("loads", [0.5, 0.85])),
    "policies": (("models", ["gpt3-13b"]), ("traces", ["paper", "sharegpt"]), ("n_requests", 16),
                 ("concurrency_requests", 60), ("loads", [0.5, 1.5])),
}


def chapters(root: Path = ROOT) -> list[Chapter]:
    out = [Chapter(f"notebooks/{p.name}") for p in solve.course(root / "notebooks")]
    found = {p.stem for p in (root / "reproduce").glob("*.ipynb")}
    order = [s for s in PAPER_ORDER if s in found] + sorted(found - set(PAPER_ORDER))
    out += [Chapter(f"reproduce/{s}.ipynb", SMALL.get(s, ())) for s in order]
    return out


def select(chs: list[Chapter], only: list[str] | None) -> list[Chapter]:
    """The chapters ``only`` names (``--only``), in their order; all when it names none. A word names a
    chapter by its number (``11``, ``3``), its first word (``fig9``, ``02_``) or its whole name: ``11``
    is ``11_after_orca``, never also ``fig11_homogeneous``."""
    if not only:
        return chs
    words = {o: o.rstrip("_").zfill(2) if o.rstrip("_").isdigit() else o.rstrip("_") for o in only}
    for o, w in words.items():
        if not any(w in _names(c) for c in chs):
            raise ValueError(f"--only: {o!r} names no chapter; the chapters: {', '.join(c.stem for c in chs)}")
    return [c for c in chs if _names(c) & set(words.values())]


def _names(c: Chapter) -> set[str]:
    return {c.stem, c.stem.split("_")[0]}
