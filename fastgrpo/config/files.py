"""Reading and writing options: YAML files (read by `fastgrpo.config.yaml_loader`), ``--option value`` overrides
and the dump in ``config.yaml`` (`fastgrpo.config.reference` writes the option reference). Every command reads its
options so (`parse_options`), into the dataclasses `fastgrpo.config.commands.COMMANDS` names for it."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from fastgrpo.config.grpo import GRPOConfig
from fastgrpo.config.trl_names import read_trl_options
from fastgrpo.config.trl_script import finish_script_options, read_script_options
from fastgrpo.config.yaml_loader import YAML11_BOOLEANS, DuplicateKeyError, YAMLLoader
from fastgrpo.fields import joined
from fastgrpo.paths import expand_user, read_text


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
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {value!r}")
        return value
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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, refusing unknown keys, ill-typed values and missing required options;
    ``~`` is expanded in the options that name a path (``option(..., path=True)``)."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"unknown option {prefix}{key}{hint}")
        nested, optional = _nested_options(hints[key])
        if nested is not None and value is None and optional:
            kwargs[key] = None
        elif nested is not None:
            if not isinstance(value, dict):
                raise ValueError(f"{prefix}{key} must be a mapping of options, got {value!r}")
            kwargs[key] = _build(nested, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(prefix + key, joined(value, fields[key].metadata.get("joins")), hints[key])
            if fields[key].metadata.get("path") and isinstance(kwargs[key], str):
                kwargs[key] = expand_user(kwargs[key], prefix + key)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{prefix}{name} is required: {f.metadata.get('help', 'an option without default')}")
    return cls(**kwargs)


def _nested_options(annotation: Any) -> tuple[type | None, bool]:
    """``(the dataclass, nullable)`` of an option that holds nested options (``DataConfig`` or ``DataConfig | None``),
    ``(None, False)`` for any other."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = [a for a in args if a is not type(None)] if args else [annotation]
    if len(kinds) == 1 and isinstance(kinds[0], type) and dataclasses.is_dataclass(kinds[0]):
        return kinds[0], type(None) in args
    return None, False


def _annotation(classes: tuple[type, ...], key: str) -> Any:
    """The type of option ``key`` (dotted: ``dataset.name``) among the fields of ``classes``; None if none has it."""
    *parents, leaf = key.split(".")
    for cls in classes:
        for parent in parents:
            hint = _hints(cls).get(parent) if parent in {f.name for f in dataclasses.fields(cls)} else None
            nested, _ = _nested_options(hint)
            if nested is None:
                break
            cls = nested
        else:
            if leaf in {f.name for f in dataclasses.fields(cls)}:
                return _hints(cls)[leaf]
    return None


