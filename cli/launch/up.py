"""`dgrpo up`: the whole stack on one host — rewarder, N sampler replicas and the learner as local processes.

Wiring: every service reads the same resolved config file (written to `<log_dir>/<run_name>/stack.yaml`) plus
its own port overrides, so there is one source of truth. Ports are picked free at start, so several stacks (and
the test suite) can share a machine. Each service's output is prefixed with its name and also kept in
`<run>/logs/<service>.log`.

Every service binds 127.0.0.1 and requires a token: the one configured (`auth.token_file` or `DGRPO_TOKEN`), else
a fresh one per run, kept owner-only in `<run>/token` for other clients. Children inherit it through DGRPO_TOKEN;
health, which `up` polls, needs none.

Supervision, as `docker compose up` does it and a bit more: the rewarder and samplers start first and must answer
gRPC health SERVING; then the learner runs. A sampler or the rewarder that dies meanwhile is reaped (its whole
process group, vLLM's engine and workers included, and the shared memory only it used) and restarted on its port
after a backoff, at most --max-restarts times within 10 minutes; one that stops answering its gRPC health check
without exiting (frozen, cut off) is killed after --hung-restart-s and restarted the same way
(cli/launch/hang_watch.py).
Training goes on throughout (the learner's calls
to a dead replica go to the others or wait for it to come back, and a restarted sampler catches up to the current
weights before it serves). When every sampler, or the rewarder, is given up, the learner is stopped first: it drops
the step it cannot finish and keeps its last completed step in a checkpoint; then the rest is stopped and `up`
exits 1. When the learner finishes, everything is stopped and a report is written. Ctrl-C (or SIGTERM) asks the
learner to stop after its step (it checkpoints, and the report covers the steps that ran), a second one to drop
the step in flight, a third kills it. SIGHUP is forwarded to the rewarder: it reloads its reward specification in
place (hot swap) while training goes on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dgrpo.cli.launch import procs
from dgrpo.cli.launch.hang_watch import HangWatch
from dgrpo.cli.launch.terminal import Progress, worth_showing
from dgrpo.common import devices
from dgrpo.common.auth_config import TOKEN_ENV
from dgrpo.common.config import ConfigError, load_config, to_yaml
from dgrpo.common.preflight import check_folder, pick_free_ports
from dgrpo.weights.transports import transport_for

# A symlink to ../configs in the tree; package data when installed.
REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEMO_CONFIG = REPO_CONFIGS / "cpu-demo.yaml"
COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m", "\033[31m"]
RESET = "\033[0m"
RESTART_WINDOW_S = 600.0  # a service up this long gets its whole restart budget back
MAX_RESTART_BACKOFF_S = 60.0
SHM_SNAPSHOT_S = 10.0  # how often the shared memory of running services is noted
ABANDON_AFTER_S = 5.0  # grace for a learner whose step cannot finish before it is told to abandon it


@dataclass
class Service:
    name: str
    command: str
    overrides: list[str]
    port: int | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    pump: threading.Thread | None = None
    prefix: str = ""
    expected_exit: bool = False
    lines: list[str] = field(default_factory=list)
    restarts: int = 0
    """Restarts since it last stayed up for RESTART_WINDOW_S."""
    restarting: bool = False
    gone: bool = False
    """Dead with no restart left: the run goes on without it, or stops if it was needed."""
    serving_since: float | None = None
    shm: set[str] = field(default_factory=set)
    """/dev/shm files its processes were seen using: unlinked when it is reaped, unless still in use."""


def stable_free_port() -> int:
    """A free port below the kernel's ephemeral range, never one this process handed out before (why below that
    range: common/preflight.py pick_free_ports)."""
    return pick_free_ports(1)[0]


class Stack:
    """Starts, watches, restarts and stops the local processes of one run."""

    def __init__(self, config_path: Path, run_dir: Path, color: bool, *, max_restarts: int = 3,
                 restart_backoff_s: float = 2.0, start_timeout: float = 600, weights_shm_dir: str | None = None,
                 hung_restart_s: float = 60.0):
        self.config_path, self.run_dir, self.color = config_path, run_dir, color
        self.weights_shm_dir, self.hung_restart_s = weights_shm_dir, hung_restart_s
        self.hang = HangWatch(self._health_channel)
        self.max_restarts, self.restart_backoff_s, self.start_timeout = max_restarts, restart_backoff_s, start_timeout
        self.services: list[Service] = []
        self._print_lock = threading.Lock()
        self._stopping = threading.Event()
        self._last_snapshot = 0.0
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def say(self, message: str) -> None:
        with self._print_lock:
            tqdm.write(f"dgrpo up: {message}", file=sys.stdout)

    def start(self, svc: Service) -> Service:
        color = COLORS[len(self.services) % len(COLORS)] if self.color else ""
        svc.prefix = f"{color}{svc.name:<10}|{RESET if self.color else ''} "
        svc.log_path = self.run_dir / "logs" / f"{svc.name}.log"
        self.services.append(svc)
        self._launch(svc)
        return svc

    def _launch(self, svc: Service) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Its own session, so its whole tree (vLLM's engine core and workers) is one process group to reap.
        svc.proc = subprocess.Popen(
            [sys.executable, "-m", "dgrpo.cli", svc.command, "--config", str(self.config_path), *svc.overrides],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True, bufsize=1,
        )
        svc.serving_since = None
        svc.pump = threading.Thread(target=self._pump, args=(svc, svc.proc), daemon=True)
        svc.pump.start()

    def _pump(self, svc: Service, proc: subprocess.Popen) -> None:
        # A restarted service appends to its log: what killed it stays readable above.
        with open(svc.log_path, "a" if svc.restarts else "w") as log_file:
            if svc.restarts:
                log_file.write(f"---- dgrpo up: restart {svc.restarts} of {svc.name} ----\n")
            for line in proc.stdout:
                log_file.write(line)
                log_file.flush()
                svc.lines = (svc.lines + [line])[-50:]
                if worth_showing(line):
                    with self._print_lock:
                        tqdm.write(svc.prefix + line.rstrip("\n"), file=sys.stdout)

    def _health_channel(self, address: str):
        from dgrpo.cli.stack import StackConfig
        from dgrpo.common import auth
        from dgrpo.common.auth_config import Credentials

        tls = load_config(StackConfig, self.config_path).auth.tls.material()  # with auth.tls, health is TLS too
        return auth.health_channel(address, Credentials(tls=tls))

    def wait_serving(self, svc: Service, timeout: float) -> None:
        from dgrpo.common.auth import not_serving

        deadline = time.monotonic() + timeout
        with self._health_channel(f"127.0.0.1:{svc.port}") as channel:
            while time.monotonic() < deadline:
                if svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} while starting:\n"
                                       + "".join(svc.lines[-20:]))
                if not_serving(channel, timeout=2) is None:
                    return
                time.sleep(0.5)
        raise TimeoutError(f"{svc.name} not SERVING after {timeout:.0f}s (log: {svc.log_path})")

    def serving(self, svc: Service) -> None:
        """Mark `svc` up (after wait_serving) and note the shared memory it uses now."""
        svc.serving_since = time.monotonic()
        svc.shm |= procs.shm_files(procs.group_pids(svc.proc.pid))
        if svc.command != "learner" and self.hung_restart_s:
            self.hang.watch(svc.port)

    def signal(self, name_prefix: str, sig: int) -> None:
        for svc in self.services:
            if svc.name.startswith(name_prefix) and svc.proc.poll() is None:
                svc.proc.send_signal(sig)

    # ---- supervision while the learner trains -----------------------------------------------------------------

    def supervise(self) -> str | None:
        """One round: reap and restart dead samplers and the rewarder. Returns why training cannot go on (every
        sampler, or the rewarder, dead with no restart left), else None. The learner needs no help meanwhile: its
        calls to a dead replica go to the others, or wait for it (rollout.step_timeout_s, reward_timeout_s)."""
        now = time.monotonic()
        snapshot = now - self._last_snapshot > SHM_SNAPSHOT_S
        for svc in self.services:
            if svc.command == "learner" or svc.expected_exit or svc.restarting or svc.gone:
                continue
            if svc.proc.poll() is None:
                if svc.serving_since is not None:
                    silent = self.hang.silent_for(svc.port)
                    if self.hung_restart_s and silent > self.hung_restart_s:
                        self.say(f"{svc.name} has not answered its health check for {silent:.0f}s (frozen or cut "
                                 f"off; --hung-restart-s {self.hung_restart_s:g}): killing it to restart it")
                        self.hang.unwatch(svc.port)
                        os.killpg(svc.proc.pid, signal.SIGKILL)  # also ends a stopped process group
                        continue  # the next round reaps and restarts it like any service that died
                    if snapshot:
                        svc.shm |= procs.shm_files(procs.group_pids(svc.proc.pid))
                    if svc.restarts and now - svc.serving_since > RESTART_WINDOW_S:
                        svc.restarts = 0  # up for a good while: a crash next week gets the full budget again
                continue
            self.say(f"{svc.name} exited with {svc.proc.returncode}")
            self.reap(svc)
            if svc.restarts >= self.max_restarts:
                svc.gone = True
                self.say(f"{svc.name} is gone: it died {svc.restarts + 1} times within {RESTART_WINDOW_S:.0f}s "
                         f"(--max-restarts {self.max_restarts})")
            else:
                svc.restarting = True
                threading.Thread(target=self._restart, args=(svc,), daemon=True).start()
        if snapshot:
            self._last_snapshot = now
        samplers = [s for s in self.services if s.command == "sampler"]
        if samplers and all(s.gone for s in samplers):
            return "every sampler is gone"
        if any(s.gone for s in self.services if s.command == "rewarder"):
            return "the rewarder is gone"
        return None

    def _restart(self, svc: Service) -> None:
        """Wait out the backoff, start `svc` again on its port, wait for SERVING (runs in its own thread)."""
        try:
            delay = min(self.restart_backoff_s * 2 ** svc.restarts, MAX_RESTART_BACKOFF_S)
            self.say(f"restarting {svc.name} in {delay:.0f}s (restart {svc.restarts + 1} of {self.max_restarts})")
            if self._stopping.wait(delay):
                return
            svc.restarts += 1
            self._launch(svc)
            try:
                self.wait_serving(svc, self.start_timeout)
            except (RuntimeError, TimeoutError) as e:
                self.say(f"{svc.name} did not come back: {str(e).splitlines()[0]}")
                if svc.proc.poll() is None:  # hung while starting: the next round reaps it and decides
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                    svc.proc.wait()
                return
            self.serving(svc)
            self.say(f"{svc.name} is back (SERVING after restart {svc.restarts})")
        finally:
            svc.restarting = False

    def reap(self, svc: Service) -> None:
        """Kill what is left of `svc`'s process group and unlink the shared memory only it used."""
        if svc.port is not None:
            self.hang.unwatch(svc.port)
        pgid = svc.proc.pid
        svc.shm |= procs.shm_files(procs.group_pids(pgid))
        leftovers = procs.kill_group(pgid)
        if svc.proc.poll() is None:
            svc.proc.wait()
        if svc.pump is not None:
            svc.pump.join(5)
        removed = procs.unlink_orphaned(svc.shm)
        svc.shm -= set(removed)
        if self.weights_shm_dir is not None:  # e.g. a dead sampler's tcp staging copy
            from dgrpo.weights.shm import reclaim_stale

            removed += reclaim_stale(self.weights_shm_dir)
        if leftovers or removed:
            self.say(f"{svc.name}: reaped {len(leftovers)} leftover process(es) and {len(removed)} shared-memory "
                     "segment(s)")

    # ---- stopping ---------------------------------------------------------------------------------------------

    def stop_learner(self, learner: Service, *, abandon_step: bool, timeout: float) -> None:
        """SIGTERM: the learner stops after its step and checkpoints. With `abandon_step` (the step cannot finish:
        its samplers or rewarder are gone) a second SIGTERM follows: it drops the step in flight and keeps the last
        completed one. Waits up to `timeout` for the checkpoint, then kills."""
        learner.expected_exit = True
        if learner.proc.poll() is not None:
            return
        learner.proc.send_signal(signal.SIGTERM)
        if abandon_step:
            try:
                learner.proc.wait(ABANDON_AFTER_S)
                return
            except subprocess.TimeoutExpired:
                learner.proc.send_signal(signal.SIGTERM)
        try:
            learner.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.say(f"the learner did not stop within {timeout:.0f}s: killing it (its last checkpoint stays)")
            os.killpg(learner.proc.pid, signal.SIGKILL)
            learner.proc.wait()

    def stop_all(self, timeout: float = 60) -> None:
        """The learner first (it may need the others to finish its step, then checkpoints), then the rest:
        SIGTERM, SIGKILL what hangs, then every process group is reaped with its shared memory."""
        self._stopping.set()
        self.hang.stop()
        for svc in self.services:
            if svc.command == "learner":
                self.stop_learner(svc, abandon_step=False, timeout=timeout)
        others = [s for s in self.services if s.command != "learner"]
        for svc in others:
            svc.expected_exit = True
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for svc in others:
            try:
                svc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(svc.proc.pid, signal.SIGKILL)
                svc.proc.wait()
        for svc in self.services:
            self.reap(svc)


def resolve_stack(args) -> tuple:
    """Load the config (the CPU demo when no --config is given), write demo data if needed, pick ports, and run the
    preflight (data, output folders, ports) before any service starts. Keys given on the command line are kept."""
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
        stack.signal("learner", signal.SIGTERM if n < 3 else signal.SIGKILL)

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
    while learner.proc.poll() is None:
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
    parser.add_argument("--no-demo-data", action="store_true", help="do not generate the demo task's data")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a service to become healthy")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="restarts of a dead sampler or rewarder within 10 minutes before it is given up "
                        "(default 3)")
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
