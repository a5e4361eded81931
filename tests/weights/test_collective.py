"""weights.transport=collective between two simulated hosts (tests/hosts_support.py: network namespaces joined by a
veth pair, each with its own /dev/shm): the learner's publisher in host a (collective_learner.py), replicas in host b
(channel_peer.py: the real WeightSubscriber, host relay and shm loading, into a torch-dict target). Real processes,
real sockets, real gloo groups; the faults are real too: the link taken down, a bandwidth cap, a relay SIGKILLed.

Published tensors hold small integers, so each replica's per-tensor sums name the version it holds (a torn mix of two
versions shows), and its per-tensor xxh3 of the loaded bytes must equal the learner's manifest (bit for bit)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from hosts_support import EventProcess, TwoHosts, available

from dgrpo.weights.collective_group import CollectiveError, PairGroup, listen_socket
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.subscriber import WeightSubscriber

two_hosts = pytest.mark.skipif(available() is not None, reason=str(available()))

HERE = Path(__file__).parent
SMALL = {f"model.layers.{i}.w": [256, 1024 + 64 * i] for i in range(4)}  # ~2.2 MB in bf16
LARGE = {f"model.layers.{i}.w": [1024, 3072] for i in range(4)}  # ~25 MB in bf16
LINK_DOWN_S = 20.0
TIMEOUT_S = 60.0


def nbytes(shapes: dict) -> int:
    """The bytes of one version of `shapes` in bf16."""
    return sum(2 * rows * cols for rows, cols in shapes.values())


def config(hosts: TwoHosts, **overrides) -> WeightSyncConfig:
    """Fixed ports are fine: nothing else lives in the test's namespaces."""
    return WeightSyncConfig(**{"transport": "collective", "host": hosts.a.address, "bind_host": hosts.a.address,
                               "collective_timeout_s": 3.0, "collective_chunk_mb": 4, "catch_up_timeout_s": 20.0,
                               "fetch_timeout_s": 30.0, **overrides})


class Run:
    """One learner in host a and the replicas the test starts in host b; everything stopped at the end."""

    def __init__(self, hosts: TwoHosts, folder: Path, shapes: dict, **overrides):
        self.hosts, self.folder, self.shapes = hosts, folder, shapes
        self.cfg = config(hosts, **overrides)
        argv = ["--config", self.cfg.model_dump_json(), "--shapes", json.dumps(shapes)]
        self.learner = EventProcess(hosts.a.command([sys.executable, str(HERE / "collective_learner.py"), *argv]),
                                    folder / "learner.log")
        self.replicas: list[EventProcess] = []
        self.published: dict[int, dict] = {}
        self.learner.wait_for("ready", TIMEOUT_S)

    def replica(self) -> EventProcess:
        argv = ["--config", self.cfg.model_dump_json(), "--shapes", json.dumps(self.shapes)]
        log = self.folder / f"replica-{len(self.replicas)}.log"
        proc = EventProcess(self.hosts.b.command([sys.executable, str(HERE / "channel_peer.py"), *argv]), log)
        self.replicas.append(proc)
        return proc

    def publish(self, version: int) -> dict:
        self.learner.send({"publish": version})
        self.published[version] = self.learner.wait_for("published", TIMEOUT_S, version=version)
        return self.published[version]

    def hosts_state(self, version: int, timeout: float = TIMEOUT_S) -> dict:
        self.learner.send({"wait_hosts": version, "timeout": timeout})
        return self.learner.wait_for("hosts", timeout + 10)["hosts"]

    def assert_never_torn(self) -> None:
        """Every version any replica served is exactly what the learner published as that version."""
        for replica in self.replicas:
            for e in replica.events:
                if e["event"] == "serving" and e["version"] in self.published:
                    assert e["sums"] == self.published[e["version"]]["sums"], (replica.log_path, e["version"])
                    assert e["digests"] == {k: int(v) for k, v in self.published[e["version"]]["digests"].items()}

    def close(self) -> None:
        for proc in [*self.replicas, self.learner]:
            proc.stop()