def _text_option(annotation: Any) -> tuple[type | None, bool]:
    """``(str or list, nullable)`` for an option of text (``str``, ``list[str]``, either or None), else
    ``(None, False)``."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = [a for a in args if a is not type(None)] if args else [annotation]
    if len(kinds) != 1:
        return None, False
    if kinds[0] is str:
        return str, type(None) in args
    if typing.get_origin(kinds[0]) is list and typing.get_args(kinds[0]) == (str,):
        return list, type(None) in args
    return None, False


def _command_line_value(key: str, raw: str, annotation: Any) -> Any:
    """The value of ``--key raw``: YAML, except that an option of text takes the text as typed (a prompt may hold
    ``: `` or ``#``); ``null`` is still None where the option allows it, a quoted value is read as YAML, a list
    option also takes a YAML list of strings (``[accuracy, format]``)."""
    if raw == "":
        return ""
    kind, nullable = _text_option(annotation)
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
    if kind is not None and not quoted:
        if nullable and raw in ("null", "Null", "NULL", "~"):
            return None
        if kind is list and raw.startswith("["):
            try:
                items = yaml.load(raw, Loader=YAMLLoader)
            except yaml.YAMLError:
                items = None
            if isinstance(items, list) and all(isinstance(item, str) for item in items):
                return items
        return raw
    try:
        return yaml.load(raw, Loader=YAMLLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"--{key}: {raw!r} is not a YAML value ({getattr(e, 'problem', e)})") from None


def parse_overrides(args: list[str], classes: tuple[type, ...] | None = None) -> dict[str, Any]:
    """Turn ``--a.b value`` / ``--a.b=value`` pairs into a nested dict; values are parsed as YAML scalars. Given the
    dataclasses the options are for, an option of text takes its text as typed, a list option given several times
    holds every value (``--prompt A --prompt B``), and the classes' ``ALIASES`` name other spellings."""
    aliases = {alias: name for cls in classes or () for alias, name in getattr(cls, "ALIASES", {}).items()}
    out: dict[str, Any] = {}
    given: set[str] = set()
    spelled: dict[str, str] = {}  # each option's name as typed (TRL's or fastgrpo's)
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
        name = key.replace("-", "_")
        typed, name = name, aliases.get(name, name)
        if spelled.setdefault(name, typed) != typed:
            raise ValueError(
                f"--{spelled[name]} and --{typed} are one option (TRL's name and fastgrpo's): give one of them"
            )
        annotation = _annotation(classes, name) if classes else None
        value = _command_line_value(key, raw, annotation)
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        listed = list in {typing.get_origin(a) for a in (annotation, *typing.get_args(annotation))}
        if name in given and listed and node.get(leaf) is not None:
            previous = node[leaf] if isinstance(node[leaf], list) else [node[leaf]]
            value = previous + (value if isinstance(value, list) else [value])
        node[leaf] = value
        given.add(name)
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GRPOConfig:
    """Read a YAML config (optional), apply ``--option value`` overrides, build and validate."""
    return parse_options((GRPOConfig,), path, overrides)[0]


def build_config(values: dict[str, Any], defaults: dict[str, Any] | None = None) -> GRPOConfig:
    """The validated config of ``values`` (nested plain data, as `read_options` gives); ``defaults`` (nested the
    same way) replace the options' own defaults where ``values`` does not set them."""
    return build_options((GRPOConfig,), values, defaults)[0]


def parse_options(
    classes: tuple[type, ...],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> tuple[Any, ...]:
    """One validated instance of each dataclass of ``classes``, from a YAML file (optional) of their options and
    ``--option value`` overrides, as TRL's ``HfArgumentParser`` parses a script's dataclasses."""
    return build_options(classes, read_options(path, overrides, classes), defaults)


def build_options(
    classes: tuple[type, ...], values: dict[str, Any], defaults: dict[str, Any] | None = None
) -> tuple[Any, ...]:
    """`parse_options` of ``values`` (nested plain data, as `read_options` gives); ``defaults`` (nested the same way)
    replace the options' own defaults where ``values`` does not set them. Each option belongs to one of the
    classes; an unknown one is refused with the closest known name, a bad value with its option's name, one set in
    ``values`` that does not apply (a class's ``check_given``) with its name."""
    owner = {f.name: cls for cls in reversed(classes) for f in dataclasses.fields(cls)}
    parts: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    values = _trl_names(classes, values)
    for key, value in _merge(defaults or {}, values).items():
        if key not in owner:
            close = difflib.get_close_matches(key, owner, n=1)
            hint = train_only_hint(key) or (f" (did you mean {close[0]}?)" if close else "")
            raise ValueError(f"unknown option {key}{hint}{_training_argument(key)}")
        parts[owner[key]][key] = value
    built = tuple(_build(cls, parts[cls]) for cls in classes)
    for options in built:
        options.validate()
        _check_given(options, values)
    return built


def _trl_names(classes: tuple[type, ...], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with TRL's names of options (the classes' ``ALIASES``) read as fastgrpo's, what TRL's script
    configs set from several keys (`fastgrpo.config.trl_script.finish_script_options`), and TRL's and
    ``TrainingArguments``' other options as `fastgrpo.config.trl_names.read_trl_options` reads them."""
    if GRPOConfig not in classes:
        return values
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    return read_trl_options(finish_script_options(_canonical_names(classes, values)), defaults)


def _canonical_names(classes: tuple[type, ...] | None, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (one source: a file, or the command line) with the classes' ``ALIASES`` replaced by the names they
    stand for; giving both names of one option is refused."""
    aliases = {a: n for cls in classes or () for a, n in getattr(cls, "ALIASES", {}).items()}
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name != key and name in values:
            raise ValueError(f"{key} and {name} are one option (TRL's name and fastgrpo's): give one of them")
        out[name] = value
    return out


def _training_argument(key: str) -> str:
    """Why an unknown option ``key`` that is one of transformers' ``TrainingArguments`` is not read (empty for any
    other)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return ""
    if key in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return (
            ": a transformers TrainingArguments option that fastgrpo's own training loop does not read (its options: "
            "docs/options.md)"
        )
    return ""


def _check_given(options: Any, given: dict[str, Any]) -> None:
    """Call ``check_given`` of ``options`` and of its nested option dataclasses that have one, each with the options
    ``given`` (nested plain data, without the defaults) sets for it: an option that does not apply to the others'
    values is refused only where the user set it."""
    if hasattr(options, "check_given"):
        options.check_given(given)
    for f in dataclasses.fields(options):
        value, nested = getattr(options, f.name), given.get(f.name)
        if dataclasses.is_dataclass(value) and isinstance(nested, dict):
            try:
                _check_given(value, nested)
            except ValueError as e:  # DataConfig names its options dataset.*
                if f.name == "eval_dataset" and str(e).startswith("dataset."):
                    raise ValueError(f"eval_{e}") from None
                raise


def read_options(
    path: str | Path | None = None, overrides: list[str] | None = None, classes: tuple[type, ...] | None = None
) -> dict[str, Any]:
    """The options a YAML config (optional; ``~`` is expanded in its path) and ``--option value`` overrides set, as
    nested plain data; ``classes``: the dataclasses they are for (see `parse_overrides`), each source's TRL script
    keys read as fastgrpo's (`fastgrpo.config.trl_script.read_script_options`) before the command line overrides
    the file. A mapping of the file that holds a key twice is refused, naming the file, the key and both lines."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(expand_user(path, "--config"))
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {path} " + ("is a directory, not a file" if path.is_dir() else "does not exist")
            )
        try:
            values = yaml.load(read_text(path), Loader=YAMLLoader) or {}
        except DuplicateKeyError as e:
            raise ValueError(f"{path}: {e.problem}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a mapping of options")
    values, given = _canonical_names(classes, values), parse_overrides(overrides or [], classes)
    if classes is not None and GRPOConfig in classes:  # the keys of TRL's script configs, in each source
        values, given = read_script_options(values), read_script_options(given)
    return _merge(values, given)


def _named(f: Any) -> Any:
    """A callable (a reward function, a tool, an environment's class) as ``module:name``; anything else as it is."""
    if isinstance(f, str) or f is None:
        return f
    return f"{getattr(f, '__module__', '?')}:{getattr(f, '__qualname__', type(f).__name__)}"


def config_to_dict(config: GRPOConfig) -> dict[str, Any]:
    """The options as plain data (what ``config.yaml`` holds); a reward function, tool or environment factory given
    as a callable is written as ``module:name``."""
    values = dataclasses.asdict(config)
    values["reward_funcs"] = [_named(f) for f in config.reward_funcs]
    values["tools"] = [_named(f) for f in config.tools]
    factory = config.environment_factory
    values["environment_factory"] = (
        {name: _named(f) for name, f in factory.items()} if isinstance(factory, dict) else _named(factory)
    )
    return values


def yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (``null``, ``false``, ``[accuracy]``); ``required`` for an option without
    default."""
    if value is dataclasses.MISSING:
        return "required"
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def train_only_hint(key: str) -> str:
    """What an unknown option of another command adds when ``key`` is an option of ``fastgrpo train`` (a train config
    given to ``generate``); empty otherwise."""
    if key in {f.name for f in dataclasses.fields(GRPOConfig)}:
        return f" ({key} is an option of fastgrpo train that this command does not use: remove it)"
    return ""
