"""The line `dgrpo up` says when a service dies (cli/launch/exits.py): the signal or exit code and the likely cause,
out of memory only on the kernel's record. The records are real files written here, laid out as the kernel's."""

from __future__ import annotations

import signal
from pathlib import Path

from dgrpo.cli.launch.exits import (
    OomWatch,
    exit_cause,
    first_knob,
    memory_advice,
    oom_counter_file,
    oom_kills,
    resume_point,
)
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config

EVENTS = "low 0\nhigh 0\nmax 3\noom 1\noom_kill {n}\noom_group_kill 0\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"


def _cgroup(tmp_path: Path, v2: bool = True) -> tuple[Path, Path]:
    """A /proc/self/cgroup and a /sys/fs/cgroup with the process's memory cgroup, version 2 or 1."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    tmp_path.mkdir(exist_ok=True)
    if v2:
        proc.write_text("0::/user.slice/run-1.scope\n")
        folder, name, text = root / "user.slice" / "run-1.scope", "memory.events", EVENTS
    else:
        proc.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n")
        folder, name, text = root / "memory" / "job", "memory.oom_control", OOM_CONTROL
    folder.mkdir(parents=True)
    (folder / name).write_text(text.format(n=0))
    return proc, root


def test_the_oom_counter_is_found_in_cgroup_v2_and_v1(tmp_path):
    for v2 in (True, False):
        proc, root = _cgroup(tmp_path / str(v2), v2)
        found = oom_counter_file(proc, root)
        assert found is not None and found.name == ("memory.events" if v2 else "memory.oom_control")
        assert oom_kills(found) == 0
    (tmp_path / "bare").write_text("0::/\n")
    assert oom_counter_file(tmp_path / "bare", tmp_path / "nothing") is None


def test_a_sigkill_with_the_counter_grown_is_out_of_memory(tmp_path):
    proc, root = _cgroup(tmp_path)
    events = oom_counter_file(proc, root)
    watch = OomWatch.start(events)
    events.write_text(EVENTS.format(n=1))  # the kernel's OOM killer killed a process of the cgroup meanwhile
    line, oom = exit_cause("learner", -signal.SIGKILL, watch.evidence(4242, kmsg=tmp_path / "no-kmsg"))
    assert oom
    assert line == f"learner was killed by SIGKILL: the kernel's OOM killer (oom_kill 0 -> 1 in {events}): out of " \
        "memory"


def test_the_kernel_logs_own_line_names_the_pid(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1001,5,-;eth0: link up\n"
                    "3,1002,7,-;Out of memory: Killed process 4242 (python) total-vm:9000kB, anon-rss:8000kB\n")
    killed, record = OomWatch(None, None).evidence(4242, kmsg=kmsg)
    assert killed and "Killed process 4242 (python)" in record
    assert OomWatch(None, None).evidence(424, kmsg=kmsg)[0] is None  # another pid: no evidence either way


def test_a_sigkill_without_evidence_is_named_as_sent(tmp_path):
    proc, root = _cgroup(tmp_path, v2=False)
    watch = OomWatch.start(oom_counter_file(proc, root))
    line, oom = exit_cause("learner", -signal.SIGKILL, watch.evidence(4242, kmsg=tmp_path / "no-kmsg"))
    assert not oom
    assert line.startswith("learner was killed by SIGKILL: not by the kernel's OOM killer as far as its records show "
                           "(oom_kill stayed 0 in ")
    assert line.endswith("); something sent it")
    nothing = exit_cause("learner", -signal.SIGKILL, OomWatch(None, None).evidence(1, kmsg=tmp_path / "no-kmsg"))
    assert nothing == (("learner was killed by SIGKILL: the OOM killer or something else; no OOM record readable "
                        "here (no cgroup memory.events, kernel log not readable)"), False)


def test_other_signals_and_exit_codes():
    assert exit_cause("sampler-0", -signal.SIGBUS, (None, ""))[0].startswith(
        "sampler-0 was killed by SIGBUS: a mapped file lost its pages: most often /dev/shm full")
    assert exit_cause("learner", 1, (None, ""), "...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to") == (
        "learner exited with code 1: out of device memory (its log names the allocation)", True)
    assert exit_cause("learner", 1, (None, ""), "RuntimeError: boom") == (
        "learner exited with code 1: its log's last lines say why", False)


def test_the_advice_is_the_plans_figure_and_first_knob(tmp_path):
    config = tmp_path / "stack.yaml"
    config.write_text("model:\n  device: cpu\nlearner:\n  actor:\n    micro_batch_size_per_device: 4\n")
    advice = memory_advice(config, "learner")
    assert advice.startswith("`dgrpo plan` puts the learner at ")
    assert "every service on this host at " in advice
    assert advice.endswith("first knob: learner.actor.micro_batch_size_per_device=2 (gradients accumulate)")
    cfg = load_config(StackConfig, None, ["learner.actor.use_dynamic_bsz=true",
                                          "learner.actor.max_tokens_per_micro_batch=1024"])
    assert first_knob(cfg, "learner") == "learner.actor.max_tokens_per_micro_batch=512 (micro-batches accumulate)"
    assert first_knob(cfg, "learner", "4 learner ranks") == "4 learner ranks"  # the plan's own fix comes first
    assert "dgrpo plan --config" in memory_advice(tmp_path / "missing.yaml", "learner")


def test_where_a_restarted_learner_resumes(tmp_path):
    def ckpt(*overrides):
        return load_config(StackConfig, None, [f"learner.checkpoint.dir={tmp_path / 'ck'}", *overrides]
                           ).learner.checkpoint

    assert resume_point(ckpt()) == (f"it starts over from step 0: no checkpoint yet in {tmp_path / 'ck'} "
                                    "(learner.checkpoint.save_freq 0 saves only at the end)")
    assert "the first is due at step 5" in resume_point(ckpt("learner.checkpoint.save_freq=5"))
    for step in (5, 10):
        (tmp_path / "ck" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "ck" / f"step_{step}" / "meta.json").write_text("{}")
    (tmp_path / "ck" / "step_15").mkdir()  # an interrupted save: never resumed from
    assert resume_point(ckpt()) == f"it resumes from its newest checkpoint {tmp_path / 'ck' / 'step_10'}"
    assert resume_point(ckpt("learner.checkpoint.resume=never")) == \
        "it starts over from step 0 (learner.checkpoint.resume=never)"
