"""Core leases: replicas that share a host under `sampler.cpu_cores: all` bind cores of their own.

Each lease is claimed from this one process with its own open file, which flock treats as another owner, so the
replicas of a host are played here without starting processes; closing a lease's file is its replica dying."""

from __future__ import annotations

import os

import pytest

from dgrpo.common import cpu_leases
from dgrpo.common.cpu_leases import choose_cores, claim


def test_alone_a_replica_binds_every_core():
    assert choose_cores([0, 1], []) == [0, 1]


def test_a_joining_replica_avoids_the_busy_replicas_lowest_core():
    # the busy replica's engine runs its main thread on its lowest core: the measured 217 s vs 48 s join
    assert choose_cores([0, 1], [[0, 1]]) == [1]


def test_shares_are_equal_and_fill_the_least_held_cores_first():
    assert choose_cores([0, 1, 2, 3], [[0, 1]]) == [2, 3]
    assert choose_cores([0, 1, 2, 3], [[0, 1], [2, 3]]) == [1]  # every core held once: not a lowest core
    assert choose_cores(list(range(8)), [[0, 1, 2, 3, 4, 5, 6, 7]]) == [1, 2, 3, 4]


def test_more_replicas_than_cores_get_one_core_each_in_turn():
    assert choose_cores([0, 1], [[0], [1]]) == [0]  # both held once and both a lowest core: the first in order
    assert choose_cores([0, 1], [[1], [1]]) == [0]


def test_leases_on_one_host_are_disjoint_and_a_dead_replicas_cores_are_taken_again(tmp_path):
    first = claim("sampler-a", [0, 1], tmp_path)
    second = claim("sampler-b", [0, 1], tmp_path)
    assert (first.cores, second.cores) == ([0, 1], [1])
    assert second.peers == [[0, 1]]
    os.close(first.fd)  # the first replica is killed: the kernel drops its lock, its file stays behind
    first.fd = None
    restarted = claim("sampler-a", [0, 1], tmp_path)
    assert restarted.cores == [0]  # the dead lease is not counted, and the survivor's core is left to it
    assert restarted.peers == [[1]]
    assert len(list(tmp_path.glob("*.cores"))) == 2  # the dead one's file removed
    for lease in (second, restarted):
        lease.release()
    assert list(tmp_path.glob("*.cores")) == []
    assert claim("sampler-c", [0, 1], tmp_path).cores == [0, 1]  # alone again


def test_a_lease_file_names_its_replica_safely(tmp_path):
    lease = claim("../../etc/passwd host:50051", [0], tmp_path)
    assert lease.path.parent == tmp_path
    assert lease.path.name.endswith("-.._.._etc_passwd_host_50051.cores")  # separators and spaces replaced
    assert lease.path.read_text() == "0"
    lease.release()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unusable_lease_directory_binds_every_core_and_says_so(tmp_path, caplog):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    lease = claim("sampler-a", [0, 1], locked / "leases")
    assert (lease.cores, lease.fd) == ([0, 1], None)
    assert "cannot keep core leases" in caplog.text


def test_a_lease_directory_that_is_a_file_binds_every_core_and_says_so(tmp_path, caplog):
    not_a_dir = tmp_path / "leases"
    not_a_dir.write_text("")
    lease = claim("sampler-a", [0, 1], not_a_dir)
    assert (lease.cores, lease.fd) == ([0, 1], None)
    assert "cannot keep core leases" in caplog.text


def test_the_default_directory_is_shared_memory():
    # compose's replicas share the shm service's IPC namespace, hence its /dev/shm: where they find each other
    assert cpu_leases.LEASE_DIR.parent.as_posix() == "/dev/shm"
