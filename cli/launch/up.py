"""`dgrpo up`: the whole stack on one host — rewarder, N sampler replicas and the learner as local processes.

Wiring: every service reads the same resolved config file (written to `<log_dir>/<run_name>/stack.yaml`) plus
its own port overrides, so there is one source of truth. Ports are picked free at start, so several stacks (and
the test suite) can share a machine. Each service's output is prefixed with its name and also kept in
`<run>/logs/<service>.log`.

Every service binds 127.0.0.1 and requires a token: the one configured (`auth.token_file` or `DGRPO_TOKEN`), else
a fresh one per run, kept owner-only in `<run>/token` for other clients. Children inherit it through DGRPO_TOKEN;
health, which `up` polls, needs none.

Supervision (cli/launch/supervisor.py), as `docker compose up` does it and a bit more: the rewarder and samplers start
first and must answer gRPC health SERVING; then the learner runs. A learner that exits non-zero or by a signal (not a
configuration error, exit 2) is restarted as the services below are and resumes from its newest checkpoint, as compose's
`on-failure` and Kubernetes do. Every death is said in one line naming the service, the signal or exit code and the
likely cause, out of memory only on the kernel's own record (cli/launch/exits.py), with `dgrpo plan`'s figure and the
knob to turn first. A sampler or the rewarder that dies meanwhile is reaped (its whole process group, vLLM's engine and
workers included, and the shared memory only it used) and restarted on its port after a backoff, at most --max-restarts
times within 10 minutes; one that stops answering its gRPC health check without exiting (frozen, cut off) is killed
after --hung-restart-s and restarted the same way (cli/launch/hang_watch.py). Training goes on throughout (the
learner's calls to a dead replica go to the others or wait for it to come back, and a restarted sampler catches up to
the current weights before it serves). When every sampler, or the rewarder, is given up, the learner is stopped first:
it drops the step it cannot finish and keeps its last completed step in a checkpoint; then the rest is stopped and `up`
exits 1. When the learner finishes, everything is stopped and a report is written. Ctrl-C (or SIGTERM) asks the learner
to stop after its step (it checkpoints, and the report covers the steps that ran), a second one to drop the step in
flight, a third kills it. SIGHUP is forwarded to the rewarder: it reloads its reward specification in place (hot swap)
while training goes on. However `up` itself ends (SIGKILL and the OOM killer included), every service it started ends
within seconds, with its process tree and shared memory (cli/launch/lifeline.py). """

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from dgrpo.cli.launch.supervisor import Service, Stack
from dgrpo.cli.launch.terminal import Progress
from dgrpo.common import devices
from dgrpo.common.auth_config import TOKEN_ENV
from dgrpo.common.config import ConfigError, load_config, to_yaml
from dgrpo.common.preflight import check_folder, pick_free_ports
from dgrpo.weights.transports import transport_for

# A symlink to ../configs in the tree; package data when installed.
REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_CONFIG = REPO_CONFIGS / "cpu-demo.yaml"


def stable_free_port() -> int:
    """A free port below the kernel's ephemeral range, never one this process handed out before (why below that
    range: common/preflight.py pick_free_ports)."""
    return pick_free_ports(1)[0]


