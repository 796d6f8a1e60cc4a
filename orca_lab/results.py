"""Result tables that leave the process: a CSV to read and a JSON that records what produced it."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from orca_lab.environment import environment


def save_table(df: pd.DataFrame, out_dir, name: str, columns=None, complete: bool = True, **meta) -> list[Path]:
    """``name.csv`` (``columns`` only, if given) and ``name.json`` (every column, ``meta`` and the
    machine and library versions that produced it) under ``out_dir``. ``complete=False``: the rows so
    far of a run that saves as it goes (every column), so a run cut by a time limit keeps them; the
    JSON says which."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv, js = out / f"{name}.csv", out / f"{name}.json"
    df.to_csv(csv, columns=columns if complete else None, index=False)
    js.write_text(json.dumps({"meta": meta, "complete": complete, "environment": environment(),
                              "rows": json.loads(df.to_json(orient="records"))}, indent=1, default=str))
    return [csv, js]



def write_report(out, args, fields: dict, complete: bool = True) -> Path:
    """A benchmark's JSON at ``out``: its arguments, the machine and library versions it ran on, and
    ``fields`` (its rows and what it concluded from them); ``complete=False``: the rows so far, written
    as it goes (as ``save_table``'s)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "complete": complete, "environment": environment(), **fields},
                              indent=1, default=str))
    if complete:
        print(f"wrote {out}")
    return out
