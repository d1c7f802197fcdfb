"""The project's modules import one way: no cycle among server/, engine/ and triton_kernels/.

The graph is read from the source with `ast`, never by importing (no torch here), and counts every import:
at module level, inside functions, `from pkg import submodule`, and relative ones. A module's edges go to
the deepest project module each import names. The parent packages such an import also runs are left out:
the project's __init__ files are empty, so they close no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Container, Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> package, as pyproject.toml's package-dir installs them
ROOTS = {"server": "vegaserve.server", "engine": "vegaserve.engine", "triton_kernels": "vegaserve.triton_kernels"}


def project_modules(repo: Path, roots: Mapping[str, str] = ROOTS) -> dict[str, Path]:
    """Module name -> file, for every .py under the roots (a package's name maps to its __init__.py)."""
    modules: dict[str, Path] = {}
    for folder, package in roots.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = path.relative_to(repo / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules: Container[str]) -> set[str]:
    """The project modules that the import statements anywhere in `tree` load. `from X import Y` loads X.Y
    where that is a module, else X; every name resolves to its deepest prefix that is a module; relative
    imports resolve against `module`."""
    package = module if is_package else module.rpartition(".")[0]

    def deepest(dotted: str) -> str | None:
        parts = dotted.split(".")
        return next((m for k in range(len(parts), 0, -1) if (m := ".".join(parts[:k])) in modules), None)

    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(deepest(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else deepest(base))
    return {m for m in found if m is not None and m != module}


def import_graph(repo: Path, roots: Mapping[str, str] = ROOTS) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules(repo, roots)
    return {
        name: imported_modules(ast.parse(path.read_text(), filename=str(path)), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """For every node on a cycle, a shortest cycle through it, as [a, b, ..., a] from its smallest name, each
    cycle once; [] for an acyclic graph. Tarjan's components (without recursion), then a breadth-first
    search inside each."""
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    succ = {n: sorted(graph.get(n, ())) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if work:  # v is done: its parent's low takes v's
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                components.append(sorted(comp))
    cycles: set[tuple[str, ...]] = set()
    for comp in components:
        if len(comp) == 1 and comp[0] not in succ[comp[0]]:
            continue
        for start in comp:
            ring = _shortest_cycle(start, set(comp), succ)[:-1]
            k = ring.index(min(ring))
            cycles.add((*ring[k:], *ring[:k], ring[k]))
    return sorted(list(c) for c in cycles)


def _shortest_cycle(start: str, members: set[str], succ: Mapping[str, list[str]]) -> list[str]:
    """Breadth-first from `start` back to itself inside its component."""
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in members and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its component")


def test_project_imports_have_no_cycle() -> None:
    graph = import_graph(REPO)
    assert "vegaserve.engine.engine_core" in graph  # the roots were found
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_triton_kernels_import_nothing_else_of_the_project() -> None:
    """DESIGN.md, Shape: the kernels are the bottom layer."""
    graph = import_graph(REPO)
    up = {(m, t) for m, ts in graph.items() if m.startswith("vegaserve.triton_kernels")
          for t in ts if not t.startswith("vegaserve.triton_kernels")}
    assert not up, f"triton_kernels imports upward: {sorted(up)}"


def test_cycle_finder_names_each_cycle_once_and_ignores_acyclic_parts() -> None:
    assert find_cycles({"a": ["b"], "b": ["c"], "c": [], "d": ["a", "c"]}) == []
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["e"], "f": ["g"], "g": ["f", "a"]}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"], ["f", "g", "f"]]


def test_cycle_finder_gives_the_shortest_cycle_through_each_member() -> None:
    # a -> b -> c -> d -> a and the shortcut b -> a: one component; c and d are only on the long cycle
    assert find_cycles({"a": ["b"], "b": ["c", "a"], "c": ["d"], "d": ["a"]}) == [["a", "b", "a"], ["a", "b", "c", "d", "a"]]


def test_graph_counts_function_level_relative_and_submodule_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "top.py": "def f():\n    from pkg.sub import low  # a submodule, inside a function\n",
        "mid.py": "from . import top\n",
        "leaf.py": "from .sub.low import thing\n",
        "sub/__init__.py": "from .low import thing\n",
        "sub/low.py": "import os\nthing = 1\ndef g():\n    from ..mid import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph == {
        "pkg": set(),
        "pkg.top": {"pkg.sub.low"},
        "pkg.mid": {"pkg.top"},
        "pkg.leaf": {"pkg.sub.low"},
        "pkg.sub": {"pkg.sub.low"},
        "pkg.sub.low": {"pkg.mid"},
    }
    assert find_cycles(graph) == [["pkg.mid", "pkg.top", "pkg.sub.low", "pkg.mid"]]


if __name__ == "__main__":  # print the cycles of a tree, e.g. an old commit extracted with git archive
    import sys

    for cycle in find_cycles(import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)):
        print(" -> ".join(cycle))
