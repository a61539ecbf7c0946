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
    ],
    ["fastgrpo.models"],
    [
        "fastgrpo.answers",
        "fastgrpo.rewards",
        "fastgrpo.data",
        "fastgrpo.config",
        "fastgrpo.memory.shapes",
        "fastgrpo.memory.activations",
        "fastgrpo.memory.items",
        "fastgrpo.memory",
    ],
    ["fastgrpo.rollout"],
    ["fastgrpo.speculative"],
    ["fastgrpo.training_rollouts", "fastgrpo.memory.plan", "fastgrpo.memory.fitting"],
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
