"""The folder tree is the architecture: one namespace, generic names left alone, dependencies one way, configs that
import no implementation. Static (the modules' ASTs), so it runs in the unit tier without starting a process."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"sampler": "dgrpo.sampler", "rewarder": "dgrpo.rewarder", "learner": "dgrpo.learner"}


def test_generic_top_level_names_are_not_ours(child_processes, tmp_path):
    """`import sampler` / `import proto` must not find dgrpo (proto-plus owns `proto`)."""
    code = (
        "import importlib.util, json\n"
        "names = ['sampler', 'learner', 'rewarder', 'proto', 'common', 'weights', 'tools', 'cli']\n"
        "found = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in names}\n"
        "print(json.dumps(found))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(ROOT) not in out.stdout, out.stdout
    import dgrpo.sampler

    assert Path(dgrpo.sampler.__file__).parent == ROOT / "sampler"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_services_never_import_each_other():
    for folder, package in SERVICES.items():
        others = [p for p in SERVICES.values() if p != package]
        for path in (ROOT / folder).rglob("*.py"):
            bad = [m for m in _imports(path) if any(m == o or m.startswith(o + ".") for o in others)]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_common_depends_on_no_service():
    for folder in ("common", "weights", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = [m for m in _imports(path) if any(m.startswith(p) for p in SERVICES.values())]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_every_package_folder_is_in_the_wheel():
    """A folder with an __init__.py that pyproject's `packages` misses is left out of `pip install .` (the images),
    while the editable install of development finds it: list every one."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for package, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in sub:
                assert ".".join((package, *sub)) in listed, f"{init.parent} is not in pyproject's packages"


# ---- the import graph -------------------------------------------------------------------------------------------

