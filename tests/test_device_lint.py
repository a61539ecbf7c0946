"""Every tensor fastgrpo makes is made where it is used: each call of a torch tensor factory in the package names its
device, ``device="cpu"`` where a host tensor is meant. A factory without one makes a CPU tensor, which on a GPU fails
at the first operation that meets a CUDA tensor (or silently copies at every step). Checked by reading the source
with ``ast``, so it needs no GPU."""

from __future__ import annotations

import ast
from pathlib import Path

import fastgrpo

ROOT = Path(fastgrpo.__file__).parent

# torch functions that make a new tensor (or a generator) on the default device unless told otherwise; those that
# take their device from a tensor argument (``zeros_like``, ``Tensor.new_zeros``, ...) are fine as they are.
FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "empty_strided",
    "eye",
    "full",
    "Generator",
    "linspace",
    "logspace",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "range",
    "tensor",
    "zeros",
}


def deviceless_factories(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each ``torch.<factory>(...)`` call in ``source`` without a ``device`` argument."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and not any(k.arg == "device" or k.arg is None for k in node.keywords)  # None: a **kwargs splat
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_every_tensor_factory_in_the_package_names_its_device() -> None:
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 30
    bad = [
        f"{path.relative_to(ROOT.parent)}:{line}: {call}"
        for path in files
        for line, call in deviceless_factories(path.read_text())
    ]
    assert not bad, "tensor factories without a device (add device=..., or device='cpu' for a host tensor):\n" + (
        "\n".join(bad)
    )


def test_the_lint_catches_a_planted_deviceless_factory() -> None:
    """The profiler's old draft-level mask, planted into the engine's source, is reported; the same call with a
    device, and a ``*_like`` factory, are not."""
    engine = (ROOT / "rollout" / "engine.py").read_text()
    planted = engine + "\n\ndef planted():\n    return torch.ones(1, 1, dtype=torch.bool)\n"
    assert [call for _, call in deviceless_factories(planted)] == ["torch.ones(1, 1, dtype=torch.bool)"]
    fine = "import torch\nx = torch.ones(1, 1, dtype=torch.bool, device=d)\ny = torch.zeros_like(x)\n"
    assert deviceless_factories(fine) == []
