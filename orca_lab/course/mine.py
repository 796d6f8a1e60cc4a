"""The learner's own engine: every exercise's code lands in one package the learner owns, ``my_orca``.

An exercise cell starts with the cell magic ``%%exercise <id>`` (``%load_ext orca_lab.course.mine``
registers it). The cell runs as any other; once it has run without raising, its source is saved as
``my_orca/<id>.py``, with the imports of the names it reads from the notebook (a module, the
package's classes, an earlier exercise's function), so the file stands alone. The capstone
(chapter 13) and ``orca-lab serve --plugins`` load the package and plug its pieces into the
engine (``plug.assemble``).

The grader's verdict is saved with the code, as the file's ``__verdict__``: "not graded" when the
cell is saved (an unsolved stub runs: it only defines), then "passed" or "failed: <why>" once a
cell that calls a grader (a function named ``check_...``) on the names the exercise defined has run
(an IPython ``post_run_cell`` hook: the graders stay unaware of it). A stub, a failed grader and a
grader not run yet all count as not done (``verdicts``; the capstone re-grades besides).

Where (``home()``), whichever way the notebooks run (JupyterLab and nbconvert start the kernel in
``notebooks/``, papermill where it was started): ``$ORCA_LAB_MY_ORCA`` if set, else ``my_orca/`` in
the course's ``notebooks/`` folder of this checkout (``~/my_orca`` for a package installed without one).
"""
from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import types
from pathlib import Path

from orca_lab.course.solve import NOTEBOOKS

ENV = "ORCA_LAB_MY_ORCA"
HEADER = '"""Written by the exercise cell %%exercise {id} of the course ({source})."""\n'
VERDICT = re.compile(r"^__verdict__ = .*$", re.M)     # the saved file's line holding its grader's verdict
NOT_GRADED, PASSED = "not graded", "passed"


def home() -> Path:
    """The learner's package folder, the same from any working directory (module docstring)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser().resolve()
    return (NOTEBOOKS if NOTEBOOKS.is_dir() else Path.home()) / "my_orca"


def defined(tree: ast.Module) -> list[str]:
    """The public names a cell defines at its top level (functions, classes, assignments)."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def free_names(tree: ast.Module) -> list[str]:
    """Names the cell reads that it neither binds nor gets from builtins, in order of first use."""
    bound = set(defined(tree)) | {a.asname or a.name.split(".")[0] for node in ast.walk(tree)
                                  if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.posonlyargs + n.args + n.kwonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.ExceptHandler))
              and n.name}
    seen = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound \
                and not hasattr(builtins, n.id) and n.id not in seen:
            seen.append(n.id)
    return seen


def owner(name: str, folder: Path) -> str | None:
    """The exercise file of ``folder`` that defines ``name``."""
    for path in sorted(folder.glob("*.py")):
        if path.stem != "__init__" and name in defined(ast.parse(path.read_text())):
            return path.stem
    return None


def import_line(name: str, value, folder: Path) -> str | None:
    """How the saved file gets ``name``, which the notebook held as ``value``; None: it cannot."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__}" if value.__name__ == name else f"import {value.__name__} as {name}"
    module = getattr(value, "__module__", None)
    if module in (None, "__main__", "builtins") or getattr(value, "__qualname__", None) != name:
        ex = owner(name, folder)
        return f"from .{ex} import {name}" if ex else None
    return f"from {module} import {name}"


def module_source(ex: str, source: str, namespace: dict, folder: Path, origin: str = "a notebook") -> str:
    """The file ``my_orca/<ex>.py`` for a cell of ``source`` run in ``namespace``. A function or class
    that an earlier cell of the notebook defined (not an exercise) is copied in, before the cell."""
    given, imports = [], {}
    for _ in range(20):                      # copied code may read more of the notebook's names
        missing = []
        for name in free_names(ast.parse("\n\n".join(given + [source]))):
            if name in imports:
                continue
            line = import_line(name, namespace[name], folder) if name in namespace else None
            if line:
                imports[name] = line
            elif _notebooks(namespace.get(name)):
                given.insert(0, inspect.getsource(namespace[name]).strip("\n") + "\n")
            else:
                missing.append(name)
        if missing:
            raise NameError(f"%%exercise {ex}: {', '.join(missing)} cannot be imported in my_orca/{ex}.py "
                            "(a value of the notebook, not a module, class or function): define it in the cell")
        if not any(n not in imports for n in free_names(ast.parse("\n\n".join(given + [source])))):
            break
    head = "\n".join(imports.values()) + ("\n\n" if imports else "") + "\n\n".join(given) + ("\n\n" if given else "")
    return HEADER.format(id=ex, source=origin) + f"__verdict__ = {NOT_GRADED!r}\n\n" + head + \
        source.strip("\n") + "\n" + f"\n__all__ = {defined(ast.parse(source))!r}\n"


def _notebooks(value) -> bool:
    """A function or class defined by a notebook cell (its source is there to copy)."""
    return (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == "__main__"


def save(ex: str, source: str, namespace: dict, folder: Path | None = None, origin: str = "a notebook") -> Path:
    folder = folder or home()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").touch()
    path = folder / f"{ex}.py"
    path.write_text(module_source(ex, source, namespace, folder, origin))
    return path


def record(path: Path, verdict: str):
    """Write ``verdict`` ("passed", "failed: ...") into the saved exercise file ``path``."""
    text = path.read_text()
    line = f"__verdict__ = {verdict!r}"
    path.write_text(VERDICT.sub(lambda _: line, text, count=1) if VERDICT.search(text) else f"{line}\n{text}")


def graded(source: str, names) -> bool:
    """Whether the cell ``source`` calls a grader (``check_...``) on one of ``names``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")).startswith("check_")
               and any(isinstance(a, ast.Name) and a.id in names for a in n.args) for n in ast.walk(tree))