@pytest.fixture
def run(launcher, tmp_path):
    runs: list[Run] = []

    def start(shapes=SMALL, **overrides) -> Run:
        hosts = TwoHosts("collective").__enter__()
        try:
            runs.append(Run(hosts, tmp_path, shapes, **overrides))
        except BaseException:
            hosts.__exit__()
            raise
        return runs[-1]

    yield start
    for r in runs:
        try:
            r.close()
        finally:
            r.hosts.__exit__()


def relay_of(replicas: list[EventProcess], timeout: float = 30) -> EventProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        relays = [r for r in replicas if "this replica is the host's relay" in r.logs()]
        if relays:
            assert len(relays) == 1, "one relay per host"
            return relays[0]
        time.sleep(0.1)
    raise AssertionError("no replica became the relay")


@two_hosts
def test_remote_replicas_serve_every_version_bit_for_bit_once_over_the_link_and_a_late_one_catches_up(run):
    r = run()
    r.publish(1)
    first, second = r.replica(), r.replica()
    for replica in (first, second):
        assert replica.wait_for("started", TIMEOUT_S)["version"] == 1  # caught up before it serves
    for version in (2, 3, 4):
        sent_before = r.hosts.a.tx_bytes()
        published = r.publish(version)
        for replica in (first, second):
            replica.wait_for("serving", TIMEOUT_S, version=version)
        r.hosts_state(version)
        crossed = r.hosts.a.tx_bytes() - sent_before
        # Once per host: the second replica costs nothing on the link (headers, keep-alives: a few percent).
        assert published["nbytes"] <= crossed < 1.2 * published["nbytes"], (crossed, published["nbytes"])
    r.learner.send({"shm_digests": 4})
    shm = r.learner.wait_for("shm_digests", TIMEOUT_S)["digests"]
    assert shm == r.published[4]["digests"]  # the same bytes as the shm path delivers
    late = r.replica()
    assert late.wait_for("started", TIMEOUT_S)["version"] == 4
    assert late.wait_for("serving", 1)["version"] == 4
    r.assert_never_torn()
    assert "relayed version 4" in relay_of([first, second]).logs()


@two_hosts
def test_link_down_mid_transfer_names_the_host_serves_nothing_torn_and_resumes(run):
    r = run(LARGE)
    r.hosts.cap_mbit(100)  # ~2 s per version: the link goes down in the middle of one
    r.publish(1)
    replicas = [r.replica(), r.replica()]
    for replica in replicas:
        replica.wait_for("started", TIMEOUT_S)
    sent_before = r.hosts.a.tx_bytes()
    r.learner.send({"publish": 2})
    # A quarter of version 2 across (about 0.5 s at the cap), three quarters still to go: then the link goes down.
    quarter, deadline = nbytes(LARGE) // 4, time.monotonic() + TIMEOUT_S
    while r.hosts.a.tx_bytes() - sent_before < quarter:
        assert time.monotonic() < deadline, "version 2 never started crossing the link"
        time.sleep(0.02)
    r.hosts.link(up=False)
    try:
        deadline = time.monotonic() + LINK_DOWN_S
        while time.monotonic() < deadline and "stopped answering" not in r.learner.logs():
            time.sleep(0.1)
        line = next((x for x in r.learner.logs().splitlines() if "stopped answering" in x), None)
        assert line is not None, r.learner.logs()[-3000:]
        assert f"({r.hosts.b.address})" in line and "during version 2" in line, line
        time.sleep(max(0.0, deadline - time.monotonic()))
        assert all(v == 1 for replica in replicas for v in served(replica)), "nothing new while the link is down"
    finally:
        r.hosts.link(up=True)
    r.published[2] = r.learner.wait_for("published", TIMEOUT_S, version=2)
    for replica in replicas:
        replica.wait_for("serving", TIMEOUT_S, version=2)
    r.publish(3)  # training goes on
    for replica in replicas:
        replica.wait_for("serving", TIMEOUT_S, version=3)
    r.assert_never_torn()


@two_hosts
def test_a_killed_relay_is_replaced_without_restarting_the_learner(run):
    r = run(bind_host="*")  # and a learner bound to every interface: its end of each group binds the one to the host
    r.publish(1)
    replicas = [r.replica(), r.replica()]
    for replica in replicas:
        replica.wait_for("started", TIMEOUT_S)
    relay = relay_of(replicas)
    relay.kill()
    survivor = next(x for x in replicas if x is not relay)
    r.publish(2)
    survivor.wait_for("serving", TIMEOUT_S, version=2)
    assert "this replica is the host's relay" in survivor.logs()
    (host,) = r.hosts_state(2).values()
    assert host["joins"] == 2 and host["acked"] == 2, host
    assert r.learner.proc.poll() is None
    r.assert_never_torn()


