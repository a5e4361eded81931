"""`dgrpo up`'s preflight: the whole stack checked before any service starts, and the ports it assigns.

`dgrpo up` runs every service on this host, so it owns their wiring: it gives each a free loopback port. A key the
user set on the command line is theirs, though: it is honoured (and checked free), or refused naming the key when up
cannot honour it (one `sampler.port` for two replicas) — never silently replaced. Then, before anything heavy: the
data files and the columns the prompt and the reward functions name, the output folders (writable, room for one
checkpoint and the export), and every port the stack will bind (distinct, free). Each failure is one line naming
the key, seconds after `dgrpo up` starts instead of after the engines have loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dgrpo.cli.stack import StackConfig
from dgrpo.common import preflight as pf
from dgrpo.common import tracing
from dgrpo.common.config import ConfigError, parse_override
from dgrpo.learner.main import learner_bindings, output_needs
from dgrpo.learner.records.metrics import check_loggers
from dgrpo.learner.rollout.data import check_files

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0")
UP_KEYS = ("sampler.host", "sampler.port", "sampler.addresses", "rewarder.host", "rewarder.port",
           "learner.rollout.rewarder_address", "learner.trainer.control_port", "weights.announce_port",
           "weights.control_port")
"""The keys `dgrpo up` sets for its local wiring (unless the user set them)."""


def given_keys(overrides: list[str]) -> set[str]:
    """The dotted keys of command-line overrides."""
    return {".".join(parse_override(text)[0]) for text in overrides}


def covers(given: set[str], key: str) -> bool:
    """Whether `key` was set by the user, itself or through its section (`weights={announce_port: 1}`)."""
    return any(key == g or key.startswith(g + ".") for g in given)


def file_keys(config_file: Path | None, keys: tuple[str, ...] = UP_KEYS) -> list[str]:
    """Which of `keys` the YAML file sets."""
    if config_file is None:
        return []
    data = yaml.safe_load(Path(config_file).read_text()) or {}
    found = []
    for key in keys:
        node = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            found.append(key)
    return found


def _local_port(key: str, address: str) -> int:
    """The port of a `host:port` address on this host (up starts the service here)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}={address!r}: not host:port with a port in 1-65535")
    if host not in LOCAL_HOSTS:
        raise ConfigError(f"{key}={address!r}: dgrpo up starts that service on this host, so the address must be "
                          f"local (one of {', '.join(LOCAL_HOSTS)}); to use a remote service run the services "
                          "yourself (docs/deploy.md)")
    return int(port)


@dataclass
class StackPorts:
    """The local wiring `dgrpo up` decided: one port per sampler replica, the rewarder's, and the overrides that
    write its choices into the stack config (only for keys the user did not set)."""

    sampler_ports: list[int]
    rewarder_port: int
    overrides: list[str] = field(default_factory=list)
    keys: dict[int, str] = field(default_factory=dict)
    """Port -> the key that named it, for error messages."""


