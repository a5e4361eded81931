"""The processes of one `dgrpo up` run: each started with its output prefixed and logged, watched (exit, gRPC
health, hang), reaped with its process group and the shared memory only it used, restarted after a backoff,
and stopped learner first. The command around it (config, ports, the run's report) is cli/launch/up.py."""

from __future__ import annotations

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
from dgrpo.cli.launch.exits import OomWatch, exit_cause, memory_advice, oom_counter_file, resume_point
from dgrpo.cli.launch.hang_watch import HangWatch
from dgrpo.cli.launch.lifeline import Lifeline
from dgrpo.cli.launch.terminal import worth_showing
from dgrpo.common.config import load_config

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
    oom: OomWatch | None = None
    """The OOM kill counter when it was last started (cli/launch/exits.py)."""
    killed_for: str = ""
    """Why `up` itself killed it (a hung service), so its death is not blamed on anyone else."""


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
        self._launching = threading.Lock()  # a restart's launch and a stop asked meanwhile: one after the other
        self._last_snapshot = 0.0
        self.lifeline = Lifeline()  # its services end with their trees when `up` dies, however (lifeline.py)
        self.oom_file = oom_counter_file()
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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.lifeline.child_env()}
        svc.oom, svc.killed_for = OomWatch.start(self.oom_file), ""
        # Its own session, so its whole tree (vLLM's engine core and workers) is one process group to reap.
        svc.proc = subprocess.Popen(
            [sys.executable, "-m", "dgrpo.cli", svc.command, "--config", str(self.config_path), *svc.overrides],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True, bufsize=1,
            pass_fds=self.lifeline.pass_fds(),
        )
        svc.serving_since = time.monotonic() if svc.command == "learner" else None  # the learner: up once started
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

    def signal(self, name_prefix: str, sig: int, *, stopping: bool = False) -> None:
        """Send `sig` to the services named so; `stopping`: they are asked to end, so are not restarted."""
        with self._launching:
            for svc in self.services:
                if svc.name.startswith(name_prefix):
                    svc.expected_exit = svc.expected_exit or stopping
                    if svc.proc.poll() is None:
                        svc.proc.send_signal(sig)

    def learner_ended(self, learner: Service) -> bool:
        """The learner is done: exited and neither restarting nor to be restarted (finished, stopped, given up)."""
        return learner.proc.poll() is not None and not learner.restarting and (
            learner.expected_exit or learner.gone or learner.proc.returncode == 0)

    def describe_exit(self, svc: Service) -> str:
        """How `svc` ended and the likely cause; out of memory: `dgrpo plan`'s figure and the first knob."""
        if svc.killed_for:
            return f"{svc.name} was killed by dgrpo up ({svc.killed_for})"
        oom = svc.oom.evidence(svc.proc.pid) if svc.oom else (None, "")
        line, out_of_memory = exit_cause(svc.name, svc.proc.returncode, oom, "".join(svc.lines[-20:]))
        if out_of_memory and svc.command in ("learner", "sampler"):
            line += f"; {memory_advice(self.config_path, svc.command)}"
        return line

    # ---- supervision while the learner trains -----------------------------------------------------------------

    def supervise(self) -> str | None:
        """One round: reap and restart dead samplers and the rewarder. Returns why training cannot go on (every
        sampler, or the rewarder, dead with no restart left), else None. The learner needs no help meanwhile: its
        calls to a dead replica go to the others, or wait for it (rollout.step_timeout_s, reward_timeout_s)."""
        now = time.monotonic()
        snapshot = now - self._last_snapshot > SHM_SNAPSHOT_S
        for svc in self.services:
            if svc.expected_exit or svc.restarting or svc.gone:
                continue
            if svc.command == "learner" and svc.proc.poll() is not None and (
                    svc.proc.returncode == 0 or self._stopping.is_set()):
                continue  # done: finished, or stopped after a step (Ctrl-C, the Stop RPC)
            if svc.proc.poll() is None:
                if svc.command == "learner":
                    if svc.restarts and now - svc.serving_since > RESTART_WINDOW_S:
                        svc.restarts = 0
                    continue
                if svc.serving_since is not None:
                    silent = self.hang.silent_for(svc.port)
                    if self.hung_restart_s and silent > self.hung_restart_s:
                        self.say(f"{svc.name} has not answered its health check for {silent:.0f}s (frozen or cut "
                                 f"off; --hung-restart-s {self.hung_restart_s:g}): killing it to restart it")
                        self.hang.unwatch(svc.port)
                        svc.killed_for = f"silent for {silent:.0f}s"
                        os.killpg(svc.proc.pid, signal.SIGKILL)  # also ends a stopped process group
                        continue  # the next round reaps and restarts it like any service that died
                    if snapshot:
                        svc.shm |= procs.shm_files(procs.group_pids(svc.proc.pid))
                    if svc.restarts and now - svc.serving_since > RESTART_WINDOW_S:
                        svc.restarts = 0  # up for a good while: a crash next week gets the full budget again
                continue
            line = self.describe_exit(svc)
            if svc.command == "learner" and svc.proc.returncode == 2:
                svc.gone = True
                self.say(f"{line}: a configuration or start-up error, which a restart would repeat: not restarted")
            elif svc.restarts >= self.max_restarts:
                svc.gone = True
                self.say(f"{line}; {svc.name} is gone: it died {svc.restarts + 1} times within "
                         f"{RESTART_WINDOW_S:.0f}s (--max-restarts {self.max_restarts})")
            else:
                delay = min(self.restart_backoff_s * 2 ** svc.restarts, MAX_RESTART_BACKOFF_S)
                resumes = f": {self._resume_point()}" if svc.command == "learner" else ""
                self.say(f"{line}; restarting it in {delay:.0f}s (restart {svc.restarts + 1} of "
                         f"{self.max_restarts}){resumes}")
                svc.restarting = True
            self.reap(svc)  # after the line saying why it died
            if svc.restarting:
                threading.Thread(target=self._restart, args=(svc, delay), daemon=True).start()
        if snapshot:
            self._last_snapshot = now
        samplers = [s for s in self.services if s.command == "sampler"]
        if samplers and all(s.gone for s in samplers):
            return "every sampler is gone"
        if any(s.gone for s in self.services if s.command == "rewarder"):
            return "the rewarder is gone"
        return None

    def _resume_point(self) -> str:
        from dgrpo.cli.stack import StackConfig

        try:
            return resume_point(load_config(StackConfig, self.config_path).learner.checkpoint)
        except Exception as e:  # noqa: BLE001 (only the line's wording depends on it)
            return f"it resumes as learner.checkpoint.resume says ({e})"

    def _restart(self, svc: Service, delay: float) -> None:
        """Wait out the backoff, start `svc` again (on its port; a service: wait for SERVING). In its own thread."""
        try:
            if self._stopping.wait(delay):
                return
            with self._launching:
                if svc.expected_exit or self._stopping.is_set():  # asked to stop meanwhile (Ctrl-C)
                    return
                svc.restarts += 1
                self._launch(svc)
            if svc.command == "learner":
                return  # it resumes from its checkpoint by itself (learner.checkpoint.resume)
            try:
                self.wait_serving(svc, self.start_timeout)
            except (RuntimeError, TimeoutError) as e:
                self.say(f"{svc.name} did not come back: {str(e).splitlines()[0]}")
                if svc.proc.poll() is None:  # hung while starting: the next round reaps it and decides
                    svc.killed_for = "not SERVING in time after its restart"
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
