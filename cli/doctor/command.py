"""`dgrpo doctor [--config FILE] [--service NAME ...] [--json] [KEY=VALUE ...]`: check this host before a launch.

Per service of the config: installed packages against the verified matrix (docs/versions.md), the CANN toolkit on
Ascend, the device and its memory, the collective backend, the environment variables the Ascend stack reads, free
ports, /dev/shm against two weight slots, the model folder, whether the configured addresses answer health, and
`dgrpo plan`'s memory verdict. Exit 1 when any finding is FAIL: the services themselves refuse to start on the same
findings (`DGRPO_DOCTOR=warn` lets them start anyway).

The failures users hit most happen before training starts: a version set that does not match (vllm <-> vllm-ascend
<-> torch <-> torch_npu <-> CANN), an environment variable one service needs and another refuses, a /dev/shm too
small for two weight slots (Docker's default is 64 MB), a taken port, a model path without config.json. Each check
is a plain function returning `Finding`s with the fix in one line. The same checks run when a service starts
(`startup_failures`), which is why they are cheap: package versions from importlib.metadata, devices from /dev and
the vendor's smi tool, never `import torch` or vLLM (a service's start stays well under a second slower).

A diagnosis of the whole host, so it lives with the command: it reads every section of the stack config and reaches
into the weight channel's segments (weights/shm.py), which common code must not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from dgrpo.cli.doctor.devices import check_allocator, check_devices, check_env, device_info, resolve_device
from dgrpo.cli.doctor.findings import Finding
from dgrpo.cli.doctor.resources import check_model, check_ports, check_reach, check_shm, memory_findings
from dgrpo.cli.doctor.software import check_cann, check_packages
from dgrpo.common import preflight as pf
from dgrpo.common.config import ConfigError, load_config
from dgrpo.common.models import model_dir

SERVICES = ("sampler", "rewarder", "learner")
DOCTOR_ENV = "DGRPO_DOCTOR"
"""`DGRPO_DOCTOR=warn`: a service starts despite FAIL findings (printed as warnings). For a set you have verified."""





def _needs_torch(cfg: Any) -> bool:
    spec = getattr(cfg.rewarder, "spec", None)
    return any(getattr(f, "type", "") == "model" for f in getattr(spec, "functions", []))


def run_checks(cfg: Any, services: tuple[str, ...] = SERVICES, *, env: dict[str, str] | None = None,
               ports: bool = True, network: bool = False, memory: bool = False) -> list[Finding]:
    """Every check of each service of `cfg` (a StackConfig). `network`: also probe the configured addresses;
    `memory`: also add `dgrpo plan`'s verdict per device (WARN, never FAIL)."""
    env = dict(os.environ if env is None else env)
    device, why = resolve_device(cfg.model.device)
    info = device_info(device)
    params = pf.parameter_count(model_dir(cfg.model.path))
    rank0 = env.get("RANK", "0") == "0"
    out: list[Finding] = []
    for service in services:
        if device == "npu" and service != "rewarder":
            out.append(check_cann(service, env))
        out += check_packages(service, device, needs_torch=_needs_torch(cfg))
        if service != "rewarder":
            out += check_devices(service, device, why, info, env, tensor_parallel=cfg.sampler.tensor_parallel_size)
            out += check_env(service, device, env)
            out += check_allocator(service, device, env)
            out.append(check_model(service, cfg.model.path))
        if ports and (service != "learner" or rank0):
            out.append(check_ports(service, cfg))
        if service in ("sampler", "learner") and (service != "learner" or rank0):
            shm = check_shm(service, cfg, params)
            if shm:
                out.append(shm)
        if network:
            out += check_reach(service, cfg)
        if memory and service != "rewarder":
            out += memory_findings(service, cfg, device, info)
    return out


def startup_failures(cfg: Any, services: tuple[str, ...], *, ports: bool = True) -> list[Finding]:
    """The FAIL findings that stop a service (or `dgrpo up`) from starting; [] with DGRPO_DOCTOR=warn or off."""
    mode = os.environ.get(DOCTOR_ENV, "on")
    if mode == "off":
        return []
    found = run_checks(cfg, services, ports=ports)
    fails = [f for f in found if f.status == "FAIL"]
    if mode == "warn":
        for f in fails:
            print(f"dgrpo doctor: ignored ({DOCTOR_ENV}=warn): {f.detail}", file=sys.stderr)
        return []
    return fails


def report_failures(prefix: str, fails: list[Finding]) -> bool:
    """Print each FAIL as one line (the detail `dgrpo doctor` shows, then its fix) on stderr; whether any."""
    for f in fails:
        print(f"{prefix}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else ""), file=sys.stderr)
    if fails:
        print(f"{prefix}: refused to start ({len(fails)} failed check(s); `dgrpo doctor` shows all; "
              f"{DOCTOR_ENV}=warn starts anyway)", file=sys.stderr)
    return bool(fails)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo doctor", description=__doc__.split("\n\n")[1],
                                     epilog="Overrides: dotted KEY=VALUE pairs, as for every dgrpo command.")
    parser.add_argument("--config", metavar="FILE", help="stack YAML (default: every default, the bundled model)")
    parser.add_argument("--service", action="append", choices=["sampler", "rewarder", "learner"],
                        help="check only this service (repeatable; default: all three)")
    parser.add_argument("--no-network", action="store_true", help="skip the health probes of configured addresses")
    parser.add_argument("--json", action="store_true", help="one JSON object: findings and counts")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from dgrpo.cli.stack import StackConfig

    try:
        cfg = load_config(StackConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"dgrpo doctor: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    findings = run_checks(cfg, tuple(args.service or SERVICES), network=not args.no_network, memory=True)
    counts = {s: sum(f.status == s for f in findings) for s in ("OK", "WARN", "FAIL")}
    if args.json:
        print(json.dumps({"findings": [f.as_dict() for f in findings], "counts": counts,
                          "seconds": round(time.perf_counter() - t0, 3)}, indent=1))
    else:
        for f in findings:
            print(f.line())
        print(f"dgrpo doctor: {counts['OK']} OK, {counts['WARN']} WARN, {counts['FAIL']} FAIL "
              f"({time.perf_counter() - t0:.2f} s)")
    return 1 if counts["FAIL"] else 0
