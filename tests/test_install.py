"""A fresh clone's install (scripts/env.sh, what `bash scripts/run.sh` runs first) prints its own progress lines and
real problems only: no setuptools warnings about the package layout, no "Editable installation" banner. (The images'
non-editable install: tests/deploy/test_package_data.py.)

The clone is the working tree's files as git would check them out (tracked and not ignored: no egg-info, no build
folder). Its virtual environment sees this one's site-packages through a .pth file, so every dependency is already
satisfied and scripts/env.sh's install runs in seconds, its pip commands unchanged: dgrpo itself is built and
installed editable into the new environment (the dependencies found outside it are never touched)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = "[env] installing dgrpo[cpu,dev] (first time: several minutes)"


def fresh_clone(dest: Path) -> Path:
    """The working tree's files as a clone has them (tracked or new, not ignored; symlinks kept as links)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if not src.is_symlink() and not src.exists():  # deleted in the working tree, not yet in the index
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dest / name)
        else:
            shutil.copy2(src, dest / name)
    assert (dest / "cli" / "configs").is_symlink() and (dest / "scripts" / "env.sh").is_file()
    return dest


def machine_lines(lines: list[str]) -> list[str]:
    """pip's warnings about this machine's own index settings (pip.conf names local index folders that may lack a
    package): real, and not the project's."""
    return [line for line in lines if line.startswith("WARNING: Location '") and "is ignored" in line]


@pytest.fixture
def clone(child_processes, tmp_path) -> Path:
    return fresh_clone(tmp_path / "clone")


def test_a_fresh_clones_install_prints_its_progress_lines_only(clone, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (purelib / "deps_from_the_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONWARNINGS")}
    proc = subprocess.run(["bash", "-c", ". scripts/env.sh"], cwd=clone, env={**env, "DGRPO_VENV": str(venv)},
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    ours = [line for line in lines if line not in machine_lines(lines)]
    assert ours == [PROGRESS], "\n".join(lines)
    assert (venv / ".dgrpo-stamp").is_file()
    # The editable install is the clone: the stack configs are found where `dgrpo up` looks.
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "from dgrpo.cli.launch.up import DEMO_CONFIG; print(DEMO_CONFIG.resolve())"],
                         cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert out == str((clone / "configs" / "cpu-demo.yaml").resolve())

