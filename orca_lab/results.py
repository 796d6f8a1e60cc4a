"""Result tables that leave the process: a CSV to read and a JSON that records what produced it."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from orca_lab.environment import environment


def save_table(df: pd.DataFrame, out_dir, name: str, columns=None, **meta) -> list[Path]:
    """``name.csv`` (``columns`` only, if given) and ``name.json`` (every column, ``meta`` and the
    machine and library versions that produced it) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, js = out / f"{name}.csv", out / f"{name}.json"
    df.to_csv(csv, columns=columns, index=False)
    js.write_text(json.dumps({"meta": meta, "environment": environment(),
                              "rows": json.loads(df.to_json(orient="records"))}, indent=1, default=str))
    return [csv, js]



def write_report(out, args, fields: dict) -> Path:
    """A benchmark's JSON at ``out``: its arguments, the machine and library versions it ran on, and
    ``fields`` (its rows and what it concluded from them)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "environment": environment(), **fields}, indent=1, default=str))
    print(f"wrote {out}")
    return out