# the exercises saved in this kernel: a name the cell defined -> its file, whose verdict a grader cell sets
_saved: dict[str, Path] = {}


def _after_cell(result):
    """IPython's ``post_run_cell``: a cell that graded saved exercises records its verdict in their files."""
    source = result.info.raw_cell if result.info is not None else ""
    error = result.error_before_exec or result.error_in_exec
    why = PASSED if error is None else f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    for path in {path for name, path in _saved.items() if path.exists() and graded(source, {name})}:
        record(path, why)


def exercise(line: str, cell: str):
    """``%%exercise <id>``: run the cell in the notebook, then save it as ``my_orca/<id>.py``, not graded
    yet (a grader cell run later, or this one, records its verdict)."""
    from IPython import get_ipython
    ip = get_ipython()
    ex = line.strip()
    if not ex.isidentifier():
        raise ValueError(f"%%exercise {line!r}: give the exercise's id, a Python name (e.g. %%exercise select)")
    filename = ip.compile.cache(cell)        # a traceback shows the cell's lines
    exec(ip.compile(cell, filename, "exec"), ip.user_ns)     # raising: an unfinished cell is not saved
    names = defined(ast.parse(cell))
    if names:
        try:
            path = save(ex, cell, ip.user_ns)
        except NameError as e:       # the cell ran: only your package lacks it
            print(f"not saved into your package: {e}")
            return
        _saved.update(dict.fromkeys(names, path))
        if graded(cell, names):      # the cell graded itself, and ran through
            record(path, PASSED)


def load_ipython_extension(ip):
    ip.register_magic_function(exercise, magic_kind="cell")
    if _after_cell not in ip.events.callbacks["post_run_cell"]:
        ip.events.register("post_run_cell", _after_cell)


# -- loading it -------------------------------------------------------------------------------------
def resolve(where: str | Path) -> str:
    """``where`` as the engine process will load it: a folder's absolute path, or a module name that
    imports here; else a ``ValueError`` naming it (``orca-lab serve --plugins`` checks before it starts)."""
    path = Path(where)
    if path.is_dir():
        return str(path.resolve())
    try:
        found = importlib.util.find_spec(str(where)) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ValueError(f"plugins={str(where)!r}: no such folder, and no module of that name imports")
    return str(where)


def load(where: str | Path | None = None) -> dict:
    """The learner's pieces, name -> object, from every exercise file of the package at ``where`` (a
    folder, default ``home()``, or an importable module name). A file that fails to import raises."""
    where = resolve(where if where is not None else home())
    if Path(where).is_dir():
        package = _import_folder(Path(where))
        names = sorted(p.stem for p in Path(where).glob("*.py") if p.stem != "__init__")
    else:
        package = importlib.import_module(where)
        names = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
    pieces = {}
    for name in names:
        module = importlib.import_module(f"{package.__name__}.{name}")
        pieces.update({n: getattr(module, n) for n in getattr(module, "__all__", ())})
    return pieces


def verdicts(where: str | Path | None = None) -> dict:
    """Each piece of the package at ``where`` (as ``load``) -> its grader's verdict when it was saved
    ("passed", "failed: ...", "not graded")."""
    where = resolve(where if where is not None else home())
    folder = Path(where) if Path(where).is_dir() else Path(importlib.import_module(where).__path__[0])
    out = {}
    for path in sorted(p for p in folder.glob("*.py") if p.stem != "__init__"):
        tree = ast.parse(path.read_text())
        found = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name) and t.id in ("__all__", "__verdict__")}
        out.update(dict.fromkeys(found.get("__all__", ()), found.get("__verdict__", NOT_GRADED)))
    return out


def _import_folder(path: Path) -> types.ModuleType:
    """The folder as a package named after it (a fresh import each time: the learner edits it), under
    a prefix of its own: a folder called ``select`` or ``json`` must not replace the module of that
    name for the whole process."""
    name = f"_learners_{path.resolve().name}"
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    init = path / "__init__.py"
    if not init.exists():
        init.touch()
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package
