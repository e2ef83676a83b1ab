"""The package's imports run one way, down the floors, with no cycles (docs/layout.md states the rule).

Every module under deepserve/ is parsed with `ast` (nothing is imported or run); each `import` or
`from ... import` of a deepserve module, at any depth in the file (function-local imports count too:
they are still a dependency), becomes an arrow. The test fails on
- an arrow from a lower floor to a higher one (kernels -> layers, worker -> engine, ...),
- an import of another module's underscore name (`from deepserve.layers.attention import _x`),
- any cycle between modules, whatever their floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "deepserve"

# Floor of each top-level room, low to high (docs/layout.md): a module may import modules of its own floor or
# below. The leaves (envs, version, sampling_params) import nothing of deepserve above themselves; the loader reads
# checkpoint formats (GGUF, FP8 scales) and builds no model, so models and config sit above it.
FLOORS: dict[str, int] = {
    "envs": 0,
    "version": 0,
    "lazy": 0,
    "kernels": 1,           # Triton kernels, their PyTorch twins (kernels/reference), CPU C kernels
    "loader": 1,            # checkpoint formats
    "sampling_params": 1,
    "structured": 1,        # grammar specs (read by sampling_params), bitmask (sampler), matchers (engine)
    "eplb": 1,              # the EPLB policy: a pure torch function of expert statistics
    "layers": 2,
    "config": 3,
    "models": 4,
    "sequence": 5,
    "outputs": 5,
    "tokenizer": 5,
    "worker": 6,
    "parallel": 6,          # torch.distributed pieces the engine uses (DP step votes)
    "spec_decode": 6,       # drafters, verifier, verification-length policy: the engine and the worker call them
    "kvstore": 6,           # the KV store's tiers (memory, disk, Redis) and codec; the engine drives it
    "engine": 7,
    "llm": 8,
    "serving": 8,
    "router": 8,            # the router process: serving's auth / rate limit / errors, no engine, no torch
    "bench": 8,
    "tools": 8,
    "cli": 9,
    "__main__": 10,
    "__init__": 10,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def room_of(module: str) -> str:
    """`deepserve.kernels.cpu.build` -> "kernels"; the package itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute module name of a (possibly relative) import inside module `current`."""
    if level == 0:
        return target or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, str | None]]:
    """(imported deepserve module, line, imported name or None) for each import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepserve" or alias.name.startswith("deepserve."):
                    found.append((alias.name, node.lineno, None))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(module, is_package, node.level, node.module)
            if base != "deepserve" and not base.startswith("deepserve."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:       # `from deepserve.kernels import cpu`: the arrow goes to the module
                    found.append((sub, node.lineno, None))
                else:
                    found.append((base, node.lineno, alias.name))
    return found


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    known = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    underscore = []
    for module, path in known.items():
        for target, line, name in imports_of(module, path, known):
            if target not in known:
                raise AssertionError(f"{module}:{line} imports {target}, which is not a module of the package")
            if target != module:
                graph[module].add(target)
            if name is not None and name.startswith("_") and not name.startswith("__"):
                underscore.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports "
                                  f"{target}.{name}, another module's private name")
    return graph, underscore


def test_every_room_has_a_floor():
    rooms = {room_of(m) for m in all_modules()}
    assert rooms <= set(FLOORS), f"rooms without a floor in FLOORS: {sorted(rooms - set(FLOORS))}"


def test_imports_run_down_the_floors():
    graph, _ = import_graph()
    upward = []
    for module, targets in graph.items():
        for target in targets:
            # A package's __init__ re-exports its own modules; it is its room's door, not a floor above it.
            if FLOORS[room_of(target)] > FLOORS[room_of(module)] and room_of(module) != "__init__":
                upward.append(f"{module} ({room_of(module)}) -> {target} ({room_of(target)})")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_module_imports_another_modules_underscore_names():
    _, underscore = import_graph()
    assert not underscore, "\n".join(underscore)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (as a closed path), or None. Iterative DFS with colours."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if colour[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        colour[root] = GREY
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = BLACK
                stack.pop()
            elif colour[child] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif colour[child] == WHITE:
                colour[child] = GREY
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_no_import_cycle():
    graph, _ = import_graph()
    # A package's __init__ importing its submodules, which import the package back for a sibling, is the
    # usual re-export pattern and still a cycle: submodules must import siblings by their module path.
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, has_cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, False),
])
def test_find_cycle_finds_cycles(graph, has_cycle):
    assert (find_cycle(graph) is not None) == has_cycle


def test_relative_imports_resolve():
    assert resolve("deepserve.kernels.gemv", False, 1, "pdl") == "deepserve.kernels.pdl"
    assert resolve("deepserve.kernels", True, 1, "pdl") == "deepserve.kernels.pdl"
    assert resolve("deepserve.kernels.cpu.build", False, 2, "pdl") == "deepserve.kernels.pdl"
    assert resolve("deepserve.kernels.gemv", False, 2, None) == "deepserve"