@two_hosts
def test_a_version_crosses_a_capped_link_at_its_rate(run):
    mbit = 200
    r = run(LARGE)
    r.hosts.cap_mbit(mbit)
    r.publish(1)
    replica = r.replica()
    replica.wait_for("started", TIMEOUT_S)
    nbytes = r.publish(2)["nbytes"]
    replica.wait_for("serving", TIMEOUT_S, version=2)
    r.hosts_state(2)
    match = re.search(r"has version 2 \([\d.]+ MB in ([\d.]+)s", r.learner.logs())
    assert match, r.learner.logs()[-2000:]
    seconds, ideal = float(match.group(1)), nbytes * 8 / (mbit * 1e6)
    assert 0.9 * ideal <= seconds <= 1.25 * ideal, (seconds, ideal)


def served(replica: EventProcess) -> list[int]:
    while replica._pull(0):
        pass
    return [e["version"] for e in replica.events if e["event"] == "serving"]


# --- on loopback: a mismatched pair of settings is refused by name, and no group waits unbounded ---------------------


def module_target(shapes):
    spec = importlib.util.spec_from_file_location("channel_peer", HERE / "channel_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModuleTarget(shapes, emit=lambda *a, **k: None)


@pytest.mark.parametrize(("learner", "sampler"), [("shm", "collective"), ("collective", "shm"), ("collective", "tcp")])
def test_learner_and_sampler_on_different_transports_are_refused_naming_the_setting(sync_cfg, learner, sampler,
                                                                                   caplog):
    shapes = {"model.layers.0.w": [8, 16]}
    pub_cfg = sync_cfg(transport=learner, collective_timeout_s=1.0)
    sub_cfg = pub_cfg.model_copy(update={"transport": sampler, "catch_up_timeout_s": 5.0, "fetch_timeout_s": 1.0})
    with WeightPublisher(pub_cfg, "mismatch") as pub:
        pub.publish([("model.layers.0.w", torch.ones(8, 16))], 1)
        subscriber = WeightSubscriber(sub_cfg, module_target(shapes), shapes)

        async def follow() -> None:
            await subscriber.start()
            await asyncio.sleep(1.5)  # a collective sampler's relay asks to join meanwhile
            await subscriber.stop()

        asyncio.run(follow())
    assert subscriber.target.weight_version == 0
    assert any(f"weights.transport={learner}, this sampler's is '{sampler}'" in r for r in subscriber.rejected)
    if sampler == "collective":
        assert "this learner's weights.transport is 'shm'" in caplog.text


def test_a_group_whose_peer_never_joins_fails_within_its_timeout():
    sock = listen_socket("127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="forming the weight group failed"):
        PairGroup(0, "127.0.0.1", 0, 1.0, "127.0.0.1", listen=sock)
    assert time.monotonic() - t0 < 5


def test_a_host_index_that_is_not_an_announcement_is_ignored_and_logged(tmp_path, caplog):
    from dgrpo.weights import protocol
    from dgrpo.weights.relay import HostIndex

    path = tmp_path / "dgrpo-relay-x.ann"
    index = HostIndex(path)
    assert index.changed() is None  # no relay has written one yet
    path.write_bytes(b"\x00garbage")
    assert index.changed() is None and "is not a weight announcement" in caplog.text
    manifest = protocol.Manifest(run_id="r", version=3, dtype="bfloat16")
    manifest.tensors.add(name="w", dtype="bfloat16", shape=[2], offset=4096, nbytes=4, xxh3=1)
    ann = protocol.announcement("r", 3, slot=1, seq=4, transport=protocol.TRANSPORTS["shm"],
                                segment="dgrpo-w-r-1-2-s1", nbytes=4200, manifest=manifest)
    path.write_bytes(ann.SerializeToString())
    assert index.changed().version == 3
    assert index.changed() is None  # unchanged since
