"""What is installed: each service's packages against the verified matrix (docs/versions.md), and on Ascend the
CANN toolkit. Read from importlib.metadata and the toolkit's files, never by importing torch or vLLM."""

from __future__ import annotations

import functools
import glob
import importlib.metadata as md
import os
import platform
import re
from pathlib import Path

from dgrpo.cli.doctor.findings import Finding
from dgrpo.common import versions

# ---- installed packages --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def installed_packages() -> dict[str, str]:
    """Distribution name (normalised) -> version, from one scan of sys.path."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(_norm(name), dist.version)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str, installed: dict[str, str] | None = None) -> str | None:
    return (installed if installed is not None else installed_packages()).get(_norm(name))


def _satisfies(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False


def check_packages(service: str, device: str, needs_torch: bool = True,
                   installed: dict[str, str] | None = None, python: str | None = None) -> list[Finding]:
    """The service's packages against the verified set of `device` (docs/versions.md)."""
    got = installed if installed is not None else installed_packages()
    dset = versions.MATRIX[device]
    out: list[Finding] = []
    py = python or platform.python_version()
    if not _satisfies(py, dset.python):
        out.append(Finding(service, "python", "FAIL", f"Python {py}; the {device} set needs {dset.python}",
                           f"use a Python in {dset.python} (docs/versions.md)"))
    pins = [p for p in dset.pins if service in p.services]
    if service == "rewarder":
        pins = [p for p in dset.pins if p.package in versions.REWARD_MODEL_PINS] if needs_torch else []
    for pin in [*pins, *(p for p in versions.COMMON if service in p.services)]:
        have = installed_version(pin.package, got)
        bad = "FAIL" if pin.hard else "WARN"
        if have is None:
            out.append(Finding(service, pin.package, "FAIL", f"{pin.package} is not installed (verified: {pin.spec})",
                               f"pip install '{pin.package}{pin.spec}' (or dgrpo[{dset.extra}]; docs/versions.md)"))
        elif not _satisfies(have, pin.spec):
            out.append(Finding(service, pin.package, bad, f"{pin.package} {have} is installed; the verified {device} "
                               f"set has {pin.package}{pin.spec}",
                               f"pip install '{pin.package}{pin.spec}' (docs/versions.md has the whole set)"))
        else:
            out.append(Finding(service, pin.package, "OK", f"{pin.package} {have}"))
    if service == "sampler":
        for name in dset.absent:
            have = installed_version(name, got)
            if have is not None:
                why = "a CUDA build, it breaks `import vllm`" if device == "cpu" and name != "vllm" else \
                    "it shadows the engine of this device"
                out.append(Finding(service, name, "FAIL", f"{name} {have} is installed with the {device} set ({why})",
                                   f"pip uninstall -y {name}"))
    return out


# ---- Ascend CANN ---------------------------------------------------------------------------------------------------

CANN_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def cann_version(env: dict[str, str] | None = None, roots: tuple[str, ...] = CANN_ROOTS) -> tuple[str | None, str]:
    """(version, where) of the CANN toolkit: `version=` in <root>/<arch>-linux/ascend_toolkit_install.info, where
    root is $ASCEND_TOOLKIT_HOME / $ASCEND_HOME_PATH (set by set_env.sh) or the default install folders (what the
    CANN install guide tells you to `cat`)."""
    env = os.environ if env is None else env
    candidates = [env[k] for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if env.get(k)] + list(roots)
    for root in candidates:
        for info in sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info"))):
            try:
                text = Path(info).read_text(errors="replace")
            except OSError:
                continue
            m = re.search(r"^\s*version\s*=\s*([^\s]+)", text, re.MULTILINE)
            if m:
                return m.group(1), info
    return None, ", ".join(candidates)


def check_cann(service: str, env: dict[str, str] | None = None, roots: tuple[str, ...] = CANN_ROOTS) -> Finding:
    want = versions.MATRIX["npu"].cann
    got, where = cann_version(env, roots)
    if got is None:
        return Finding(service, "cann", "FAIL", f"no CANN toolkit found (looked for ascend_toolkit_install.info "
                       f"under {where})",
                       f"install CANN {want} and `source /usr/local/Ascend/ascend-toolkit/set_env.sh`")
    if not got.startswith(want):
        return Finding(service, "cann", "FAIL", f"CANN {got} ({where}); torch_npu "
                       f"{versions.MATRIX['npu'].pins[3].spec[2:]} and vllm-ascend need CANN {want}",
                       f"install CANN {want} or the vllm-ascend release matching CANN {got} (docs/versions.md)")
    return Finding(service, "cann", "OK", f"CANN {got} ({where})")
