"""The layers the code holds (issue 23, item 3): read from memfit's own imports, not from a picture.

Every import of a memfit module is read from the source with ``ast``: top-level ones and those inside
functions (which hide a dependency from a reader, not from the import graph), relative ones resolved.
``from pkg import name`` counts as an import of ``pkg.name`` where that is a module, else of ``pkg``.
The lazy table of the public API (``memfit._PUBLIC``: name -> (module, name)) counts as the imports it makes.
Three contracts:

- ``memory/`` and ``planning/`` never import ``training/``: estimate and plan must run without the
  trainer, and a rule both need (is this run sharded, what an engine refuses, the sample budget) lives
  below both (``memfit.spec.engines``, ``memory/``), where training reads it.
- No import cycle among memfit's modules: every module can be read, tested and moved knowing only
  what is below it.
- ``cli/`` reaches only the public API (``memfit``'s names, ``memfit._PUBLIC``), the settings, errors,
  units and files they take and give, and ``report/``'s renderers: a command is flags in, API call, output,
  and what it needs from below becomes a public name first.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: The packages of memfit, lowest first (the picture in README.md's "Architecture"): a package imports
#: only those listed before it (and the leaves ``errors``, ``units``, ``files``). ``cli/`` and the
#: package's own ``__init__`` (the lazy public API) sit on top.
LAYERS = ("integrations", "settings", "spec", "data", "builder", "memory", "report", "planning", "interop", "training", "web", "cli")
LEAVES = ("memfit.errors", "memfit.units", "memfit.files", "memfit.textfiles")


#: What ``cli/`` may import besides ``memfit.cli`` itself: the public API (the package ``memfit``, whose names
#: are ``_PUBLIC``), the leaves (errors it catches, units it prints, ``files.write_text_atomic`` for what a
#: command writes itself: leaves import nothing of memfit, so they reach past nothing), the settings (the
#: API's input: a command builds ``RunConfig``/``TrainConfig`` from its flags with ``schema``, reads
#: ``--config`` and checks a flag or an output path with ``validate`` before any work) and ``report/`` (the
#: renderers of the API's results).
CLI_MAY_IMPORT = ("memfit", *LEAVES)
CLI_MAY_IMPORT_PACKAGES = ("memfit.cli", "memfit.report", "memfit.settings")


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the memfit package."""
    out = {}
    for path in (src / "memfit").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """``{module: {imported memfit module: first line}}``, in-function and relative imports included."""
    modules = _modules(src)

    def owner(name: str) -> str | None:  # the innermost memfit module that ``name`` lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _is_lazy_table(node):  # memfit._PUBLIC: each entry imports its module when first used
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    edges.setdefault(owner(ast.literal_eval(value)[0]), key.lineno)
                continue
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: drop (level - 1) trailing packages of this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else owner(base)
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def _is_lazy_table(node: ast.AST) -> bool:
    """``_PUBLIC = {...}``: the public API's lazy table (``memfit/__init__.py``)."""
    return (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in node.targets))


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """The modules of a cycle and the imports that close it (``a:line -> b``)."""
    members = set(component)
    edges = [f"{a}:{line} -> {b}" for a in component for b, line in sorted(graph[a].items()) if b in members]
    return f"{', '.join(component)} ({'; '.join(edges)})"


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_memory_and_planning_never_import_training(graph):
    bad = [f"{a}:{line} imports {b}" for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
           if a.startswith(("memfit.memory", "memfit.planning")) and b.startswith("memfit.training")]
    assert not bad, ("memory/ and planning/ must not import training/; move the shared rule below both "
                     "(memfit.spec.engines, memory/): " + "; ".join(bad))


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_package_imports_only_the_layers_below_it(graph):
    """The layout is the architecture: spec/ never reaches data/, data/ never reaches memory/, and so on."""
    bad = []
    for a, edges in sorted(graph.items()):
        low = _package(a)
        for b, line in sorted(edges.items()):
            high = _package(b)
            if low and high and LAYERS.index(high) > LAYERS.index(low):
                bad.append(f"{a}:{line} imports {b}")
            if low is None and a not in ("memfit", "memfit.__main__", "memfit.cli") and b not in LEAVES:
                bad.append(f"{a}:{line} (a top-level leaf) imports {b}")
    assert not bad, "an import against the layers " + " < ".join(LAYERS) + ": " + "; ".join(bad)


def test_the_top_level_holds_entry_points_and_leaves_only():
    loose = sorted(p.stem for p in (SRC / "memfit").glob("*.py"))
    assert loose == ["__init__", "__main__", "errors", "files", "textfiles", "units"], loose


def test_no_import_cycle(graph):
    found = cycles(graph)  # issue 23: zero, none allowed
    assert not found, "import cycles among memfit's modules: " + " | ".join(_describe(c, graph) for c in found)