def resolve_stack(args) -> tuple:
    """Load the config (the CPU demo when no --config is given), write demo data if needed (and a bundled task's files
    the config names when they are missing), pick ports, and run the preflight (data, output folders, ports) before
    any service starts. Keys given on the command line are kept."""
    from dgrpo.cli.launch.preflight import assign_ports, covers, file_keys, given_keys, preflight_stack
    from dgrpo.cli.stack import StackConfig

    config_file = args.config
    if config_file is None:
        if not DEMO_CONFIG.is_file():
            raise ConfigError(f"no --config given and the demo config {DEMO_CONFIG} is missing")
        config_file = DEMO_CONFIG
    given = given_keys(args.overrides)
    cfg = load_config(StackConfig, config_file, args.overrides)
    run_dir = Path(cfg.learner.trainer.log_dir) / cfg.learner.trainer.run_name
    extra: list[str] = []
    if args.config is None and not args.no_demo_data:
        demo_train, demo_val = (not covers(given, f"learner.data.{k}") for k in ("train_files", "val_files"))
        if demo_train:
            from dgrpo.cli.tasks import DEMO_TASK, write_task

            check_folder("learner.trainer.log_dir", run_dir)  # the demo data is written there
            train, val = write_task(run_dir / "data", DEMO_TASK)
            extra.append(f"learner.data.train_files=[{train}]")
            if demo_val:
                extra.append(f"learner.data.val_files=[{val}]")
        elif demo_val:  # the demo's validation set does not go with the user's training data
            extra.append("learner.data.val_files=[]")
            print("dgrpo up: learner.data.train_files given without learner.data.val_files: no validation",
                  flush=True)
    ports = assign_ports(cfg, given, args.samplers)
    replaced = [k for k in file_keys(args.config) if not covers(given, k)]
    if replaced:
        print(f"dgrpo up: local free ports replace the config file's {', '.join(replaced)} (set them on the command "
              "line to keep them)", flush=True)
    cfg = load_config(StackConfig, config_file, [*extra, *ports.overrides, *args.overrides])  # the user's win
    cfg.check_whole_stack()
    if not args.no_demo_data:  # a config naming a bundled task's files (configs/cpu-demo.yaml: data/arith-*.parquet)
        from dgrpo.cli.tasks import announce_written, write_missing_task_files

        announce_written("dgrpo up", write_missing_task_files(cfg.learner.data))
    preflight_stack(cfg, ports)
    cfg.auth.token()  # a bad token file fails here, once; the services read the same file (or inherit DGRPO_TOKEN)
    return cfg, run_dir, ports.sampler_ports, ports.rewarder_port


def run(args) -> int:
    try:
        cfg, run_dir, sampler_ports, rewarder_port = resolve_stack(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"dgrpo up: {e}", file=sys.stderr)
        return 2
    from dgrpo.cli.doctor.command import SERVICES, report_failures, startup_failures

    # `dgrpo doctor`'s checks for every service (ports: preflight_stack checked the ones up assigned).
    if report_failures("dgrpo up", startup_failures(cfg, SERVICES, ports=False)):
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "stack.yaml"
    config_path.write_text(to_yaml(cfg))
    print(f"dgrpo up: run {cfg.learner.trainer.run_name}: {len(sampler_ports)} sampler(s), rewarder, learner; "
          f"config {config_path}, logs {run_dir / 'logs'}", flush=True)
    if cfg.auth.token() is None:
        os.environ[TOKEN_ENV] = _run_token(run_dir / "token")  # every child inherits it; never on a command line
        print(f"dgrpo up: every service requires this run's token, in {run_dir / 'token'}", flush=True)

    stack = Stack(config_path, run_dir, color=sys.stdout.isatty(), max_restarts=args.max_restarts,
                  start_timeout=args.start_timeout, hung_restart_s=args.hung_restart_s,
                  weights_shm_dir=cfg.weights.shm_dir if transport_for(cfg.weights).slots_in_shm_dir else None)
    interrupted = {"count": 0}

    def on_interrupt(signum, frame):
        # 1st: the learner stops after its step (checkpoint); 2nd: it drops the step in flight and keeps the last
        # completed one; 3rd: killed.
        interrupted["count"] += 1
        n = interrupted["count"]
        print(f"\ndgrpo up: {['stopping after this step', 'dropping the step in flight', 'killing'][min(n, 3) - 1]}"
              " ...", flush=True)
        stack.signal("learner", signal.SIGTERM if n < 3 else signal.SIGKILL, stopping=True)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_interrupt)
    signal.signal(signal.SIGHUP, lambda *_: stack.signal("rewarder", signal.SIGHUP))

    code = 1
    try:
        code = _train(stack, cfg, args, run_dir, sampler_ports, rewarder_port, interrupted)
    except (RuntimeError, TimeoutError) as e:
        print(f"dgrpo up: {e}", file=sys.stderr, flush=True)
    finally:
        stack.stop_all(timeout=args.stop_timeout)  # reaps every group; with shm, dead owners' weight slots too
        print(f"dgrpo up: stopped (exit {code}); logs in {run_dir / 'logs'}", flush=True)
    return code


def _own_cores(cfg, index: int, replicas: int) -> list[str]:
    """Replicas on this host get cores of their own unless the config lists cores: under `auto` vLLM binds every
    replica to the same cores, under `all` each binds every core. The setting only applies on CPU
    (sampler/server.py)."""
    cores = devices.replica_cpu_cores(index, replicas) if cfg.sampler.cpu_cores in ("auto", "all") else None
    return [f"sampler.cpu_cores='{cores}'"] if cores else []  # quoted: a lone core number is YAML's int


def _train(stack: Stack, cfg, args, run_dir: Path, sampler_ports, rewarder_port, interrupted: dict) -> int:
    """Start the services, run the learner under supervision; returns `up`'s exit code."""
    rewarder = stack.start(Service("rewarder", "rewarder", [], rewarder_port))
    samplers = [stack.start(Service(f"sampler-{i}", "sampler", [f"sampler.port={p}", f"sampler.replica_id=sampler-{i}",
                                                                *_own_cores(cfg, i, len(sampler_ports))], p))
                for i, p in enumerate(sampler_ports)]
    for svc in [rewarder, *samplers]:
        stack.wait_serving(svc, args.start_timeout)
        stack.serving(svc)
        if interrupted["count"]:
            return 130
    learner = stack.start(Service("learner", "learner", []))
    stack.hang.start()
    progress = Progress(run_dir / "metrics.jsonl", cfg.learner.trainer.total_training_steps)
    while not stack.learner_ended(learner):  # a learner that crashed is restarted and resumes meanwhile
        lost = stack.supervise()
        if lost is not None:
            stack.say(f"{lost}: stopping the learner (it keeps its last completed step)")
            stack.stop_learner(learner, abandon_step=True, timeout=args.stop_timeout)
            return 1
        progress.update()
        time.sleep(0.5)
    progress.update()
    progress.close()
    learner.expected_exit = True
    code = learner.proc.returncode
    if code == 0:  # finished, or stopped by Ctrl-C after a step: the report covers the steps that ran
        from dgrpo.cli.launch.report import write_report

        write_report(run_dir, export_dir=None if interrupted["count"] else cfg.learner.checkpoint.export_dir)
    return 130 if interrupted["count"] and code == 0 else code


def _run_token(path: Path) -> str:
    """A fresh token for this run, kept owner-only at `path` for clients such as grpcurl."""
    import secrets

    from dgrpo.cli.token import write_token

    token = secrets.token_urlsafe(32)
    write_token(path, token)
    return token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dgrpo up",
        description="Run the whole stack locally: rewarder, N sampler replicas, learner. With no --config: the "
                    "CPU demo (the bundled SmolLM2-135M-Instruct learns arithmetic, about 6 minutes on 2 cores).",
        epilog="Overrides: dotted KEY=VALUE pairs as for every dgrpo command (see `dgrpo learner --help`). "
               "Send SIGHUP to `dgrpo up` to make the rewarder reload its reward specification in place.",
    )
    parser.add_argument("--config", type=Path, help="stack YAML (default: configs/cpu-demo.yaml with generated data)")
    parser.add_argument("--samplers", type=int, default=1, help="sampler replicas to start (default 1)")
    parser.add_argument("--no-demo-data", action="store_true",
                        help="do not generate the bundled tasks' data: neither the demo's own copy (no --config) nor "
                             "the missing <task>-train/-val files a config names")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a service to become healthy")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of a dead sampler, rewarder or learner (a crashed learner resumes from its "
                             "newest checkpoint) within 10 minutes before it is given up (default 3)")
    parser.add_argument("--hung-restart-s", type=float, default=60.0, metavar="S",
                        help="kill and restart a sampler or the rewarder that has not answered its gRPC health check "
                             "for S seconds although its process runs (frozen, cut off); 0: never (default 60). "
                             "The learner moves a hung replica's prompts to the others within seconds regardless")
    parser.add_argument("--stop-timeout", type=float, default=300,
                        help="seconds the learner gets to finish or drop its step and checkpoint when stopping")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.samplers < 1:
        parser.error("--samplers must be >= 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if args.hung_restart_s < 0:
        parser.error("--hung-restart-s must be >= 0")
    return run(args)
