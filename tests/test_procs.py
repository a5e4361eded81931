"""Reaping a dead service's process tree and its shared memory (cli/launch/procs.py), with real processes and
/dev/shm."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from dgrpo.cli.launch import procs

# A leader that starts a child; the child creates and maps a /dev/shm segment (as vLLM's engine core does), then
# both sleep. The leader prints the child's pid and the segment once everything is in place.
CHILD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 16)
m = mmap.mmap(fd, 1 << 16)
print("mapped", flush=True)
time.sleep(600)
"""
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "mapped"
print(child.pid, flush=True)
time.sleep(600)
"""


def _tree(segment: Path) -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER, CHILD, str(segment)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    return leader, int(leader.stdout.readline())


def test_a_dead_leaders_tree_and_its_segments_are_reaped(child_processes):
    segment = Path(procs.SHM_DIR) / f"psm_test_{uuid.uuid4().hex[:8]}"
    kept = Path(procs.SHM_DIR) / f"psm_test_{uuid.uuid4().hex[:8]}"
    leader, child = _tree(segment)
    try:
        assert set(procs.group_pids(leader.pid)) == {leader.pid, child}
        seen = procs.shm_files(procs.group_pids(leader.pid))
        assert str(segment) in seen
        # A segment this test maps itself is in use elsewhere: reaping the tree must not remove it.
        fd = os.open(kept, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        still_mapped = mmap.mmap(fd, 4096)
        seen.add(str(kept))

        os.kill(leader.pid, signal.SIGKILL)  # the OOM killer's way: the child lives on, holding the segment
        leader.wait()
        assert procs.group_pids(leader.pid) == [child]
        assert sorted(procs.kill_group(leader.pid)) == [child]
        assert procs.group_pids(leader.pid) == []
        assert procs.unlink_orphaned(seen) == [str(segment)]
        assert not segment.exists() and kept.exists()
        still_mapped.close()
        os.close(fd)
    finally:
        for path in (segment, kept):
            path.unlink(missing_ok=True)
        if procs.group_pids(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)


def test_dgrpo_segments_are_left_to_their_owner_check(tmp_path):
    """The learner's weight slots (dgrpo-*) are judged by weights/shm.py by their creator's pid, never here."""
    ours = Path(procs.SHM_DIR) / f"dgrpo-w-test{uuid.uuid4().hex[:6]}-0-1-s0"
    ours.write_bytes(b"x")
    try:
        assert procs.unlink_orphaned([str(ours), str(tmp_path / "not-in-shm")]) == []
        assert ours.exists()
    finally:
        ours.unlink(missing_ok=True)


def test_kill_group_of_a_finished_group_is_a_no_op(child_processes):
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    done.wait()
    time.sleep(0.1)
    assert procs.kill_group(done.pid) == []


# A service as `dgrpo up` starts it: it watches the lifeline it inherited, creates its own dgrpo weight segment and
# starts the child that maps a vLLM-like segment; then it works on (a sleep) as if nothing could happen to `up`.
SERVICE = """
import mmap, os, subprocess, sys, time
from dgrpo.cli.launch.lifeline import watch_from_env
from dgrpo.weights.shm import pid_namespace
assert watch_from_env("test")
own = f"/dev/shm/dgrpo-w-{sys.argv[3]}-{pid_namespace()}-{os.getpid()}-s0"
fd = os.open(own, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "mapped"
print(child.pid, own, flush=True)
time.sleep(600)
"""


def test_a_service_ends_with_its_tree_and_shared_memory_when_up_dies(child_processes):
    """The lifeline (cli/launch/lifeline.py): the write end's last holder gone, as when `up` is SIGKILLed, the
    service kills its group, unlinks the segments it and its child used, and itself, within seconds."""
    from dgrpo.cli.launch.lifeline import Lifeline

    run_id = f"life{uuid.uuid4().hex[:6]}"
    segment = Path(procs.SHM_DIR) / f"psm_test_{run_id}"
    lifeline = Lifeline()
    service = subprocess.Popen([sys.executable, "-c", SERVICE, CHILD, str(segment), run_id], stdout=subprocess.PIPE,
                               text=True, start_new_session=True, pass_fds=lifeline.pass_fds(),
                               env={**os.environ, **lifeline.child_env()})
    try:
        child, own = service.stdout.readline().split()
        assert set(procs.group_pids(service.pid)) == {service.pid, int(child)}
        assert segment.exists() and Path(own).exists()
        os.close(lifeline.read_fd)
        time.sleep(1)
        assert service.poll() is None, "the service ended while its lifeline held"
        os.close(lifeline.write_fd)  # `up` is gone
        started = time.monotonic()
        service.wait(10)
        assert service.returncode == -signal.SIGKILL
        while procs.group_pids(service.pid) and time.monotonic() - started < 10:
            time.sleep(0.1)
        assert procs.group_pids(service.pid) == [], "its child outlived it"
        assert not segment.exists() and not Path(own).exists(), "its shared memory was left"
    finally:
        if procs.group_pids(service.pid):
            os.killpg(service.pid, signal.SIGKILL)
        for path in Path(procs.SHM_DIR).glob(f"*{run_id}*"):
            path.unlink(missing_ok=True)