HEAVY = ("torch", "grpc", "vllm", "transformers", "numpy")
"""What no config may load: `dgrpo --help`, `show-config` and config errors answer before any of them is imported."""
SCHEMA_MODULES = {
    "dgrpo.common.config", "dgrpo.common.model_config", "dgrpo.common.auth_config", "dgrpo.common.tracing_config",
    "dgrpo.weights.config", "dgrpo.tools.config", "dgrpo.sampler.config", "dgrpo.rewarder.config",
    "dgrpo.learner.config", "dgrpo.learner.update.config", "dgrpo.cli.stack",
}
"""The modules that define the config sections (StrictConfig subclasses), schemas only."""
SCHEMA_HELPERS = {"dgrpo.common.devices"}
"""Non-schema modules a schema may import: device-dependent defaults and checks, standard library only at top level
(torch only inside the functions that probe a device)."""
SCHEMA_THIRD_PARTY = {"pydantic", "yaml"}


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package (tests/ excluded), by dotted name, from pyproject's package-dir."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = {}
    for package, folder in setup["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in parts or not all(part.isidentifier() for part in parts):
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


@cache
def _module_imports(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(top-level, function-level) imports of a module: `from a.b import c` is a.b.c when that is one of our modules,
    else a.b (relative imports made absolute). Imports under `if TYPE_CHECKING:` are left out: they never run, so
    they couple no import order."""
    top: set[str] = set()
    nested: set[str] = set()

    def visit(nodes: list[ast.AST], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, in_function)
                continue
            found = nested if in_function else top
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(name, node.module, node.level)
                found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in _modules() else module
                             for a in node.names)
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for _, value in ast.iter_fields(node):  # bodies, else branches, except handlers, match cases
                if isinstance(value, list):
                    visit([v for v in value if isinstance(v, (ast.stmt, ast.excepthandler, ast.match_case))], inner)

    visit(ast.parse(_modules()[name].read_text()).body, False)
    return frozenset(top), frozenset(nested)


def _absolute(importer: str, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` in module `importer`."""
    if level == 0:
        return module or ""
    package = importer if _modules()[importer].stem == "__init__" else importer.rpartition(".")[0]
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{module}" if module else base


def _ours(names) -> set[str]:
    return {n for n in names if n in _modules()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _folder(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module  # dgrpo.common.x -> common; dgrpo.v1.x -> v1


def _edges(include_functions: bool = True) -> dict[str, set[str]]:
    """module -> the modules of ours it imports. A function-level import counts: it still couples the two modules
    (one cannot be understood, moved or tested without the other), it only defers the cost."""
    return {m: _ours(top | nested if include_functions else top) - {m}
            for m in _modules() for top, nested in [_module_imports(m)]}


def test_no_import_cycle_between_modules():
    """A cycle means two modules are one: whichever is imported first sees the other half-initialised. Shared types
    go to a module of their own (sampler/results.py), a check that needs the whole stack to the command (cli/)."""
    edges = _edges()
    cycles = _cycles(edges)
    assert cycles == [], [[f"{m} -> {t}" for m in c for t in sorted(edges[m]) if t in c] for c in cycles]


def test_no_import_cycle_between_folders():
    """Folders depend one way (docs/architecture.md): common knows no weights, weights no sampler, and so on."""
    folders: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for m, targets in _edges().items():
        for t in targets:
            if _folder(t) != _folder(m):
                folders.setdefault(_folder(m), set()).add(_folder(t))
                why.setdefault((_folder(m), _folder(t)), f"{m} -> {t}")
    cycles = _cycles(folders)
    assert cycles == [], [(c, [e for (a, b), e in sorted(why.items()) if a in c and b in c]) for c in cycles]


def _room(module: str) -> str:
    """The sub-package a module lives in (dgrpo.learner.rollout.groups -> dgrpo.learner.rollout); a module directly
    in a top-level folder is its own room (dgrpo.learner.loop)."""
    path = _modules()[module]
    return module.rpartition(".")[0] if path.stem != "__init__" and path.parent.joinpath("__init__.py").is_file() \
        and module.count(".") > 2 else module


def test_no_import_cycle_between_sub_packages():
    """Inside a folder the sub-packages depend one way too (docs/architecture.md): the learner's records read the
    rollout and the update, the rollout reads the update, the update reads neither; the loop at the top reads all."""
    rooms: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for m, targets in _edges().items():
        for t in targets:
            if _room(t) != _room(m) and _folder(t) == _folder(m):
                rooms.setdefault(_room(m), set()).add(_room(t))
                why.setdefault((_room(m), _room(t)), f"{m} -> {t}")
    assert "dgrpo.learner.rollout" in rooms  # the walk sees the sub-packages
    cycles = _cycles(rooms)
    assert cycles == [], [(c, [e for (a, b), e in sorted(why.items()) if a in c and b in c]) for c in cycles]


def test_configs_load_no_implementation():
    """No config module imports torch, grpc, vLLM, transformers or numpy, neither itself nor through any module its
    top-level imports reach (imports inside functions run only when called; TYPE_CHECKING ones never)."""
    seen: set[str] = set()
    todo = sorted(SCHEMA_MODULES)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        top, _ = _module_imports(m)
        heavy = sorted(n for n in top if n.split(".")[0] in HEAVY)
        assert not heavy, f"{m} (reached from the configs) imports {heavy} at top level"
        todo += sorted(_ours(top) - seen)


def test_configs_import_only_schemas():
    """A config module imports the standard library, pydantic, yaml, other config modules and the device helpers:
    never the code that uses the config, even when that code is light today."""
    for m in sorted(SCHEMA_MODULES | SCHEMA_HELPERS):
        top, _ = _module_imports(m)
        allowed = SCHEMA_MODULES | SCHEMA_HELPERS | (SCHEMA_THIRD_PARTY if m in SCHEMA_MODULES else set())
        bad = sorted(n for n in top if n.split(".")[0] not in sys.stdlib_module_names and n not in allowed
                     and n.split(".")[0] not in allowed)
        assert not bad, f"{m} imports {bad}"


def test_every_config_section_lives_in_a_config_module():
    """Every StrictConfig subclass (at any depth) is defined in one of SCHEMA_MODULES: a section defined next to
    the code that uses it drags that code's imports into every config."""
    classes: dict[str, str] = {}  # class name -> module
    trees = {m: ast.parse(p.read_text()) for m, p in _modules().items()}
    configs = {"StrictConfig"}
    grew = True
    while grew:
        grew = False
        for m, tree in trees.items():
            for node in tree.body:
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in
                         getattr(node, "bases", ())}
                if isinstance(node, ast.ClassDef) and bases & configs and node.name not in configs:
                    configs.add(node.name)
                    classes[node.name] = m
                    grew = True
    assert "StackConfig" in classes and "RolloutConfig" in classes  # the walk finds them
    outside = sorted(f"{m}.{c}" for c, m in classes.items() if m not in SCHEMA_MODULES)
    assert not outside, f"config sections outside the config modules: {outside}"
