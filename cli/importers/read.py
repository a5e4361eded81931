"""Reading the file `dgrpo import-config` translates: flat dotted keys -> values from a YAML/JSON mapping (nested or
dotted, hydra's `${a.b}` and `${oc.env:NAME}` interpolations resolved) or from a run script (its launch command's
hydra overrides, the words expanded as bash would by cli/importers/shell/script.py). A value known only at run time
stays an
`Unresolved`; `check_unresolved` refuses it by key before anything is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from dgrpo.cli.importers.shell.script import ScriptError, Unresolved, read_script
from dgrpo.common.config import ConfigError

_INTERP = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
_OVERRIDE = re.compile(r"^[+~]{0,2}([A-Za-z_][\w]*(?:\.[\w]+)*)=(.*)$", re.DOTALL)


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _number(v: Any) -> Any:
    """`1e-6` is a float to OmegaConf (verl) and JSON but a string to YAML 1.1."""
    return float(v) if isinstance(v, str) and _FLOAT.fullmatch(v) else v


def _parse_script(text: str, env: dict[str, str], path: str) -> dict[str, Any]:
    """The `key=value` hydra overrides of the script's launch command, its words expanded as bash would expand them
    with the script's own variables and `env` (cli/importers/shell/script.py); a value bash could only know at run time
    stays
    `Unresolved`. A script without a launch command is read as bare overrides."""
    try:
        reading = read_script(text, env, path)
    except ScriptError as e:
        raise ConfigError(f"{path}: {e}") from None
    words = reading.launch.args if reading.launch else [w for cmd in reading.commands for w in cmd]
    out: dict[str, Any] = {}
    for k, word in enumerate(words):
        raw = word.text if isinstance(word, Unresolved) else word
        if raw in ("--config-name", "--config-path", "-cn", "-cp") and k + 1 < len(words):
            out[_HYDRA_FLAGS[raw]] = words[k + 1]  # hydra's own flags: the config the overrides apply to
            continue
        flag = re.match(r"^(--config-name|--config-path|-cn|-cp)=(.*)$", raw)
        if flag:
            out[_HYDRA_FLAGS[flag.group(1)]] = word if isinstance(word, Unresolved) else flag.group(2)
            continue
        m = _OVERRIDE.match(raw)
        if not m:
            continue
        if isinstance(word, Unresolved):
            out[m.group(1)] = word
            continue
        try:
            out[m.group(1)] = yaml.safe_load(m.group(2)) if m.group(2).strip() else ""
        except yaml.YAMLError:
            out[m.group(1)] = m.group(2)
    return out


_HYDRA_FLAGS = {"--config-name": "hydra.config_name", "-cn": "hydra.config_name", "--config-path": "hydra.config_path",
                "-cp": "hydra.config_path"}


def check_unresolved(flat: dict[str, Any], same: dict[str, Any], reasons: dict[str, str]) -> dict[str, str]:
    """Keys whose value the script leaves to run time: listed as ignored when dgrpo ignores every value of them
    (returned, and taken out of `flat`); any other stops the import naming the key and what it depends on, so no
    `$name` is ever written into a config."""
    ignored: dict[str, str] = {}
    for key, v in list(flat.items()):
        if not isinstance(v, Unresolved):
            continue
        prefix = next((p for p in same if p.endswith(".") and key.startswith(p)), None)
        if (key in same and same[key] is None) or (prefix and same[prefix] is None):
            ignored[key] = f"{reasons.get(key) or reasons.get(prefix, 'dgrpo behaves this way already')} " \
                           f"(its value depends on {', '.join(v.names)}: {v.why})"
            del flat[key]
            continue
        env_names = [n[1:] for n in v.names if re.fullmatch(r"\$[A-Za-z_]\w*", n) and "environment" in v.why]
        hint = (f"; set {' and '.join(env_names)} in the environment, or pass "
                f"{' '.join(f'--env {n}=VALUE' for n in env_names)}") if env_names else ""
        raise ConfigError(f"{key}: the value {v.text!r} depends on {', '.join(v.names)}, {v.why}{hint} "
                          "(dgrpo writes no unexpanded shell variable into a config)")
    return ignored


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """Resolve `${a.b}` references to other keys of the same file (hydra's plain interpolations)."""

    def value(v: Any, depth: int = 0) -> Any:
        if not isinstance(v, str) or depth > 8:
            return v
        whole = _INTERP.fullmatch(v)
        if whole and whole.group(1) in flat:
            return value(flat[whole.group(1)], depth + 1)
        return _INTERP.sub(lambda m: str(value(flat[m.group(1)], depth + 1)) if m.group(1) in flat else m.group(0), v)

    return {k: value(v) for k, v in flat.items()}


def read_source(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Flat dotted keys -> values from a YAML/JSON mapping (nested or dotted) or a run script (its launch command's
    overrides, expanded with `env`: default this process's environment)."""
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} does not exist")
    text = path.read_text()
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        loaded = None
    env = dict(os.environ) if env is None else env
    flat = _flatten(loaded) if isinstance(loaded, dict) else _parse_script(text, env, str(path))
    if not flat:
        raise ConfigError(f"{str(path)!r} holds neither a YAML/JSON mapping nor key=value overrides")
    return {k: _unknown_interpolation(v) if isinstance(v, list) else _number(_unknown_interpolation(v))
            for k, v in _resolve(_env_interpolations(flat, env)).items()}


_OC_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_]\w*)(?:,([^}]*))?\}")


def _env_interpolations(flat: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """OmegaConf's `${oc.env:NAME[,default]}` from `env`, as hydra resolves it when verl starts."""

    def value(v: Any) -> Any:
        if isinstance(v, list):
            return [value(x) for x in v]
        if not isinstance(v, str) or "${oc.env:" not in v:
            return v
        missing = [m.group(1) for m in _OC_ENV.finditer(v) if m.group(1) not in env and m.group(2) is None]
        if missing:
            return Unresolved(tuple(f"${n}" for n in missing), "not set in the environment (an ${oc.env:...} "
                              "interpolation)", v)
        return _OC_ENV.sub(lambda m: env.get(m.group(1), (m.group(2) or "").strip().strip("'\"")), v)

    return {k: value(v) for k, v in flat.items()}


def _unknown_interpolation(v: Any) -> Any:
    """A `${...}` left after resolving (another key's missing value, a resolver dgrpo does not run): unknown, so it
    is never written into a config."""
    if isinstance(v, list):
        items = [_unknown_interpolation(x) for x in v]
        return next((x for x in items if isinstance(x, Unresolved)), [_number(x) for x in items])
    if isinstance(v, str) and "${" in v:
        return Unresolved((re.search(r"\$\{[^}]*\}", v).group(),), "an interpolation dgrpo does not resolve", v)
    return v
