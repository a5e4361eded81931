"""The folder tree is the architecture: one namespace, generic names left alone, dependencies one way."""

from __future__ import annotations

import ast
import subprocess
import sys
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
        for path in (ROOT / folder).glob("*.py"):
            bad = [m for m in _imports(path) if any(m == o or m.startswith(o + ".") for o in others)]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_common_depends_on_no_service():
    for folder in ("common", "weights", "tools"):
        for path in (ROOT / folder).glob("*.py"):
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
