"""The layers the code holds (issue 23, item 3): read from memfit's own imports, not from a picture.

Every import of a memfit module is read from the source with ``ast``: top-level ones and those inside
functions (which hide a dependency from a reader, not from the import graph), relative ones resolved.
``from pkg import name`` counts as an import of ``pkg.name`` where that is a module, else of ``pkg``.
Two contracts:

- ``memory/`` and ``planning/`` never import ``training/``: estimate and plan must run without the
  trainer, and a rule both need (is this run sharded, what an engine refuses, the sample budget) lives
  below both (``memfit.spec.engines``, ``memory/``), where training reads it.
- No import cycle among memfit's modules: every module can be read, tested and moved knowing only
  what is below it.

And a ratchet toward the third: ``cli/`` reaches only the public API (``memfit``'s own functions and the
settings, errors and units they take and give) and ``report/``; the reaches it has today are listed and
no new one may be added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: The packages of memfit, lowest first (the picture in README.md's "Architecture"): a package imports
#: only those listed before it (and the leaves ``errors``, ``units``, ``files``). ``cli/`` and the
#: package's own ``__init__`` (the lazy public API) sit on top.
LAYERS = ("integrations", "settings", "spec", "data", "builder", "memory", "report", "planning", "interop", "training", "cli")
LEAVES = ("memfit.errors", "memfit.units", "memfit.files", "memfit.textfiles")


#: What ``cli/`` may import: the public API (``memfit.estimate/trace/plan/train``), the settings (and
#: their schema, from which the flags are built) and errors they take and raise, units, and the renderers.
CLI_MAY_IMPORT = ("memfit", "memfit.settings.config", "memfit.settings.defaults", "memfit.errors", "memfit.settings.schema", "memfit.units")
CLI_MAY_IMPORT_PACKAGES = ("memfit.cli", "memfit.report")

#: Reaches of ``cli/`` past the public API today: debt (issue 23, item 3), to be moved behind the API
#: (a function of ``memfit`` or ``report/``), then taken off this list. Do not add to it.
CLI_KNOWN_REACHES = frozenset({
    "memfit.data.formats", "memfit.data.prep", "memfit.files", "memfit.integrations.hf_compat", "memfit.integrations.hub",
    "memfit.memory.estimate", "memfit.memory.snapshot", "memfit.memory.trace", "memfit.spec.model",
    "memfit.planning.gpus", "memfit.planning.launch", "memfit.planning.search", "memfit.planning.space",
    "memfit.planning.table", "memfit.integrations.trackers", "memfit.training.equivalence", "memfit.training.loop",
    "memfit.training.progress", "memfit.training.setup", "memfit.training.summary", "memfit.settings.validate",
})


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


def test_cli_reaches_no_further_than_today(graph):
    new = [f"{a}:{line} imports {b}" for a, edges in sorted(graph.items()) if a.startswith("memfit.cli")
           for b, line in sorted(edges.items())
           if b not in CLI_MAY_IMPORT and not b.startswith(CLI_MAY_IMPORT_PACKAGES) and b not in CLI_KNOWN_REACHES]
    assert not new, ("cli/ calls the public API (memfit.estimate/trace/plan/train) and report/ only; "
                     "put what it needs behind them: " + "; ".join(new))


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