def assign_ports(cfg: StackConfig, given: set[str], samplers: int) -> StackPorts:
    """Ports for `samplers` replicas, the rewarder, the learner's control service and weight sync: the user's where
    given (their keys), distinct free ones below the ephemeral range elsewhere."""
    sampler_ports: list[int | None] = [None] * samplers
    if covers(given, "sampler.addresses"):
        addresses = cfg.sampler.addresses
        if len(addresses) != samplers:
            raise ConfigError(f"sampler.addresses={addresses!r} lists {len(addresses)} replica(s) but dgrpo up starts "
                              f"{samplers} (--samplers): give one local address per replica")
        sampler_ports = [_local_port(f"sampler.addresses[{i}]", a) for i, a in enumerate(addresses)]
        if covers(given, "sampler.port") and sampler_ports != [cfg.sampler.port]:
            raise ConfigError(f"sampler.port={cfg.sampler.port} and sampler.addresses={addresses!r} disagree: "
                              "give one of them")
        sampler_keys = [f"sampler.addresses[{i}]" for i in range(samplers)]
    elif covers(given, "sampler.port"):
        if samplers > 1:
            raise ConfigError(f"sampler.port={cfg.sampler.port}: dgrpo up starts {samplers} replicas, each on its own "
                              "port: give sampler.addresses=[127.0.0.1:A, 127.0.0.1:B, ...] instead")
        if cfg.sampler.port == 0:
            raise ConfigError("sampler.port=0: dgrpo up must know the port to wait for the sampler; give a port, or "
                              "leave it out and dgrpo up picks a free one")
        sampler_ports = [cfg.sampler.port]
        sampler_keys = ["sampler.port"]
    else:
        sampler_keys = [f"sampler.addresses[{i}] (picked by dgrpo up)" for i in range(samplers)]

    rewarder_port: int | None = None
    if covers(given, "rewarder.port"):
        if cfg.rewarder.port == 0:
            raise ConfigError("rewarder.port=0: dgrpo up must know the port to wait for the rewarder; give a port, "
                              "or leave it out and dgrpo up picks a free one")
        rewarder_port = cfg.rewarder.port
    if covers(given, "learner.rollout.rewarder_address"):
        port = _local_port("learner.rollout.rewarder_address", cfg.learner.rollout.rewarder_address)
        if rewarder_port is not None and port != rewarder_port:
            raise ConfigError(f"learner.rollout.rewarder_address={cfg.learner.rollout.rewarder_address!r} is not "
                              f"rewarder.port={rewarder_port}: the learner would call a port nobody serves")
        rewarder_port = port

    learner_keys = {"learner.trainer.control_port": cfg.learner.trainer.control_port,
                    "weights.announce_port": cfg.weights.announce_port,
                    "weights.control_port": cfg.weights.control_port}
    mine = [k for k in learner_keys if not covers(given, k)]
    user_ports = {p for p in [*sampler_ports, rewarder_port] if p}
    user_ports |= {p for k, p in learner_keys.items() if k not in mine and p}
    wanted = sampler_ports.count(None) + (rewarder_port is None) + len(mine)
    picked = iter(pf.pick_free_ports(wanted, exclude=user_ports))
    sampler_ports = [p if p is not None else next(picked) for p in sampler_ports]
    rewarder_port = rewarder_port if rewarder_port is not None else next(picked)

    out: list[str] = []
    if not covers(given, "sampler.host"):
        out.append("sampler.host=127.0.0.1")
    if not covers(given, "sampler.addresses"):
        out.append(f"sampler.addresses=[{', '.join(f'127.0.0.1:{p}' for p in sampler_ports)}]")
    if not covers(given, "rewarder.host"):
        out.append("rewarder.host=127.0.0.1")
    if not covers(given, "rewarder.port"):
        out.append(f"rewarder.port={rewarder_port}")
    if not covers(given, "learner.rollout.rewarder_address"):
        out.append(f"learner.rollout.rewarder_address=127.0.0.1:{rewarder_port}")
    out += [f"{key}={next(picked)}" for key in mine]
    keys = {p: k for p, k in zip(sampler_ports, sampler_keys, strict=True)}
    keys[rewarder_port] = "rewarder.port" if covers(given, "rewarder.port") or covers(
        given, "learner.rollout.rewarder_address") else "rewarder.port (picked by dgrpo up)"
    return StackPorts(sampler_ports, rewarder_port, out, keys)


def reward_columns(cfg: StackConfig) -> dict[str, str]:
    """Data columns the inline reward specification reads (column -> the key naming it)."""
    if cfg.rewarder.spec_file is not None:
        return {}  # read by the rewarder at start; its columns are checked there, per completion
    return {f.field: f"rewarder.spec.functions[{i}].field"
            for i, f in enumerate(cfg.rewarder.spec.functions) if isinstance(getattr(f, "field", None), str)}


def stack_bindings(cfg: StackConfig, ports: StackPorts) -> list[pf.Binding]:
    """Every socket the stack binds: samplers, rewarder, their metrics endpoints, the learner's."""
    out: list[pf.Binding] = [(ports.keys[p], cfg.sampler.host, p) for p in ports.sampler_ports]
    out.append((ports.keys[ports.rewarder_port], cfg.rewarder.host, ports.rewarder_port))
    if cfg.sampler.metrics_port:
        if len(ports.sampler_ports) > 1:
            raise ConfigError(f"sampler.metrics_port={cfg.sampler.metrics_port}: each of the "
                              f"{len(ports.sampler_ports)} replicas would bind it; leave it unset (or 0: any free "
                              "port) with dgrpo up --samplers > 1")
        out.append(("sampler.metrics_port", cfg.sampler.metrics_host, cfg.sampler.metrics_port))
    if cfg.rewarder.metrics_port:
        out.append(("rewarder.metrics_port", cfg.rewarder.metrics_host, cfg.rewarder.metrics_port))
    return out + learner_bindings(cfg.learner_run())


def check_outputs(cfg: StackConfig) -> None:
    """The learner's output folders: writable, room for one checkpoint and the export (the estimate is named)."""
    run = cfg.learner_run()
    pf.check_space(output_needs(run))
    if cfg.learner.checkpoint.export_dir:
        pf.check_replaceable("learner.checkpoint.export_dir", cfg.learner.checkpoint.export_dir, "config.json")


def preflight_stack(cfg: StackConfig, ports: StackPorts) -> None:
    """Everything `dgrpo up` can check before it starts a service (each raises ConfigError naming the key)."""
    check_files(cfg.learner.data, columns=reward_columns(cfg))
    check_loggers(cfg.learner.trainer.loggers)
    tracing.check(cfg.tracing)
    check_outputs(cfg)
    pf.check_ports(stack_bindings(cfg, ports))
