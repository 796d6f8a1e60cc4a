"""The code matches the house plan: every import inside the package follows the layer order that
docs/design.md lists (a module imports from its own layer or the ones before it), every module is on
that list, and no two modules import each other, even through an import inside a function."""
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orca_lab"


def layers() -> dict[str, int]:
    """Path (a file, or a folder ending in '/') -> its layer number, from design.md's numbered list."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out, number = {}, None
    for line in section.splitlines():
        m = re.match(r"(\d+)\. ", line)
        if m:
            number = int(m.group(1))
        if number is not None:
            for path in re.findall(r"`(orca_lab/[\w/]*(?:\.py|/))`", line):
                out.setdefault(path, number)
    return out


def layer_of(rel: str, plan: dict[str, int]) -> int | None:
    """The most specific entry naming ``rel`` (a path under the repository root)."""
    hits = [p for p in plan if rel == p or (p.endswith("/") and rel.startswith(p))]
    return plan[max(hits, key=len)] if hits else None


def module_path(name: str) -> str | None:
    """``orca_lab.engine.request`` -> ``orca_lab/engine/request.py`` (a package: its ``__init__.py``)."""
    base = ROOT / Path(*name.split("."))
    if base.with_suffix(".py").exists():
        return str(base.with_suffix(".py").relative_to(ROOT))
    if (base / "__init__.py").exists():
        return str((base / "__init__.py").relative_to(ROOT))
    return None


def imports(source: str, rel: str):
    """Every orca_lab module the file ``rel`` imports, at any depth (function-level imports included)."""
    package = ".".join(Path(rel).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([mod] if mod else []))
            # `from orca_lab import kernels` imports the module orca_lab.kernels
            names = [f"{mod}.{a.name}" if module_path(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "orca_lab":
                yield node.lineno, name


def test_design_lists_the_layers():
    plan = layers()
    assert plan["orca_lab/config.py"] == 1 and plan["orca_lab/engine/"] < plan["orca_lab/llm.py"]
    assert plan["orca_lab/torchrun.py"] == plan["orca_lab/cli.py"]
    assert plan["orca_lab/engine/"] < plan["orca_lab/model/"] < plan["orca_lab/distributed/"] < plan["orca_lab/llm.py"]


def upward(source: str, rel: str, plan: dict[str, int]) -> list[str]:
    own = layer_of(rel, plan)
    out = []
    for line, name in imports(source, rel):
        target = module_path(name)
        their = layer_of(target, plan) if target else None
        if their is not None and their > own:
            out.append(f"{rel}:{line} (layer {own}) imports {name} (layer {their})")
    return out


def package_files() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def unplaced(files, plan) -> list[str]:
    return [rel for rel in files if layer_of(rel, plan) is None]


def graph(files: dict[str, str]) -> dict[str, set[str]]:
    """Module file -> the package's module files it imports (at any depth). Importing a package's
    ``__init__`` from inside that package is left out: it is how the package is entered, not a use."""
    out = {}
    for rel, src in files.items():
        targets = {module_path(name) for _, name in imports(src, rel)} - {None, rel}
        out[rel] = {t for t in targets if not (t.endswith("__init__.py") and rel.startswith(t[:-len("__init__.py")]))}
    return out


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}                # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(g):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_is_placed_and_imports_only_from_layers_before_it():
    plan = layers()
    files = package_files()
    assert not unplaced(files, plan), f"modules docs/design.md does not place: {unplaced(files, plan)}"
    bad = [msg for rel, src in files.items() for msg in upward(src, rel, plan)]
    assert not bad, "imports against the layer order of docs/design.md:\n" + "\n".join(bad)


def test_the_checker_catches_an_upward_import():
    """The check above can fail: the engine importing the front end, at any depth, relative or not."""
    plan = layers()
    src = "import torch\ndef f():\n    from orca_lab.llm import LLM\n    from ..metrics import summarize\n"
    found = upward(src, "orca_lab/engine/fake.py", plan)
    assert [m.split(" imports ")[1].split()[0] for m in found] == ["orca_lab.llm", "orca_lab.metrics"]
    assert not upward(src, "orca_lab/torchrun.py", plan)      # an entry point may


def test_no_import_cycle_even_inside_a_function():
    found = cycle(graph(package_files()))
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_checker_catches_a_cycle_and_a_module_off_the_plan():
    """Both checks above can fail: a cycle closed by an import inside a function, and a new module
    in a folder design.md does not list."""
    files = {"orca_lab/engine/batch.py": "from orca_lab.engine.request import Request\n",
             "orca_lab/engine/request.py": "def f():\n    from orca_lab.engine import batch\n"}
    assert cycle(graph(files)) == ["orca_lab/engine/batch.py", "orca_lab/engine/request.py",
                                   "orca_lab/engine/batch.py"]
    files["orca_lab/engine/request.py"] = "def f():\n    pass\n"
    assert cycle(graph(files)) is None
    assert unplaced({"orca_lab/caching/radix.py": "", "orca_lab/engine/batch.py": ""}, layers()) == \
        ["orca_lab/caching/radix.py"]


def test_every_module_says_what_it_is():
    """A reader opening any module learns its job from its first line."""
    import ast
    bare = [rel for rel, src in package_files().items() if not ast.get_docstring(ast.parse(src))]
    assert not bare, f"modules without a docstring: {bare}"


def test_no_file_points_outside_the_repository():
    """The project stands on its own: no file refers to the folder beside the checkout where its
    authors kept their notes (the paper and the plan now live in docs/)."""
    needle = "../" + "shared"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    bad = [f for f in files if (ROOT / f).is_file() and needle in (ROOT / f).read_text(errors="ignore")]
    assert not bad, bad