def test_cli_reaches_only_the_public_api_the_settings_and_report(graph):
    past = [f"{a}:{line} imports {b}" for a, edges in sorted(graph.items()) if a.startswith("memfit.cli")
            for b, line in sorted(edges.items())
            if b not in CLI_MAY_IMPORT and not any(b == p or b.startswith(p + ".") for p in CLI_MAY_IMPORT_PACKAGES)]
    assert not past, ("cli/ calls the public API (memfit's names: memfit._PUBLIC), the settings and report/ only; "
                      "make what it needs a public name (or, if it renders, a function of report/): " + "; ".join(past))


def test_every_public_name_resolves_and_is_documented():
    """Each name of the lazy table imports (a module or attribute misspelt there fails here, not in a user's
    command) and is in the package docstring, the public API's list; an unknown name is an AttributeError."""
    import memfit

    undocumented = [name for name in memfit._PUBLIC if getattr(memfit, name) is not None
                    and f"``{name}" not in memfit.__doc__]
    assert not undocumented, "public names missing from memfit's docstring: " + ", ".join(undocumented)
    assert set(memfit.__all__) == {"__version__", *memfit._PUBLIC}
    assert not hasattr(memfit, "run_training")


def test_import_memfit_and_help_load_no_torch():
    """The public API is lazy: ``import memfit`` and ``memfit --help`` import no torch (a fresh interpreter:
    this session's has torch already)."""
    code = ("import sys, memfit; from memfit.cli import cli\n"
            "try:\n    cli.main(args=['--help'], prog_name='memfit')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'memfit.memory.estimate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr[-500:]


def test_the_walk_sees_in_function_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import close a cycle it names."""
    pkg = tmp_path / "memfit"
    (pkg / "memory").mkdir(parents=True)
    (pkg / "training").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "memory" / "__init__.py").write_text("")
    (pkg / "training" / "__init__.py").write_text("")
    (pkg / "memory" / "a.py").write_text("def f():\n    from memfit.training.b import g\n")
    (pkg / "training" / "b.py").write_text("from ..memory import a\n")
    fake = import_graph(tmp_path)
    assert fake["memfit.memory.a"] == {"memfit.training.b": 2}
    assert fake["memfit.training.b"] == {"memfit.memory.a": 1}
    assert cycles(fake) == [["memfit.memory.a", "memfit.training.b"]]
    assert "memfit.memory.a:2 -> memfit.training.b" in _describe(cycles(fake)[0], fake)


#: Over these, a module says why in a paragraph of its docstring that starts with "Size:" (issue 23, item 5).
MODULE_LINES, FUNCTION_LINES = 500, 60


def private_uses(src: Path = SRC) -> list[str]:
    """``module:line name`` for each private name (``_x``, not dunder) of another memfit module that a module
    imports (``from memfit.a import _x``) or reaches through a module it imported (``a_module._x``)."""
    modules = _modules(src)
    found = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        imported = {}  # local name -> the memfit module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memfit"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{module}:{node.lineno} {node.module}.{alias.name}")
                    elif f"{node.module}.{alias.name}" in modules:
                        imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                imported.update({alias.asname: alias.name for alias in node.names
                                 if alias.asname and alias.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{module}:{node.lineno} {imported[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names(tmp_path):
    """A name with a leading underscore is its module's own: another module that needs it gets a public name."""
    assert not private_uses(), "make these public (or keep them in their module): " + "; ".join(private_uses())
    (tmp_path / "memfit" / "a").mkdir(parents=True)  # the scan sees both spellings
    (tmp_path / "memfit" / "a" / "__init__.py").write_text("")
    (tmp_path / "memfit" / "a" / "b.py").write_text("def _x():\n    pass\n")
    (tmp_path / "memfit" / "a" / "c.py").write_text("from memfit.a import b as bee\nfrom memfit.a.b import _x\n"
                                                   "bee._x()\n")
    assert private_uses(tmp_path) == ["memfit.a.c:2 memfit.a.b._x", "memfit.a.c:3 memfit.a.b._x"]


def test_long_modules_and_functions_say_why():
    """A module over 500 lines, or with a function over 60, explains itself: readable arithmetic is the
    default, and the exceptions are decisions a reader can see (and a reviewer can question)."""
    silent = []
    for module, path in sorted(_modules().items()):
        text = path.read_text()
        tree = ast.parse(text)
        long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
        lines = len(text.splitlines())
        if (lines > MODULE_LINES or long) and "\nSize: " not in (ast.get_docstring(tree) or ""):
            silent.append(f"{module} ({lines} lines; {', '.join(long) or 'no long function'})")
    assert not silent, ("split these, or say why not in a 'Size:' paragraph of the module docstring: "
                        + "; ".join(silent))

