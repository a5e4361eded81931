"""Reward specifications: parse, snapshot (freeze user code and model identity), hash, and build the functions.

The server process only snapshots: it reads the user files' source text and the model folders' identity, and
hashes them with the spec. Worker processes build the callables from that snapshot (`build_functions`), so a
replacement worker runs exactly the code the hash names even if the file changed on disk meanwhile; the file
is read again only on Reload / SIGHUP.

Files and models come only from allowed folders (`rewarder.allowed_dirs`, `check_paths`), and a user file that
does not import is reported by path, exception type and line, never with its text: a client that could name any
file would otherwise run it, or read it back through the error message.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import sys
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from dgrpo.common.logs import bounded, printable
from dgrpo.rewarder.config import FileFunction, ModelFunction, RewarderConfig, RewardSpec, function_name

log = logging.getLogger("dgrpo.rewarder.spec")


class SpecError(ValueError):
    """A reward specification that cannot be used: bad text, missing file, import error, missing function."""

    def __init__(self, message: str):
        super().__init__(bounded(message))


@dataclass(frozen=True)
class SpecRef:
    """Which specification scored something (mirrors the proto's RewardSpecRef)."""

    name: str
    version: int
    content_hash: str


@dataclass(frozen=True)
class FunctionInfo:
    name: str
    kind: str
    weight: float
    source: str


@dataclass
class SpecSnapshot:
    """A validated spec plus the source of every user file it names: what workers build from (picklable)."""

    spec: RewardSpec
    sources: dict[str, str] = field(default_factory=dict)  # absolute path -> file text
    content_hash: str = ""
    packages: dict[str, tuple[str, str]] = field(default_factory=dict)
    """absolute path of a reward file inside a package -> (the folder to import the package from, the file's dotted
    module name): the worker imports it as part of its package, so relative imports work."""

    def functions(self) -> list[FunctionInfo]:
        out = []
        for f in self.spec.functions:
            if isinstance(f, FileFunction):
                source = f.source
            elif isinstance(f, ModelFunction):
                source = _abspath(f.path)
            else:
                source = ""
            out.append(FunctionInfo(function_name(f), f.type, f.weight, source))
        return out


def _abspath(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _format_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        parts.append(f"{key}: {e['msg']}")
    return "; ".join(parts)


def parse_spec(data: object, origin: str) -> RewardSpec:
    """Validate a spec mapping with the config's own model; SpecError names the key and the origin."""
    if isinstance(data, RewardSpec):
        return data
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: a reward spec is a mapping with `name` and `functions`, not {type(data).__name__}")
    try:
        return RewardSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{origin}: invalid reward spec: {_format_validation(e)}") from None


def parse_spec_text(text: str, origin: str = "reload request") -> RewardSpec:
    """YAML or JSON text (JSON is YAML) -> RewardSpec."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{origin}: not valid YAML or JSON: {e}") from None
    except RecursionError:  # PyYAML builds nested collections recursively: "[[[[..." exhausts the stack
        raise SpecError(f"{origin}: nested too deeply to be a reward spec") from None
    return parse_spec(data, origin)


def read_spec_file(path: str) -> RewardSpec:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecError(f"spec file {path!r} does not exist")
    return parse_spec_text(p.read_text(), f"spec file {path!r}")


def allowed_dirs(config: RewarderConfig) -> list[Path]:
    """The resolved folders reward files and models may come from (the rewarder.allowed_dirs docstring says why
    this default): computed once at start, so a later edit of the configured spec cannot widen them."""
    if config.allowed_dirs is not None:
        return [Path(d).expanduser().resolve() for d in config.allowed_dirs]
    if config.spec_file:
        # The folder, not the file, resolved: a spec file that is a symlink (a Kubernetes ConfigMap) keeps its folder.
        return [Path(config.spec_file).expanduser().absolute().parent.resolve()]
    folders = []
    for f in config.spec.functions:
        if isinstance(f, FileFunction) and f.path:
            folders.append(Path(_abspath(f.path)).parent)
        elif isinstance(f, ModelFunction):
            folders.append(Path(_abspath(f.path)))
    return sorted(set(folders))


def spec_modules(spec: RewardSpec) -> list[str]:
    """The modules a spec names by import path (`module:`)."""
    return sorted({f.module for f in spec.functions if isinstance(f, FileFunction) and f.module})


def allowed_modules(config: RewarderConfig, configured: RewardSpec | None) -> list[str]:
    """The modules every spec may import functions from (rewarder.allowed_modules says why): computed once at start
    from the configuration, or from the spec loaded at start (`configured`), so a Reload cannot add one."""
    if config.allowed_modules is not None:
        return sorted(set(config.allowed_modules))
    return spec_modules(configured) if configured is not None else []


def check_modules(spec: RewardSpec, allowed: list[str]) -> None:
    """SpecError unless every `module:` entry is one of `allowed` or a submodule of one. Checked before anything
    is imported (importing runs the module's code)."""
    for i, f in enumerate(spec.functions):
        module = f.module if isinstance(f, FileFunction) else None
        if module and not any(module == a or module.startswith(a + ".") for a in allowed):
            raise SpecError(
                f"reward function {function_name(f)!r}: functions[{i}].module {module!r} is not a module reward "
                f"functions may be imported from (rewarder.allowed_modules: {', '.join(allowed) or 'none'})"
            )


def check_paths(spec: RewardSpec, allowed: list[Path]) -> None:
    """SpecError unless every file and model path resolves (symlinks, `..`) inside one of the `allowed` folders.

    Checked before anything is opened, so a refused path also tells nothing about whether it exists."""
    for i, f in enumerate(spec.functions):
        if not isinstance(f, (FileFunction, ModelFunction)) or f.path is None:
            continue
        resolved = Path(_abspath(f.path))
        if not any(resolved.is_relative_to(d) for d in allowed):
            raise SpecError(
                f"reward function {function_name(f)!r}: functions[{i}].path {f.path!r} is outside the folders reward "
                "files and models may be loaded from (rewarder.allowed_dirs)"
            )


def check_weights(spec: RewardSpec) -> None:
    """SpecError for a weight that is not a finite number: the reward is the weighted sum, and a NaN or infinite
    weight would turn every reward the learner gets into NaN or infinity (YAML's `.nan` and `.inf` parse as floats)."""
    for i, f in enumerate(spec.functions):
        if not math.isfinite(f.weight):
            raise SpecError(f"reward function {function_name(f)!r}: functions[{i}].weight={f.weight}: must be a "
                            "finite number")


def _model_identity(folder: Path) -> bytes:
    """config.json plus the names and sizes of the weight files: cheap, and changes when the checkpoint does."""
    parts = [(folder / "config.json").read_bytes()]
    for w in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        parts.append(f"{w.name}:{w.stat().st_size}".encode())
    return b"\n".join(parts)


def _package_of(path: Path, allowed: list[Path] | None) -> tuple[str, str] | None:
    """(import folder, dotted name) of a file inside a package: its folder and those above holding __init__.py, up to
    the allowed folder that holds it (code above it is not imported). None for a file outside any package."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        if allowed is not None and not any(folder.is_relative_to(d) for d in allowed):
            break
        parts.insert(0, folder.name)
        folder = folder.parent
    return (str(folder), ".".join(parts)) if len(parts) > 1 else None


def _module_source(name: str) -> bytes | None:
    """The source of module `name`, located without importing it or its parents (importing runs code in the
    server): PathFinder walks the packages' folders. None when it cannot be found this way (a C extension, a
    zip import, a module created at runtime); the spec's hash then holds the name only."""
    from importlib.machinery import PathFinder

    search = None
    found = None
    for i, _ in enumerate(name.split(".")):
        found = PathFinder.find_spec(".".join(name.split(".")[: i + 1]), search)
        if found is None:
            return None
        search = found.submodule_search_locations
    if found is None or not found.origin or not found.origin.endswith(".py"):
        return None
    try:
        return Path(found.origin).read_bytes()
    except OSError:
        return None


def snapshot(spec: RewardSpec, allowed: list[Path] | None = None) -> SpecSnapshot:
    """Read every user file and model identity the spec names; SpecError when one is missing. `allowed` (the
    rewarder's allowed folders) bounds how far up a reward file's package is taken."""
    digest = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode())
    sources: dict[str, str] = {}
    packages: dict[str, tuple[str, str]] = {}
    for f in spec.functions:
        if isinstance(f, FileFunction) and f.module:
            digest.update(f"\nmodule {f.module}\n".encode() + (_module_source(f.module) or b""))
        elif isinstance(f, FileFunction):
            path = Path(_abspath(f.path))
            if not path.is_file():
                raise SpecError(f"reward function {function_name(f)!r}: reward file {f.path!r} does not exist")
            try:
                sources[str(path)] = path.read_text()
            except OSError as e:
                raise SpecError(f"reward function {function_name(f)!r}: cannot read {f.path!r}: {e.strerror}") from None
            except UnicodeDecodeError:
                raise SpecError(f"reward function {function_name(f)!r}: {f.path!r} is not UTF-8 text") from None
            digest.update(f"\nfile {path}\n".encode() + sources[str(path)].encode())
            package = _package_of(path, allowed)
            if package:
                packages[str(path)] = package
        elif isinstance(f, ModelFunction):
            folder = Path(_abspath(f.path))
            if not (folder / "config.json").is_file():
                raise SpecError(
                    f"reward function {function_name(f)!r}: model path {f.path!r} is not a Hugging Face folder "
                    "(no config.json there)"
                )
            digest.update(f"\nmodel {folder}\n".encode() + _model_identity(folder))
    return SpecSnapshot(spec=spec, sources=sources, content_hash=digest.hexdigest(), packages=packages)


# ---- worker side: build callables from a snapshot ----


def _load_user_function(f: FileFunction, snap: SpecSnapshot):
    if f.module:
        return _load_module_function(f)
    path = _abspath(f.path)
    source = snap.sources[path]
    label = f"reward function {function_name(f)!r}: reward file {f.path!r}"
    package = snap.packages.get(path)
    module_name = package[1] if package else f"dgrpo_user_reward_{snap.content_hash[:12]}_{Path(path).stem}"
    module = sys.modules.get(module_name)
    if module is None:
        module = types.ModuleType(module_name)
        module.__file__ = path
        # Helpers next to the file import like they do under TRL or verl; a file in a package imports as part of it
        # (its package from disk, the file itself from the snapshot), so `from .utils import x` works.
        folder = package[0] if package else str(Path(path).parent)
        if package:
            module.__package__ = module_name.rpartition(".")[0]
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.modules[module_name] = module
        try:
            # Running the user's reward file is the point (in a worker process, never in the server).
            exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102
        except BaseException as e:  # noqa: BLE001 - user code: any failure is a load error, SystemExit included
            del sys.modules[module_name]
            raise SpecError(f"{label} does not import: {import_failure(e, path)}") from None
    return _function_of(module, f, label)


def _load_module_function(f: FileFunction):
    """A function of an installed (importable) module; the name was checked against rewarder.allowed_modules."""
    import importlib

    label = f"reward function {function_name(f)!r}: module {f.module!r}"
    try:
        module = importlib.import_module(f.module)
    except ModuleNotFoundError as e:
        raise SpecError(f"{label} cannot be imported: no module named {e.name!r} in the rewarder's environment") \
            from None
    except BaseException as e:  # noqa: BLE001 - its code failed while importing: type and line only, as for files
        frames = traceback.extract_tb(e.__traceback__)
        origin = e.filename if isinstance(e, SyntaxError) else (frames[-1].filename if frames else "")
        raise SpecError(f"{label} does not import: {import_failure(e, origin)}") from None
    return _function_of(module, f, label)


def _function_of(module, f: FileFunction, label: str):
    fn = getattr(module, f.function, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise SpecError(f"{label} has no function {f.function!r} (it defines: {', '.join(defined) or 'none'})")
    if not callable(fn):
        raise SpecError(f"{label}: {f.function!r} is a {type(fn).__name__}, not a function")
    return fn


def import_failure(e: BaseException, path: str) -> str:
    """`NameError at line 3`: the type and the file's line only. Messages quote the file (a NameError names the
    word, a SyntaxError can carry the line), so they stay in this process's log (the server's stderr), escaped."""
    line = e.lineno if isinstance(e, SyntaxError) and e.filename == path else None
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename == path:
            line = frame.lineno
    for text in "".join(traceback.format_exception(e)).splitlines():
        log.error("%s: %s", printable(path), printable(text, limit=500))
    return type(e).__name__ + (f" at line {line}" if line else "") + " (the rewarder's log has the traceback)"


def build_functions(snap: SpecSnapshot) -> list:
    """The callables of a spec, in order (worker side: imports user code, loads reward models)."""
    from dgrpo.rewarder.builtins import BUILTINS, build_builtin

    fns = []
    for f in snap.spec.functions:
        if isinstance(f, FileFunction):
            from dgrpo.rewarder.calling import user_function

            fns.append(user_function(_load_user_function(f, snap), f.convention, f.reward_kwargs))
        elif isinstance(f, ModelFunction):
            from dgrpo.rewarder.reward_model import RewardModel

            try:
                fns.append(RewardModel(f))
            except Exception as e:  # noqa: BLE001 - a model that cannot load is a spec error with its reason
                raise SpecError(f"reward function {function_name(f)!r}: cannot load model {f.path!r}: "
                                f"{type(e).__name__}: {e}") from None
        elif f.type in BUILTINS:
            fns.append(build_builtin(f))
        else:  # pragma: no cover - the discriminated union makes this unreachable
            raise SpecError(f"unknown reward function type {f.type!r}")
    return fns
