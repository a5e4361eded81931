"""Why a service `dgrpo up` started died, in one line: the signal or exit code, and the likely cause, claimed only
on evidence.

The kernel's OOM killer leaves two records: a counter in the memory cgroup (`oom_kill` in cgroup v2's
memory.events, cgroup v1's memory.oom_control; it counts kills of the cgroup's processes by any OOM killer, the
host's included) and a line in the kernel log ("Killed process <pid>", readable to root or with dmesg_restrict 0).
`up` reads the counter when it starts a service and again when the service dies; a SIGKILL with the counter grown
meanwhile, or with the kernel's line naming the pid, is an OOM kill, and the line gives `dgrpo plan`'s figure for
that service and the knob to turn first. Without such evidence a SIGKILL is named as what it was: something sent
it. The same wording is what docs/deploy.md and docs/kubernetes.md tell a user to look for under compose and
Kubernetes.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
DEVICE_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|NPU out of memory|CUBLAS_STATUS_ALLOC_FAILED")
SIGNAL_CAUSES = {
    signal.SIGSEGV: "a crash in native code (torch, vLLM, a driver or a broken install); its log's last lines "
                    "say where",
    signal.SIGABRT: "aborted by native code (a failed check in torch, NCCL or CUDA); its log's last lines say which",
    signal.SIGBUS: "a mapped file lost its pages: most often /dev/shm full (`df -h /dev/shm`; `dgrpo plan` says "
                   "how much the weight slots need)",
    signal.SIGTERM: "something other than dgrpo up asked it to stop",
    signal.SIGINT: "something other than dgrpo up interrupted it",
}


def oom_counter_file(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = CGROUP_ROOT) -> Path | None:
    """The file holding this process's memory cgroup's `oom_kill` counter: cgroup v2's memory.events, else
    cgroup v1's memory.oom_control; None when neither is readable (the root cgroup has none)."""
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            candidates += [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates += [root / "memory" / rel / "memory.oom_control", root / "memory" / "memory.oom_control"]
    for candidate in candidates:
        if oom_kills(candidate) is not None:
            return candidate
    return None


def oom_kills(path: str | Path | None) -> int | None:
    """The `oom_kill` count in a memory.events or memory.oom_control file; None when unreadable."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def kernel_oom_line(pid: int, kmsg: str | Path = "/dev/kmsg") -> str | None:
    """The kernel log's line saying the OOM killer killed `pid`, when the log is readable."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    pattern = re.compile(rf"Killed process {pid}\b")
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # a record overwritten while reading: go on with the next
                    continue
                break  # EAGAIN: the end of the log
            if not record:
                break
            for line in record.decode(errors="replace").splitlines():  # /dev/kmsg: one record per read
                text = line.split(";", 1)[-1].strip()  # "<prio>,<seq>,<usec>,<flags>;<message>"
                if pattern.search(text):
                    found = text
    finally:
        os.close(fd)
    return found


@dataclass
class OomWatch:
    """The OOM counter when a service started; `evidence` compares it with now."""

    file: Path | None
    before: int | None

    @classmethod
    def start(cls, file: Path | None = None) -> OomWatch:
        file = file if file is not None else oom_counter_file()
        return cls(file, oom_kills(file))

    def evidence(self, pid: int, kmsg: str | Path = "/dev/kmsg") -> tuple[bool | None, str]:
        """(killed by the OOM killer: True/False, or None when nothing says; the record that says so)."""
        line = kernel_oom_line(pid, kmsg)
        if line:
            return True, f"the kernel log: {line[:160]}"
        after = oom_kills(self.file)
        if self.before is None or after is None:
            return None, "no OOM record readable here (no cgroup memory.events, kernel log not readable)"
        if after > self.before:
            return True, f"oom_kill {self.before} -> {after} in {self.file}"
        return False, f"oom_kill stayed {after} in {self.file}"


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def exit_cause(name: str, returncode: int, oom: tuple[bool | None, str], log_tail: str = "") -> tuple[str, bool]:
    """One line: how `name` ended and the likely cause; and whether memory ran out (then the caller adds the
    plan's figure and first knob)."""
    if returncode < 0:
        sig = signal_name(returncode)
        if -returncode == signal.SIGKILL:
            killed, record = oom
            if killed:
                return f"{name} was killed by SIGKILL: the kernel's OOM killer ({record}): out of memory", True
            if killed is False:
                return (f"{name} was killed by SIGKILL: not by the kernel's OOM killer as far as its records show "
                        f"({record}); something sent it"), False
            return f"{name} was killed by SIGKILL: the OOM killer or something else; {record}", False
        cause = SIGNAL_CAUSES.get(-returncode)
        return f"{name} was killed by {sig}" + (f": {cause}" if cause else ""), False
    if DEVICE_OOM.search(log_tail):
        return f"{name} exited with code {returncode}: out of device memory (its log names the allocation)", True
    return f"{name} exited with code {returncode}" + ("" if returncode == 0 else ": its log's last lines say why"), \
        False


def memory_advice(config_path: Path, command: str) -> str:
    """`dgrpo plan`'s figure for `command`'s service (learner or sampler) and the knob to turn first, or where to
    get them when the plan cannot be made here."""
    from dgrpo.cli.doctor.devices import device_info, resolve_device
    from dgrpo.cli.doctor.memory import plan_stack
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config
    from dgrpo.common.preflight import fmt_bytes

    try:
        cfg = load_config(StackConfig, config_path)
        device = resolve_device(cfg.model.device)[0]
        info = device_info(device)
        p = plan_stack(cfg, device=device, device_bytes=info.memory_bytes[0] if info.memory_bytes else None)
    except Exception as e:  # noqa: BLE001 (the plan only adds to the line: never stop a restart for it)
        return f"`dgrpo plan --config {config_path}` says what each service needs (not computed here: {e})"
    part = p.learner if command == "learner" else p.sampler
    figure = f"`dgrpo plan` puts the {command} at {fmt_bytes(part.total)}" + ("" if device == "cpu" else " per device")
    if p.host is not None:
        figure += f", every service on this host at {fmt_bytes(p.host.total)}" + (
            f" of {fmt_bytes(p.host.device_bytes)}" if p.host.device_bytes else "")
    return f"{figure}; first knob: {first_knob(cfg, command, part.fix or (p.host.fix if p.host else ''))}"


def first_knob(cfg, command: str, planned: str = "") -> str:
    """The plan's own fix when it found the config does not fit, else what lowers the service's peak first."""
    if planned:
        return planned
    if command == "learner":
        a = cfg.learner.actor
        if a.use_dynamic_bsz:
            return f"learner.actor.max_tokens_per_micro_batch={max(16, a.max_tokens_per_micro_batch // 2)} " \
                   "(micro-batches accumulate)"
        return f"learner.actor.micro_batch_size_per_device={max(1, a.micro_batch_size_per_device // 2)} " \
               "(gradients accumulate)" + ("" if a.micro_batch_size_per_device > 1 else
                                           ", then learner.actor.gradient_checkpointing=true")
    return "a smaller sampler.kv_cache_space_gib (CPU) or sampler.gpu_memory_utilization, or fewer replicas"


def resume_point(checkpoint_cfg) -> str:
    """Where a restarted learner resumes, as its learner.checkpoint settings decide (learner/loop.py _resume)."""
    from dgrpo.learner.records.checkpoint_dirs import list_checkpoints

    if checkpoint_cfg.resume == "never":
        return "it starts over from step 0 (learner.checkpoint.resume=never)"
    if checkpoint_cfg.resume != "auto":
        return f"it resumes from learner.checkpoint.resume={checkpoint_cfg.resume}"
    found = list_checkpoints(checkpoint_cfg.dir)
    if found:
        return f"it resumes from its newest checkpoint {found[-1]}"
    why = "learner.checkpoint.save_freq 0 saves only at the end" if not checkpoint_cfg.save_freq else \
        f"the first is due at step {checkpoint_cfg.save_freq}, learner.checkpoint.save_freq"
    return f"it starts over from step 0: no checkpoint yet in {checkpoint_cfg.dir} ({why})"
