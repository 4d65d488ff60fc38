"""The package's import graph, read with `ast` (every import, including those inside functions): no cycle, and no
import from a lower layer to a higher one. The layers, lowest first, are the design (docs/ARCHITECTURE.md,
"Layout"): a module may import its own layer and the ones below."""

from __future__ import annotations

import ast
from pathlib import Path

import batchrl

PACKAGE = Path(batchrl.__file__).resolve().parent

LAYERS = [
    ["batchrl", "batchrl.errors", "batchrl.references"],  # the version, the user errors, 'module:function' lookup
    ["batchrl.algorithms", "batchrl.config"],  # pure functions of arrays; the validated config
    ["batchrl.storage"],  # URIs, Parquet, manifests and schemas: the storage formats
    # components
    ["batchrl.agents", "batchrl.engines", "batchrl.rewards", "batchrl.sandbox", "batchrl.tracking", "batchrl.trainer"],
    ["batchrl.pipeline"],  # the stage contract, shards, the runner: knows no stage
    ["batchrl.stages"],  # the stages, registered in run order
    ["batchrl.api", "batchrl.setup_steps"],  # plan and run with the built-in stages; the pipeline's setup: steps
    ["batchrl.cli"],
]


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("batchrl",) + path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The batchrl modules ``name`` imports (a ``from package import module`` counts as importing the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer if top != "batchrl"):
            return index
    assert module == "batchrl", f"{module} is in no layer: add its package to LAYERS (and to docs/ARCHITECTURE.md)"
    return 0


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` (as the list of nodes around it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} -> {b}" for a, deps in graph().items() for b in deps if layer_of(b) > layer_of(a)]
    assert upward == []


def test_the_modules_import_no_cycle():
    assert cycle_in(graph()) is None


def test_the_packages_import_no_cycle():
    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for a, deps in graph().items():
        edges.setdefault(top(a), set()).update(top(b) for b in deps if top(b) != top(a))
    assert cycle_in(edges) is None


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": {"c"}}) is None
    assert layer_of("batchrl.pipeline.runner") > layer_of("batchrl.storage.manifest")
    assert "batchrl.pipeline.stage" in graph()["batchrl.stages.score"]  # `from x import y` is seen


def test_the_product_never_imports_the_quickstart_toy():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] == "batchrl_toy" for name in names), path


def test_the_runner_and_the_contract_import_no_stage():
    edges = graph()
    for module in ("batchrl.pipeline.runner", "batchrl.pipeline.stage"):
        assert not any(dep.startswith("batchrl.stages") for dep in edges[module])
