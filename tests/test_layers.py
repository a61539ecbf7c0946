"""fastgrpo's packages import in one direction only: a module may import its own layer and the layers below it,
never one above. Checked by reading every module's imports (top-level and inside functions) with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import fastgrpo

ROOT = Path(fastgrpo.__file__).parent

# Bottom to top. A module's layer is that of its longest listed prefix.
LAYERS = [
    [
        "fastgrpo.errors",
        "fastgrpo.fields",
        "fastgrpo.machine",
        "fastgrpo.sampling_params",
        "fastgrpo.distributed",
        "fastgrpo.threads",
        "fastgrpo.device_memory",
        "fastgrpo.precision",
        "fastgrpo.paths",
        "fastgrpo.malloc",
        "fastgrpo.state_files",
    ],
    ["fastgrpo.models"],
    [
        "fastgrpo.answers",
        "fastgrpo.rewards",
        "fastgrpo.reward_model",
        "fastgrpo.reward_calls",
        "fastgrpo.data",
        "fastgrpo.config",
        "fastgrpo.memory",
        "fastgrpo.tools",
    ],
    ["fastgrpo.rollout"],
    ["fastgrpo.speculative"],
    ["fastgrpo.training_rollouts", "fastgrpo.memory_plan"],
    ["fastgrpo.grpo", "fastgrpo.report"],
    ["fastgrpo.integrations", "fastgrpo.cli", "fastgrpo.commands", "fastgrpo.__main__"],
]


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), rank)
        for rank, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def fastgrpo_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a fastgrpo module in the file (``from fastgrpo import distributed``
    imports ``fastgrpo.distributed``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fastgrpo"):
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node.lineno, n) for n in [node.module, *filter(_is_module, submodules)]]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("fastgrpo")]
    return [(line, name) for line, name in found if name != "fastgrpo"]


def _is_module(name: str) -> bool:
    path = ROOT.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_module_imports_only_its_layer_and_those_below() -> None:
    modules = [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "__init__.py"]  # the empty package root
    assert len(modules) > 30
    upward = []
    for path in modules:
        name = module_name(path)
        own = layer_of(name)
        for line, imported in fastgrpo_imports(path):
            if layer_of(imported) > own:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({name}) imports {imported}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a module of the rollout layer importing from grpo is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from fastgrpo.grpo.trainer import GRPOTrainer\n")
    assert [name for _, name in fastgrpo_imports(bad)] == ["fastgrpo.grpo.trainer"]
    assert layer_of("fastgrpo.grpo.trainer") > layer_of("fastgrpo.rollout.engine")


# -- no import cycles, no long files -------------------------------------------------------------------------------

MAX_LINES = 400  # a library file longer than this holds more than one concern: split it


def library_files() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def import_graph() -> dict[str, set[str]]:
    """Each fastgrpo module (a package's ``__init__`` as the package) and the fastgrpo modules it imports anywhere
    in its file: at the top, inside functions and under ``TYPE_CHECKING``."""
    graph: dict[str, set[str]] = {}
    for path in library_files():
        name = module_name(path)
        graph.setdefault(name, set()).update(imported for _, imported in fastgrpo_imports(path) if imported != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm), as the modules in import
    order with the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for group in groups:
        start = min(group)
        path, seen = [start], {start}
        while True:  # follow edges inside the group until a module repeats
            nxt = min(m for m in graph[path[-1]] if m in group)
            if nxt in seen:
                found.append(path[path.index(nxt) :] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    assert len(graph) > 30
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_check_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    """The checker itself: imports inside functions and under TYPE_CHECKING count, and a cycle through a package's
    ``__init__`` is reported with its modules."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastgrpo.config import GRPOConfig\n"
        "def f():\n    from fastgrpo.grpo import trainer\n"
    )
    assert [name for _, name in fastgrpo_imports(module)] == [
        "fastgrpo.config",
        "fastgrpo.grpo",
        "fastgrpo.grpo.trainer",
    ]
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_library_file_is_longer_than_the_limit() -> None:
    lengths = {path: len(path.read_text().splitlines()) for path in library_files()}
    long = [f"{path.relative_to(ROOT.parent)}: {n} lines" for path, n in lengths.items() if n > MAX_LINES]
    assert not long, f"library files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)
