"""The site's chapters: the course's notebooks, then the reproductions of the paper's figures.

A reproduction runs at the sizes ``reproduce/README.md`` gives for a CPU (its defaults simulate the
paper's GPUs; ``sim_fidelity`` and ``policies`` shrunk, else they take 7 and 3 minutes), exporting its
figures under the build directory instead of ``results/``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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
    out = [Chapter(f"notebooks/{p.name}") for p in sorted((root / "notebooks").glob("[0-9]*.ipynb"))]
    found = {p.stem for p in (root / "reproduce").glob("*.ipynb")}
    order = [s for s in PAPER_ORDER if s in found] + sorted(found - set(PAPER_ORDER))
    out += [Chapter(f"reproduce/{s}.ipynb", SMALL.get(s, ())) for s in order]
    return out
