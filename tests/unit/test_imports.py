"""The package's import graph has no cycle: every `import` and `from ... import` statement,
also those inside functions (a lazy import that closes a cycle only moves the failure to run
time), between modules of torchtitan_ablate. A package counts as its `__init__` module, and
importing `a.b.c` imports `a` and `a.b` first, so those edges count too."""

import ast
from pathlib import Path

PACKAGE = "torchtitan_ablate"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imported(name: str, modules: dict[str, Path]) -> set[str]:
    """`name` and the packages above it that exist in the package (what Python imports)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= _imported(alias.name, modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_package else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                edges |= _imported(base, modules)
                for alias in node.names:  # `from pkg import module`
                    edges |= _imported(f"{base}.{alias.name}", modules)
        # A module's own packages are imported before it and never import it back here.
        graph[name] = {e for e in edges if e != name and not name.startswith(e + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.train" in graph
    assert f"{PACKAGE}.build" in graph[f"{PACKAGE}.train"]


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_tools_never_import_the_trainer():
    """They build through build.py; the trainer only adds what training alone needs."""
    graph = import_graph()
    trainer = f"{PACKAGE}.train"
    tools = (f"{PACKAGE}.estimator", f"{PACKAGE}.ablate", f"{PACKAGE}.build", f"{PACKAGE}.step")
    for name, edges in graph.items():
        if name.startswith(tools):
            assert trainer not in edges, f"{name} imports the trainer"
    for script in (ROOT.parent / "scripts").glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                assert trainer not in names, f"scripts/{script.name} imports the trainer"


# The package's floors, lowest first: a module imports only its own floor and those below.
# Run modes (train, seed_checkpoint, launch, cli) sit above the build path; the ablation runner
# on top. A model's parallelize.py is the one door from models/ up to the techniques.
FLOORS = (
    ("config", "library_warnings", "cuda_allocator"),  # the last two: stdlib only
    ("models",),
    ("distributed",),
    ("components",),
    ("layout", "build", "run_checkpoint"),
    ("step",),
    ("estimator",),
    ("train", "seed_checkpoint", "launch", "cli"),
    ("ablate",),
)


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def floor_of(module: str) -> int:
    unit = _unit(module)
    return next(i for i, units in enumerate(FLOORS) if unit in units)


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in import_graph() if m != PACKAGE}
    assert units <= {u for floor in FLOORS for u in floor}, "give each new top-level unit a floor"


def test_imports_go_down_the_floors():
    graph = import_graph()
    bad = []
    for name, edges in graph.items():
        if name == PACKAGE:
            continue
        door = name.startswith(f"{PACKAGE}.models.") and name.endswith(".parallelize")
        for edge in edges:
            if edge == PACKAGE or floor_of(edge) <= floor_of(name):
                continue
            if door and _unit(edge) in ("distributed", "components"):
                continue
            bad.append(f"{name} -> {edge}")
    assert not bad, "imports going up a floor:\n" + "\n".join(sorted(bad))


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_private_name_crosses_a_module():
    """A name another module needs is public; a private one stays with its module."""
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "scripts").glob("*.py")]
    bad = [f"{p.relative_to(ROOT.parent)}: {n}" for p in files for n in _private_imports(p)]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
