"""A host relay's files never outlive it (weights/relay.py), on loopback: a real learner (collective_learner.py) and
real replicas (channel_peer.py: WeightSubscriber, host relay, shm loading) in processes of their own, the relay's
slots, index and lock in a fresh folder of the real /dev/shm, so "leaves nothing" is that folder being empty.

- Stopped while its learner is gone, a relay ends within its grace and removes everything, wherever it waited: for
  the learner's reply to its join (a port that accepts and never answers), or inside forming the group (the learner
  answered, then its store went silent: a call nothing can wake, which stop() outlasts).
- SIGKILLed, it cannot clean up: the next replica finds the host's lock free, knows the index beside it is stale,
  says so once, and serves the learner's versions without tripping over it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from hosts_support import EventProcess
from support import free_port

from dgrpo.weights import protocol
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.relay import STOP_GRACE_S, host_files, reclaim_stale_relays

HERE = Path(__file__).parent
SHAPES = {f"model.layers.{i}.w": [64, 96 + i] for i in range(4)}
TIMEOUT_S = 60.0
STALE_LINE = "left by a relay that is gone"


@pytest.fixture
def shm_folder():
    """A fresh folder in the real /dev/shm (tmpfs), removed at the end whatever the test left in it."""
    folder = Path(tempfile.mkdtemp(prefix="dgrpo-test-relay-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class Loopback:
    """A learner and the replicas a test starts, on loopback; the relay's files in `folder`."""

    def __init__(self, folder: Path, logs: Path):
        # collective_timeout_s at its default (30 s): what the relay's join waited, unwakeable, before this was fixed.
        self.cfg = WeightSyncConfig(transport="collective", host="127.0.0.1", bind_host="127.0.0.1",
                                    announce_port=free_port(), control_port=free_port(), shm_dir=str(folder),
                                    catch_up_timeout_s=20.0, fetch_timeout_s=30.0)
        self.folder, self.logs = folder, logs
        self.procs: list[EventProcess] = []
        self.learner = self._start("collective_learner.py", "learner.log")
        self.learner.wait_for("ready", TIMEOUT_S)

    def _start(self, script: str, log: str) -> EventProcess:
        argv = [sys.executable, str(HERE / script), "--config", self.cfg.model_dump_json(), "--shapes",
                json.dumps(SHAPES)]
        self.procs.append(EventProcess(argv, self.logs / log))
        return self.procs[-1]

    def replica(self) -> EventProcess:
        return self._start("channel_peer.py", f"replica-{len(self.procs)}.log")

    def publish(self, version: int) -> None:
        self.learner.send({"publish": version})
        self.learner.wait_for("published", TIMEOUT_S, version=version)

    def files(self) -> list[str]:
        return sorted(os.listdir(self.folder))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


