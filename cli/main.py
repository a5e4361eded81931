"""`dgrpo <command> [--config FILE] [key=value ...]`.

The config is parsed and validated before any heavy import (torch, vLLM), so `--help` and config errors
answer in about a second. Each command then imports only its own service.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from dgrpo.common.config import ConfigError, describe, load_config, to_yaml

if TYPE_CHECKING:
    from dgrpo.cli.stack import StackConfig


# Each service is handed only its typed sections; the import stays inside, so a command loads only its service.
def _sampler(cfg: StackConfig) -> int:
    from dgrpo.sampler.server import main

    return main(cfg.model, cfg.sampler, cfg.weights, cfg.auth, cfg.learner.rollout.multi_turn, cfg.tracing,
                cfg.learner.lora)


def _rewarder(cfg: StackConfig) -> int:
    from dgrpo.rewarder.server import main

    return main(cfg.rewarder, cfg.auth, cfg.tracing)


def _learner(cfg: StackConfig) -> int:
    from dgrpo.cli.tasks import announce_written, write_missing_task_files

    # A config naming a bundled task's files (configs/cpu-demo.yaml: data/arith-*.parquet) runs on a fresh clone.
    announce_written("dgrpo learner", write_missing_task_files(cfg.learner.data))
    from dgrpo.learner.main import main

    return main(cfg.learner_run())


def _show_config(cfg: StackConfig) -> int:
    print(to_yaml(cfg), end="")
    return 0


# Commands that drive the whole stack also run StackConfig.check_whole_stack().
WHOLE_STACK = {"learner"}
# command -> (one-line purpose, config sections shown in --help, what runs it with the StackConfig)
COMMANDS: dict[str, tuple[str, tuple[str, ...], Callable[[StackConfig], int]]] = {
    "sampler": ("serve one sampler replica (vLLM engine over gRPC)",
                ("model", "sampler", "weights", "auth", "tracing"), _sampler),
    "rewarder": ("serve the reward service", ("rewarder", "auth", "tracing"), _rewarder),
    "learner": ("run GRPO training, driving samplers and rewarder",
                ("model", "learner", "sampler", "weights", "auth", "tracing"), _learner),
    "show-config": ("print the fully resolved configuration as YAML", (), _show_config),
}

OVERRIDE_HELP = (
    "Overrides: dotted KEY=VALUE pairs after the options, applied on top of --config, values parsed as YAML\n"
    "(e.g. sampler.gpu_memory_utilization=0.35 sampler.addresses='[a:1,b:2]'). Unknown keys and bad values\n"
    "fail at start, naming the key."
)


def _options_help(sections: tuple[str, ...]) -> str:
    from dgrpo.cli.stack import StackConfig

    lines = ["", "Options (key (type, default): meaning):"]
    for name in sections:
        field = StackConfig.model_fields[name]
        lines.append(f"\n[{name}] {field.description or ''}")
        lines.extend(describe(field.annotation, name + "."))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgrpo",
        description="Disaggregated GRPO: vLLM samplers, a reward service and a torch learner over gRPC.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDE_HELP,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("up", help="run the whole stack locally (rewarder, samplers, learner); `dgrpo up --help`",
                   add_help=False)
    sub.add_parser("import-config", help="a dgrpo config from a verl or TRL config; `dgrpo import-config --help`",
                   add_help=False)
    sub.add_parser("doctor", help="check versions, devices, environment, ports, /dev/shm, model before a launch",
                   add_help=False)
    sub.add_parser("plan", help="memory per device of each service, and the knob to turn when it does not fit",
                   add_help=False)
    for name, (purpose, sections, _) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=purpose,
            description=f"dgrpo {name}: {purpose}.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=OVERRIDE_HELP + (_options_help(sections) if sections else ""),
        )
        p.add_argument("--config", metavar="FILE", help="YAML file with the stack configuration")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides (see below)")
    return parser


def _reexec_on_host_allocator(cfg: StackConfig, argv: list[str]) -> None:
    """The CPU learner runs on tcmalloc where the system has it (common/devices.py host_allocator_env): the
    allocator is chosen when a process starts, so the learner starts again with it, keeping its PID, its arguments
    and its output (under `dgrpo up`, torchrun and Docker alike)."""
    from dgrpo.common.devices import detect_device, host_allocator_env

    if cfg.model.device not in ("auto", "cpu"):
        return
    # What would change on CPU first: detecting the device imports torch, which nothing here needs otherwise.
    env = host_allocator_env("cpu")
    if env and detect_device(cfg.model.device) == "cpu":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "dgrpo.cli", *argv], {**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    process_entry = argv is None  # the process's own command line: only then may it start itself again
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:  # the launcher has its own options (--samplers, ...)
        from dgrpo.cli.launch.up import main as up_main

        return up_main(argv[1:])
    if argv[:1] == ["import-config"]:  # reads a peer's file, not a stack config
        from dgrpo.cli.importers.command import main as import_main

        return import_main(argv[1:])
    if argv[:1] in (["doctor"], ["plan"]):  # their own options (--json, --device-memory-gb, ...)
        from importlib import import_module

        module = {"doctor": "dgrpo.cli.doctor.command", "plan": "dgrpo.cli.plan"}[argv[0]]
        return import_module(module).main(argv[1:])
    args = build_parser().parse_args(argv)
    from dgrpo.cli.stack import StackConfig

    try:
        cfg = load_config(StackConfig, args.config, args.overrides)
        if args.command in WHOLE_STACK:
            cfg.check_whole_stack()
    except ConfigError as e:
        print(f"dgrpo {args.command}: {e}", file=sys.stderr)
        return 2
    from dgrpo.cli.doctor.command import SERVICES, report_failures, startup_failures

    # The same checks as `dgrpo doctor`, for this service: refuse to start on a FAIL.
    if args.command in SERVICES and report_failures(f"dgrpo {args.command}", startup_failures(cfg, (args.command,))):
        return 2
    if args.command == "learner" and process_entry:
        _reexec_on_host_allocator(cfg, argv)
    if process_entry:  # started by `dgrpo up`: ends with its process tree when `up` dies (cli/launch/lifeline.py)
        from dgrpo.cli.launch.lifeline import watch_from_env

        watch_from_env(args.command)
    try:
        return int(COMMANDS[args.command][2](cfg) or 0)
    except (ConfigError, FileNotFoundError) as e:  # bad paths surface at start, as one clear line
        print(f"dgrpo {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
