"""Tool descriptions: verl's tool config file (YAML, OpenAI function-calling schemas) -> a ToolSet.

verl's format, which we read unchanged:

    tools:
      - class_name: calculator                  # ours: calculator | python | file:path/to/tools.py:function
        config: {type: native}
        tool_schema:                            # OpenAI function-calling schema, passed to the chat template
          type: function
          function: {name: calc, description: ..., parameters: {type: object, properties: {...}, required: [...]}}

verl's own `verl.tools.sandbox_fusion_tools.SandboxFusionTool` (a code interpreter behind an HTTP sandbox) maps to
our `python` built-in, run locally in our sandbox; any other verl class (Gsm8kTool, SearchTool, MCP tools...) is
refused by name, since running it would need verl and services we do not have. The digest covers the canonical
config and every user tool file's bytes, so the learner can check that each sampler runs the tools it expects.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dgrpo.common.config import ConfigError, read_yaml_file

BUILTINS = ("calculator", "python")
# verl class names we can honour with a built-in (unambiguous: same job, same arguments).
VERL_ALIASES = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": "python"}
# Keys of verl's SandboxFusionTool config that describe its remote service; accepted and unused (we run locally).
_FUSION_KEYS = {"sandbox_fusion_url", "num_workers", "rate_limit", "enable_global_rate_limit", "default_timeout",
                "default_language", "memory_limit_mb", "type"}


class _Bad(Exception):
    """A problem in one tool entry; load_tool_config turns it into a ConfigError naming the file and entry."""


_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

# Schemas the built-ins get when the config gives none (argument names are what builtins.py takes).
DEFAULT_SCHEMAS = {
    "calculator": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses; integers and "
        "decimals). Use it for any multi-digit arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example 1234 * 5678"}},
            "required": ["expression"],
        },
    },
    "python": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout, then stderr). No network, no "
        "files outside a scratch folder, a few seconds at most.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program; print the results you need"}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolSpec:
    """One tool the model may call: its schema (what the model sees) and what runs (a built-in or a user function)."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    kind: Literal["builtin", "file"]
    target: str  # builtin name, or "/abs/path/file.py:function"

    def schema(self) -> dict:
        """OpenAI function-calling schema, the shape `tokenizer.apply_chat_template(tools=...)` takes."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @property
    def file(self) -> Path | None:
        return Path(self.target.rsplit(":", 1)[0]) if self.kind == "file" else None


@dataclass(frozen=True)
class ToolSet:
    """The tools of one sampler, by name."""

    specs: dict[str, ToolSpec] = field(default_factory=dict)

    def schemas(self) -> list[dict]:
        return [s.schema() for s in self.specs.values()]

    @property
    def digest(self) -> str:
        """sha256 over the canonical specs and each user tool file's bytes: same digest, same tools."""
        h = hashlib.sha256()
        canon = [{"name": s.name, "description": s.description, "parameters": s.parameters, "kind": s.kind,
                  "target": s.target if s.kind == "builtin" else s.target.rsplit(":", 1)[1]}
                 for s in sorted(self.specs.values(), key=lambda s: s.name)]
        h.update(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode())
        for s in sorted(self.specs.values(), key=lambda s: s.name):
            if s.file is not None:
                h.update(b"\0file:" + s.name.encode() + b"\0")
                h.update(s.file.read_bytes())
        return h.hexdigest()

    def __len__(self) -> int:
        return len(self.specs)


def _entry_error(path: Path, i: int, entry: object, msg: str) -> ConfigError:
    name = entry.get("class_name") if isinstance(entry, dict) else None
    label = f"tools[{i}]" + (f" (class_name {name!r})" if name else "")
    return ConfigError(f"tool config {str(path)!r}: {label}: {msg}")


def _resolve_target(path: Path, class_name: str) -> tuple[Literal["builtin", "file"], str]:
    """class_name -> (kind, target); user files resolve relative to the config file's folder."""
    if class_name in BUILTINS:
        return "builtin", class_name
    if class_name in VERL_ALIASES:
        return "builtin", VERL_ALIASES[class_name]
    if class_name.startswith("file:"):
        rest = class_name[len("file:"):]
        file, sep, func = rest.rpartition(":")
        if not sep or not file or not func.isidentifier():
            raise _Bad(f"expected file:path/to/tools.py:function, got {class_name!r}")
        p = Path(file)
        p = (p if p.is_absolute() else path.parent / p).resolve()
        if not p.is_file():
            raise _Bad(f"user tool file {str(p)!r} does not exist")
        if p.suffix != ".py":
            raise _Bad(f"user tool file {str(p)!r} is not a .py file")
        return "file", f"{p}:{func}"
    if class_name.startswith("verl."):
        raise _Bad(f"verl tool class {class_name!r} is not supported: dgrpo runs its built-ins "
                         f"({', '.join(BUILTINS)}), {', '.join(VERL_ALIASES)} (as python) and user functions "
                         "(file:path.py:function)")
    raise _Bad(f"unknown class_name {class_name!r}: use one of {', '.join(BUILTINS)} or "
                     "file:path/to/tools.py:function")