@pytest.fixture
def loopback(child_processes, shm_folder, tmp_path):
    runs: list[Loopback] = []

    def start() -> Loopback:
        runs.append(Loopback(shm_folder, tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def relaying(run: Loopback, version: int) -> EventProcess:
    """A replica that relays `version` for the host, its files in place (what a stop must remove)."""
    replica = run.replica()
    assert replica.wait_for("started", TIMEOUT_S)["version"] == version
    lock, index = host_files(run.cfg)
    assert lock.exists() and index.exists(), run.files()
    assert any(f"-{replica.proc.pid}-s" in name for name in run.files()), run.files()  # its slot
    return replica


def accepted(listener: socket.socket, timeout: float = TIMEOUT_S) -> socket.socket:
    """The first connection to `listener` (the relay reaching for the learner), within `timeout`."""
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    return conn


def silent_listener(port: int = 0) -> socket.socket:
    """A TCP port that accepts connections and never says a word."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


@pytest.mark.parametrize("silent_at", ["join", "group"])
def test_a_relay_stopped_with_its_learner_gone_exits_within_its_grace_and_leaves_nothing(loopback, silent_at):
    run = loopback()
    run.publish(1)
    replica = relaying(run, 1)
    run.learner.kill()  # the learner is gone; the relay's group breaks and it asks to join again
    held = []
    if silent_at == "join":  # the learner's port accepts the relay's join and never answers it
        control = silent_listener(run.cfg.control_port)
        held.append(accepted(control))
    else:  # the join is answered, with a group whose store then never answers: the relay is inside torch's TCPStore
        store = silent_listener()
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        rep.bind(f"tcp://127.0.0.1:{run.cfg.control_port}")
        assert rep.poll(int(TIMEOUT_S * 1000)), "the relay never asked to join again"
        rep.recv_multipart()
        rep.send_multipart([protocol.group_reply(store.getsockname()[1], "gloo", 30.0)])
        held.append(accepted(store))
    t0 = time.monotonic()
    replica.send("stop")
    assert replica.wait_for("stopped", STOP_GRACE_S + 3)  # the subscriber, its relay included, stopped
    stopped_s = time.monotonic() - t0
    assert replica.proc.wait(10) == 0, replica.logs()[-3000:]
    exited_s = time.monotonic() - t0
    assert run.files() == [], (run.files(), replica.logs()[-3000:])
    if silent_at == "join":  # woken: the thread ended and retired the relay itself
        assert stopped_s < STOP_GRACE_S and "still inside a call" not in replica.logs(), stopped_s
    else:  # unwakeable: stop() waited its grace, then retired the relay from outside
        assert "still inside a call to the learner" in replica.logs()
    print(f"silent at {silent_at}: stopped in {stopped_s:.2f}s, exited in {exited_s:.2f}s")
    for conn in held:
        conn.close()


def test_a_killed_relays_index_is_known_stale_by_the_next_replica_which_says_so_once_and_serves(loopback):
    run = loopback()
    run.publish(1)
    killed = relaying(run, 1)
    lock, index = host_files(run.cfg)
    stale = protocol.decode_announcement([protocol.TOPIC, index.read_bytes()])
    killed.kill()
    assert lock.exists() and index.exists() and stale.segment in run.files()  # what a SIGKILL leaves
    replica = run.replica()
    assert replica.wait_for("started", TIMEOUT_S)["version"] == 1
    run.publish(2)
    assert replica.wait_for("serving", TIMEOUT_S, version=2)
    lines = [x for x in replica.logs().splitlines() if STALE_LINE in x]
    assert len(lines) == 1 and index.name in lines[0] and f"version 1 in {stale.segment}" in lines[0], lines
    assert [e for e in replica.events if e["event"] == "rejected"] == []  # never tried to load what it names
    assert stale.segment not in run.files()
    replica.send("stop")
    assert replica.proc.wait(TIMEOUT_S) == 0
    assert run.files() == []


# --- the reclaim itself, against real locks in a real folder (no process needed: flock locks are per open file) ---


def _write_index(path: Path, version: int, segment: str) -> None:
    manifest = protocol.Manifest(run_id="r", version=version, dtype="bfloat16")
    manifest.tensors.add(name="w", dtype="bfloat16", shape=[2], offset=4096, nbytes=4, xxh3=1)
    ann = protocol.announcement("r", version, slot=0, seq=2, transport=protocol.TRANSPORTS["shm"], segment=segment,
                                nbytes=4200, manifest=manifest)
    path.write_bytes(ann.SerializeToString())


def test_reclaim_removes_only_what_no_live_relay_holds(shm_folder, caplog):
    import fcntl

    live, dead, orphan = "dgrpo-relay-10.0.0.1-5001", "dgrpo-relay-my.annex-5002", "dgrpo-relay-10.0.0.3-5003"
    for base, version in ((live, 1), (dead, 2), (orphan, 3)):
        _write_index(shm_folder / f"{base}.ann", version, f"dgrpo-w-r-1-{version}-s0")
    (shm_folder / f"{dead}.ann.4242.tmp").write_bytes(b"half")  # a relay killed while replacing its index
    (shm_folder / f"{live}.lock").touch()
    (shm_folder / f"{dead}.lock").touch()
    holder = os.open(shm_folder / f"{live}.lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live relay: its lock held
    try:
        removed = reclaim_stale_relays(shm_folder)
        assert sorted(removed) == sorted([f"{dead}.ann", f"{orphan}.ann"])
        assert sorted(os.listdir(shm_folder)) == [f"{live}.ann", f"{live}.lock"]
        assert caplog.text.count(STALE_LINE) == 2
        assert "version 2 in dgrpo-w-r-1-2-s0" in caplog.text and "version 3 in dgrpo-w-r-1-3-s0" in caplog.text
        assert reclaim_stale_relays(shm_folder) == []  # nothing stale left: nothing said again
        assert caplog.text.count(STALE_LINE) == 2
        # Elected under that lock, a relay drops the index beside it: a previous relay's.
        assert reclaim_stale_relays(shm_folder, held=shm_folder / f"{live}.lock") == [f"{live}.ann"]
        assert os.listdir(shm_folder) == [f"{live}.lock"]
    finally:
        os.close(holder)
