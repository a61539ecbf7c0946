"""Reading and writing configs: YAML files (with YAML 1.2's booleans), ``--option value`` overrides, the dump in
``config.yaml`` and the option reference ``docs/options.md``."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from fastgrpo.config.grpo import GRPOConfig
from fastgrpo.paths import read_text


class YAMLLoader(yaml.SafeLoader):
    """YAML with the booleans of YAML 1.2: only true and false (any case). YAML 1.1 also reads on, off, yes and no
    as booleans, which would turn ``speculation.mode: off`` into False."""


YAML11_BOOLEANS = {"yes": True, "on": True, "no": False, "off": False}  # still read so for boolean options
YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's type annotation, converting where YAML is loose (int for float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if origin is list:
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return [_coerce(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no decimal point) as a string
            return float(value)
        except ValueError:
            pass
    if annotation is bool and isinstance(value, str) and value.lower() in YAML11_BOOLEANS:
        return YAML11_BOOLEANS[value.lower()]
    if annotation in (int, float, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ValueError(f"{name} must be of type {annotation.__name__}, got {value!r}")
    return value


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, refusing unknown keys and ill-typed values."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"unknown option {prefix}{key}{hint}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ValueError(f"{prefix}{key} must be a mapping of options, got {value!r}")
            kwargs[key] = _build(hints[key], value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, value, hints[key])
    return cls(**kwargs)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``--a.b value`` / ``--a.b=value`` pairs into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected an option like --learning_rate 1e-5, got {arg!r}")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"option {arg} needs a value")
            key, raw = arg[2:], args[i + 1]
            i += 2
        node = out
        *parents, leaf = key.replace("-", "_").split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = yaml.load(raw, Loader=YAMLLoader) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ValueError(f"--{key}: {raw!r} is not a YAML value ({getattr(e, 'problem', e)})") from None
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GRPOConfig:
    """Read a YAML config (optional), apply ``--option value`` overrides, build and validate."""
    return build_config(read_options(path, overrides))


def build_config(values: dict[str, Any], defaults: dict[str, Any] | None = None) -> GRPOConfig:
    """The validated config of ``values`` (nested plain data, as `read_options` gives); ``defaults`` (nested the
    same way) replace the options' own defaults where ``values`` does not set them."""
    config = _build(GRPOConfig, _merge(defaults or {}, values))
    config.validate()
    return config


def read_options(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The options a YAML config (optional) and ``--option value`` overrides set, as nested plain data."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {path} " + ("is a directory, not a file" if path.is_dir() else "does not exist")
            )
        try:
            values = yaml.load(read_text(path), Loader=YAMLLoader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a mapping of options")
    return _merge(values, parse_overrides(overrides or []))


def config_to_dict(config: GRPOConfig) -> dict[str, Any]:
    """The options as plain data (what ``config.yaml`` holds); a reward function given as a callable is written as
    ``module:name``."""
    values = dataclasses.asdict(config)
    values["reward_funcs"] = [
        f if isinstance(f, str) else f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', type(f).__name__)}"
        for f in config.reward_funcs
    ]
    return values


def yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (``null``, ``false``, ``[accuracy]``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def option_rows(cls: type = GRPOConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, help)`` of every option in declaration order, nested ones dotted
    (``dataset.name``)."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += option_rows(type(default), f"{prefix}{f.name}.")
            continue
        help_ = f.metadata["help"]
        if "choices" in f.metadata:
            help_ += " (" + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + ")"
        if "valid" in f.metadata:
            help_ += f"; valid: {f.metadata['valid']}"
        rows.append((prefix + f.name, str(f.type), default, help_))
    return rows


def options_markdown() -> str:
    """The option reference, ``docs/options.md``: ``python -m fastgrpo.config > docs/options.md`` writes it."""
    lines = [
        "# Options",
        "",
        "Every option of `fastgrpo train` (and of `eval` and `draft train`, which read the same config), as a YAML key",
        "(nested ones as mappings: `dataset: {name: gsm8k}`) or on the command line (`--learning_rate 1e-5`,",
        "`--dataset.name gsm8k`); the command line wins. Names follow TRL's `GRPOConfig` where TRL has the option.",
        "This page is generated from the config dataclasses by `python -m fastgrpo.config > docs/options.md`.",
        "",
        "| option | type | default | what it does |",
        "|---|---|---|---|",
    ]
    for name, type_, default, help_ in option_rows():
        lines.append(f"| `{name}` | `{type_.replace(' | ', ' or ')}` | `{yaml_value(default)}` | {help_} |")
    return "\n".join(lines) + "\n"