def _check_schema(fn: dict) -> tuple[str, str, dict]:
    name, desc, params = fn.get("name"), fn.get("description", ""), fn.get("parameters", {"type": "object"})
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise _Bad(f"tool_schema.function has unknown keys {sorted(unknown)}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _Bad(f"tool_schema.function.name {name!r} must be 1-64 letters, digits, _ or -")
    if not isinstance(desc, str):
        raise _Bad("tool_schema.function.description must be a string")
    if not isinstance(params, dict) or params.get("type") != "object":
        raise _Bad("tool_schema.function.parameters must be a JSON schema with type: object")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise _Bad("tool_schema.function.parameters.properties must map names to schemas")
    req = params.get("required", [])
    if not isinstance(req, list) or any(r not in props for r in req):
        raise _Bad(f"tool_schema.function.parameters.required {req!r} names arguments not in properties")
    return name, desc, params


def _spec_from_entry(path: Path, entry: dict) -> ToolSpec:
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise _Bad(f"unknown keys {sorted(unknown)} (expected class_name, config, tool_schema)")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise _Bad("class_name is missing")
    kind, target = _resolve_target(path, class_name)
    cfg = entry.get("config") or {}
    if not isinstance(cfg, dict):
        raise _Bad("config must be a mapping")
    allowed = _FUSION_KEYS if class_name in VERL_ALIASES else {"type"}
    if set(cfg) - allowed:
        raise _Bad(f"config has unknown keys {sorted(set(cfg) - allowed)} (limits are set in "
                         "multi_turn.tool_timeout_s / tool_memory_mb)")
    if cfg.get("type", "native") != "native":
        raise _Bad(f"config.type {cfg['type']!r}: only native tools are supported")
    if cfg.get("default_language", "python") != "python":
        raise _Bad(f"config.default_language {cfg['default_language']!r}: only python is supported")
    schema = entry.get("tool_schema")
    if schema is None:
        if kind != "builtin":
            raise _Bad("tool_schema is required for a user tool (the model must know its arguments)")
        fn = DEFAULT_SCHEMAS[target]
    else:
        if not isinstance(schema, dict) or schema.get("type", "function") != "function" or not isinstance(
                schema.get("function"), dict):
            raise _Bad("tool_schema must be {type: function, function: {name, description, parameters}}")
        fn = schema["function"]
    name, desc, params = _check_schema(fn)
    if kind == "builtin":
        want = set(DEFAULT_SCHEMAS[target]["parameters"]["properties"])
        if set(params.get("properties", {})) != want:
            raise _Bad(f"the {target} built-in takes exactly the argument(s) {', '.join(sorted(want))}; the schema "
                       f"declares {', '.join(sorted(params.get('properties', {}))) or 'none'}")
    return ToolSpec(name=name, description=desc, parameters=params, kind=kind, target=target)


def load_tool_config(path: str | Path) -> ToolSet:
    """Read a verl-format tool config; ConfigError names the file and the entry on any problem."""
    p = Path(path)
    data = read_yaml_file(p, "tool config")
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ConfigError(f"tool config {str(p)!r} must have a non-empty list under `tools:`")
    if set(data) - {"tools"}:
        raise ConfigError(f"tool config {str(p)!r}: unknown top-level keys {sorted(set(data) - {'tools'})}")
    specs: dict[str, ToolSpec] = {}
    for i, entry in enumerate(data["tools"]):
        if not isinstance(entry, dict):
            raise _entry_error(p, i, entry, "each entry must be a mapping with class_name and tool_schema")
        try:
            spec = _spec_from_entry(p, entry)
        except _Bad as e:
            raise _entry_error(p, i, entry, str(e)) from None
        if spec.name in specs:
            raise _entry_error(p, i, entry, f"tool name {spec.name!r} is used twice")
        specs[spec.name] = spec
    return ToolSet(specs)


def builtin_toolset(*names: str) -> ToolSet:
    """A ToolSet of built-ins with their default schemas (tests, benchmarks, quick starts)."""
    specs = {}
    for n in names:
        if n not in BUILTINS:
            raise ConfigError(f"unknown built-in tool {n!r} (have {', '.join(BUILTINS)})")
        fn = DEFAULT_SCHEMAS[n]
        specs[fn["name"]] = ToolSpec(fn["name"], fn["description"], fn["parameters"], "builtin", n)
    return ToolSet(specs)
