"""A non-editable install (what the images do: `pip install .`) carries the stack configs, and `dgrpo up` finds its
demo config inside the installed package, not in a source tree that is not there.

The install goes into a throwaway venv that borrows the dependencies of the test environment (a .pth line to its
site-packages) so nothing is downloaded; dgrpo itself is built from a copy of the working tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _copy_source(dest: Path) -> None:
    """What setuptools reads: pyproject, README, configs/ and the package folders (no build leftovers)."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()} | {"configs"}
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for folder in folders:
        shutil.copytree(ROOT / folder, dest / folder, symlinks=True,  # cli/configs stays a link to ../configs
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_non_editable_install_ships_the_configs(child_processes, tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    _copy_source(src)
    # No pip or setuptools of its own: the test environment's pip installs into it (--python) and the build uses
    # the borrowed setuptools.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The test environment's packages (setuptools for the build, dgrpo's dependencies to import it), after the
    # venv's own: a plain path line, so the environment's editable dgrpo finder (a .pth of its own) is not loaded.
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-build-isolation", "--no-index", str(src)], capture_output=True, text=True,
                             timeout=600, cwd=tmp_path, check=False)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    # The layout is declared (configs/ is the data-only package dgrpo.cli.configs): setuptools has nothing to say.
    warned = [line for line in (install.stdout + install.stderr).splitlines() if "Warning" in line]
    assert not warned, "\n".join(warned)

    code = ("import dgrpo.cli.launch.up as up; print(up.__file__); print(up.DEMO_CONFIG); "
            "print(' '.join(sorted(p.name for p in up.REPO_CONFIGS.glob('*.yaml'))))")
    probe = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert probe.returncode == 0, probe.stderr[-3000:]
    module, demo, names = probe.stdout.strip().splitlines()
    assert Path(module).is_relative_to(site), f"dgrpo imported from {module}, not from the install in {site}"
    assert Path(demo).is_relative_to(site) and Path(demo).is_file(), f"the demo config {demo} is not installed"
    expected = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert names.split() == expected, f"installed configs {names} != configs/ {expected}"

    # The installed command, and `python -m dgrpo`, resolve the shipped demo config like any other.
    for command in ([str(venv / "bin" / "dgrpo")], [str(python), "-m", "dgrpo"]):
        shown = subprocess.run([*command, "show-config", "--config", demo], capture_output=True, text=True,
                               timeout=300, cwd=tmp_path, check=False)
        assert shown.returncode == 0, shown.stderr[-3000:]
        assert "run_name: cpu_demo" in shown.stdout
