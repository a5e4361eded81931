"""Typed configuration base: YAML files plus dotted command-line overrides, strictly validated.

Every component defines its own pydantic model next to its code (a docstring under each field is its
documentation); this module only loads, overrides, validates and renders them. Errors name the dotted key
and the offending value, so a typo fails at start instead of silently taking a default.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the value."""


class StrictConfig(BaseModel):
    """Base of every dgrpo config: unknown keys forbidden, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (["a", "b", "c"], VALUE parsed as YAML: numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. sampler.gpu_memory_utilization=0.35)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])} is a value, not a section; cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        if e["type"] == "value_error" and isinstance(e.get("input"), dict):
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')}")  # a section-level check names its keys
        elif e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (value {e['input']!r})")
        else:
            lines.append(f"{key}={e.get('input')!r}: {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def read_yaml_file(path: str | Path, what: str) -> Any:
    """The YAML document in `path`; ConfigError "<what> '<path>' does not exist" or "... is not valid YAML: ..."."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(p)!r} is not valid YAML: {e}") from e


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build `cls` from an optional YAML file and `key=value` overrides; raise ConfigError naming bad keys."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        loaded = read_yaml_file(p, "config file")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top, not {type(loaded).__name__}")
        data = loaded or {}
    for text in overrides:
        key_path, value = parse_override(text)
        apply_override(data, key_path, value)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def describe(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every option of `cls` as `key (type, default): description` lines, nested sections flattened."""
    lines: list[str] = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        if _is_model(field.annotation):
            doc = (field.description or field.annotation.__doc__ or "").strip().splitlines()
            lines.append(f"\n[{key}] {doc[0] if doc else ''}")
            lines.extend(describe(field.annotation, key + "."))
            continue
        default = field.get_default(call_default_factory=True)
        desc = " ".join((field.description or "").split())
        lines.append(f"  {key} ({_type_name(field.annotation)}, default {default!r}): {desc}")
    return lines


def to_yaml(cfg: BaseModel) -> str:
    """The fully resolved config, for logs and checkpoints."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
