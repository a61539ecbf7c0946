"""YAML as fastgrpo reads option files: `YAMLLoader` takes YAML 1.2's booleans only (``speculation.mode: off`` stays
the text ``off``) and refuses a mapping that holds a key twice (`DuplicateKeyError`, naming the key and both lines);
`YAML11_BOOLEANS` are the YAML 1.1 words still read as booleans for boolean options."""

from __future__ import annotations

import re
from typing import Any

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document holds the same key twice (YAML forbids it; PyYAML would keep the last value)."""

    def __init__(self, key: str, first: int, second: int):
        lines = f"line {first}" if first == second else f"lines {first} and {second}"
        self.problem = f"{key} appears twice, on {lines}"
        super().__init__(self.problem)


def _check_unique_keys(node: yaml.Node, prefix: str = "", visited: set[int] | None = None) -> None:
    """Raise `DuplicateKeyError` at the first key that a mapping of ``node`` (or of its children) holds twice, named
    dotted from the document's top (``speculation.mode``; in an item of a list ``stop[1].key``)."""
    visited = set() if visited is None else visited
    if id(node) in visited:  # an alias of a node already checked (a recursive one included)
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, f"{prefix.removesuffix('.')}[{index}].", visited)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):  # a mapping or list as a key: no option has one
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in seen:
            raise DuplicateKeyError(f"{prefix}{key.value}", seen[key.tag, key.value], line)
        seen[key.tag, key.value] = line
        _check_unique_keys(value, f"{prefix}{key.value}.", visited)


class YAMLLoader(yaml.SafeLoader):
    """YAML with the booleans of YAML 1.2: only true and false (any case). YAML 1.1 also reads on, off, yes and no
    as booleans, which would turn ``speculation.mode: off`` into False. A mapping that holds a key twice is refused
    (`DuplicateKeyError`), as YAML says, rather than read with the last value."""

    def construct_document(self, node: yaml.Node) -> Any:
        _check_unique_keys(node)
        return super().construct_document(node)


YAML11_BOOLEANS = {"yes": True, "on": True, "no": False, "off": False}  # still read so for boolean options
YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
