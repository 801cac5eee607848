"""kvserve's modules import each other without cycles, counting imports inside functions and
under TYPE_CHECKING: a cycle hidden in a function still ties two modules' designs together.

The attention-backend registry is the one allowed exception (ALLOWED_EDGES): it imports the
backends it chooses from, and they import the layer that uses the registry's reference backend.
Module names are written as the repository's folders name them (`engine.core.scheduler`); the
installed package prefixes them with `kvserve.`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "models", "server", "loadtest")
ALLOWED_EDGES = {
    ("models.attention.backend", f"models.attention.{name}")
    for name in ("layer", "torch_ref", "cpu", "triton")
}


def module_files() -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Every kvserve module `path` imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name.removeprefix("kvserve.") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            base = base.removeprefix("kvserve.") if base != "kvserve" else ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    graph = {name: imported_modules(name, path, known) for name, path in files.items()}
    for name in graph:  # importing a.b.c runs a/__init__ and a/b/__init__: not an edge we design
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    return {
        name: {t for t in targets if (name, t) not in ALLOWED_EDGES}
        for name, targets in graph.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, sccs, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        scc.append(top)
                        if top == node:
                            break
                    if len(scc) > 1:
                        sccs.append(sorted(scc))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sccs


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (each line one strongly connected set):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )
