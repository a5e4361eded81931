"""`dgrpo up`: the whole stack on one host — rewarder, N sampler replicas and the learner as local processes.

Wiring: every service reads the same resolved config file (written to `<log_dir>/<run_name>/stack.yaml`) plus
its own port overrides, so there is one source of truth. Ports are picked free at start, so several stacks (and
the test suite) can share a machine. Each service's output is prefixed with its name and also kept in
`<run>/logs/<service>.log`.

Every service binds 127.0.0.1. With a token (`auth.token_file` or `DGRPO_TOKEN`, inherited by every child),
each of them requires it and the learner's clients send it; health, which `up` polls, needs none.

Supervision, as `docker compose up` does it: the rewarder and samplers start first and must answer gRPC health
SERVING; then the learner runs. When the learner finishes, everything is stopped and a report is written.
Ctrl-C (or SIGTERM) asks the learner to stop after its step (it checkpoints), then stops the rest. If any service
dies, the whole stack is stopped and `up` exits non-zero. SIGHUP is forwarded to the rewarder: it reloads its
reward specification in place (hot swap) while training goes on.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dgrpo.common.config import ConfigError, load_config, to_yaml
from dgrpo.common.preflight import check_folder, pick_free_ports

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_CONFIG = REPO_CONFIGS / "cpu-demo.yaml"
COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[31m"]
RESET = "\033[0m"


@dataclass
class Service:
    name: str
    command: str
    overrides: list[str]
    port: int | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    pump: threading.Thread | None = None
    expected_exit: bool = False
    lines: list[str] = field(default_factory=list)


def stable_free_port() -> int:
    """A free port below the kernel's ephemeral range, never one this process handed out before (why below that
    range: common/preflight.py pick_free_ports)."""
    return pick_free_ports(1)[0]


class Stack:
    """Starts, watches and stops the local processes of one run."""

    def __init__(self, config_path: Path, run_dir: Path, color: bool):
        self.config_path, self.run_dir, self.color = config_path, run_dir, color
        self.services: list[Service] = []
        self._print_lock = threading.Lock()
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, svc: Service) -> Service:
        svc.log_path = self.run_dir / "logs" / f"{svc.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        svc.proc = subprocess.Popen(
            [sys.executable, "-m", "dgrpo.cli", svc.command, "--config", str(self.config_path), *svc.overrides],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True, bufsize=1,
        )
        color = COLORS[len(self.services) % len(COLORS)] if self.color else ""
        prefix = f"{color}{svc.name:<10}|{RESET if self.color else ''} "
        svc.pump = threading.Thread(target=self._pump, args=(svc, prefix), daemon=True)
        svc.pump.start()
        self.services.append(svc)
        return svc

    def _pump(self, svc: Service, prefix: str) -> None:
        with open(svc.log_path, "w") as log_file:
            for line in svc.proc.stdout:
                log_file.write(line)
                log_file.flush()
                svc.lines = (svc.lines + [line])[-50:]
                if _worth_showing(line):
                    with self._print_lock:
                        tqdm.write(prefix + line.rstrip("\n"), file=sys.stdout)

    def wait_serving(self, svc: Service, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from dgrpo.cli.stack import StackConfig
        from dgrpo.common import auth

        tls = load_config(StackConfig, self.config_path).auth.tls.material()  # with auth.tls, health is TLS too
        deadline = time.monotonic() + timeout
        with auth.health_channel(f"127.0.0.1:{svc.port}", auth.Credentials(tls=tls)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} while starting:\n"
                                       + "".join(svc.lines[-20:]))
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"{svc.name} not SERVING after {timeout:.0f}s (log: {svc.log_path})")

    def failed(self) -> Service | None:
        for svc in self.services:
            if svc.proc.poll() is not None and not svc.expected_exit:
                return svc
        return None

    def signal(self, name_prefix: str, sig: int) -> None:
        for svc in self.services:
            if svc.name.startswith(name_prefix) and svc.proc.poll() is None:
                svc.proc.send_signal(sig)

    def stop_all(self, timeout: float = 60) -> None:
        """SIGTERM everything still running (learner first, so it can checkpoint), SIGKILL what hangs."""
        for svc in sorted(self.services, key=lambda s: s.command != "learner"):
            svc.expected_exit = True
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for svc in self.services:
            try:
                svc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait()
        for svc in self.services:
            if svc.pump is not None:
                svc.pump.join(5)


OUR_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+) \[\w+\] (?P<logger>\S+):")
TRACEBACK_LINE = re.compile(r"^(Traceback|  File |\w+(Error|Exception)\b)")


def _worth_showing(line: str) -> bool:
    """vLLM and transformers are chatty: the terminal shows dgrpo's own log lines, errors and tracebacks
    (every line still goes to the service's log file)."""
    m = OUR_LOG_LINE.match(line)
    if m:
        return m["logger"].startswith("dgrpo") or m["level"] in ("ERROR", "CRITICAL")
    if line.startswith("("):  # vLLM's engine / worker processes
        return " ERROR " in line
    return line.startswith("dgrpo ") or bool(TRACEBACK_LINE.match(line))


class Progress:
    """A progress bar with the live reward, fed by the learner's metrics.jsonl."""

    def __init__(self, metrics_path: Path, total: int | None):
        self.path, self.offset = metrics_path, 0
        # Off when stdout is not a terminal (CI, log files): the learner logs one line per step anyway.
        self.bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True, file=sys.stdout,
                        disable=not sys.stdout.isatty())

    def update(self) -> None:
        import json

        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a partial line: read it next time
                self.offset += len(line)
                record = json.loads(line)
                if "reward/mean" in record:
                    self.bar.update(1)
                    self.bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record.get('actor/kl', 0):.4f}",
                                         len=f"{record.get('response/length_mean', 0):.0f}", refresh=False)
                elif "val/reward_mean" in record:
                    self.bar.set_postfix_str(f"val reward {record['val/reward_mean']:.3f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def resolve_stack(args) -> tuple:
    """Load the config (the CPU demo when no --config is given), write demo data if needed, pick ports, and run the
    preflight (data, output folders, ports) before any service starts. Keys given on the command line are kept."""
    from dgrpo.cli.preflight import assign_ports, covers, file_keys, given_keys, preflight_stack
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
    preflight_stack(cfg, ports)
    cfg.auth.token()  # a bad token file fails here, once; the services read the same file (or inherit DGRPO_TOKEN)
    return cfg, run_dir, ports.sampler_ports, ports.rewarder_port


def run(args) -> int:
    try:
        cfg, run_dir, sampler_ports, rewarder_port = resolve_stack(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"dgrpo up: {e}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "stack.yaml"
    config_path.write_text(to_yaml(cfg))
    print(f"dgrpo up: run {cfg.learner.trainer.run_name}: {len(sampler_ports)} sampler(s), rewarder, learner; "
          f"config {config_path}, logs {run_dir / 'logs'}", flush=True)

    stack = Stack(config_path, run_dir, color=sys.stdout.isatty())
    interrupted = {"count": 0}

    def on_interrupt(signum, frame):
        interrupted["count"] += 1
        print(f"\ndgrpo up: {'stopping' if interrupted['count'] == 1 else 'stopping now'} ...", flush=True)
        stack.signal("learner", signal.SIGTERM if interrupted["count"] == 1 else signal.SIGKILL)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_interrupt)
    signal.signal(signal.SIGHUP, lambda *_: stack.signal("rewarder", signal.SIGHUP))

    code = 1
    try:
        rewarder = stack.start(Service("rewarder", "rewarder", [], rewarder_port))
        samplers = [stack.start(Service(f"sampler-{i}", "sampler",
                                        [f"sampler.port={p}", f"sampler.replica_id=sampler-{i}"], p))
                    for i, p in enumerate(sampler_ports)]
        for svc in [rewarder, *samplers]:
            stack.wait_serving(svc, args.start_timeout)
            if interrupted["count"]:
                return 130
        learner = stack.start(Service("learner", "learner", []))
        progress = Progress(run_dir / "metrics.jsonl", cfg.learner.trainer.total_training_steps)
        while learner.proc.poll() is None:
            broken = stack.failed()
            if broken is not None and broken is not learner:
                print(f"dgrpo up: {broken.name} exited with {broken.proc.returncode}; stopping the stack", flush=True)
                return 1
            progress.update()
            time.sleep(0.5)
        progress.update()
        progress.close()
        learner.expected_exit = True
        code = learner.proc.returncode
        if code == 0 and not interrupted["count"]:
            from dgrpo.cli.report import write_report

            write_report(run_dir, export_dir=cfg.learner.checkpoint.export_dir)
        return 130 if interrupted["count"] and code == 0 else code
    except (RuntimeError, TimeoutError) as e:
        print(f"dgrpo up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop_all()
        # A learner killed hard (second Ctrl-C) leaves its weight slots behind: reclaim dead owners' segments.
        from dgrpo.weights.shm import reclaim_stale

        if cfg.weights.transport == "shm":
            reclaim_stale(cfg.weights.shm_dir)
        print(f"dgrpo up: stopped (exit {code}); logs in {run_dir / 'logs'}", flush=True)


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
    parser.add_argument("--no-demo-data", action="store_true", help="do not generate the demo task's data")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a service to become healthy")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.samplers < 1:
        parser.error("--samplers must be >= 1")
    return run(args)
