"""The weight channel end to end in real processes, without vLLM: a learner-side `WeightPublisher` here, a replica
(`channel_peer.py`: `WeightSubscriber` + a torch-dict `WeightTarget`) in its own process, reporting JSON events.

Published tensors hold small integers, so every per-tensor sum the peer reports is exact in bf16 and tells which
version it holds (a mix of two versions shows in the sums)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
from hosts_support import EventProcess

from dgrpo.v1 import weights_pb2 as pb
from dgrpo.weights import protocol
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.subscriber import MAX_TORN_RETRIES, WeightSubscriber

PEER = Path(__file__).with_name("channel_peer.py")
SHAPES = {f"model.layers.{i}.w": [64, 96 + i] for i in range(4)}
FIRST = "model.layers.0.w"
TIMEOUT_S = 30.0


def weights(version: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + version)
    return {name: torch.randint(-100, 100, shape, generator=gen).float() for name, shape in SHAPES.items()}


def sums_of(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(t.to(torch.bfloat16).double().sum()) for name, t in tensors.items()}


def publish(pub: WeightPublisher, version: int, seed: int = 0) -> dict[str, float]:
    """Publish `version` whole (an iterator, so never streamed: ModuleTarget loads complete versions only); return
    the sums a replica serving it must report."""
    tensors = weights(version, seed)
    pub.publish(iter(tensors.items()), version)
    return sums_of(tensors)


class Peer(EventProcess):
    """One channel_peer.py process, started ahead and waiting for its arguments (`launch`); its JSON events are
    read as every simulated-host test reads them (tests/hosts_support.py)."""

    def __init__(self, log_path: Path):
        super().__init__([sys.executable, str(PEER), "--argv-from-stdin"], log_path)
        self.pid = self.proc.pid

    def launch(self, cfg, **hooks: float) -> Peer:
        argv = ["--config", cfg.model_dump_json(), "--shapes", json.dumps(SHAPES)]
        for name, value in hooks.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        self.send(argv)
        return self

    def wait_for(self, event: str, timeout: float = TIMEOUT_S, **fields) -> dict:
        return super().wait_for(event, timeout, **fields)

    def stop(self) -> int:
        """Ask the peer to stop; its exit status once every event is read."""
        return super().stop(TIMEOUT_S)

    def served(self) -> list[int]:
        return [e["version"] for e in self.events if e["event"] == "serving"]

    def named(self, *names: str) -> list[str]:
        return [e["event"] for e in self.events if e["event"] in names]


@pytest.fixture(scope="module")
def spare_peers(child_processes, tmp_path_factory):
    """Peers started one ahead of the test that takes them: torch's import (seconds on two busy cores) then overlaps
    the previous test instead of adding to each one."""
    folder, peers = tmp_path_factory.mktemp("peers"), []

    def take() -> Peer:
        if not peers:
            peers.append(Peer(folder / "peer-0.log"))
        peers.append(Peer(folder / f"peer-{len(peers)}.log"))
        return peers[-2]

    yield take
    for peer in peers:
        if peer.proc.poll() is None:
            peer.proc.kill()
            peer.proc.wait()


@pytest.fixture
def start_peer(spare_peers):
    """`start_peer(cfg, **hooks)`: a running peer on `cfg`; killed at teardown if a test left it running."""
    started: list[Peer] = []

    def start(cfg, **hooks: float) -> Peer:
        started.append(spare_peers().launch(cfg, **hooks))
        return started[-1]

    yield start
    for peer in started:
        if peer.proc.poll() is None:
            peer.proc.kill()
            peer.proc.wait()


@pytest.fixture
def channel_cfg(sync_cfg):
    """Fresh ports; a generous catch-up bound (the learner is always up first here, so it is never waited out)."""
    return lambda **overrides: sync_cfg(catch_up_timeout_s=10, **overrides)


# --- catch-up and following ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_joiner_serves_the_latest_version_at_start_then_follows(transport, channel_cfg, start_peer,
                                                                       segments_of):
    cfg = channel_cfg(transport=transport)
    with WeightPublisher(cfg, "late", dtype="bfloat16") as pub:
        expected = {1: publish(pub, 1)}
        peer = start_peer(cfg)
        assert peer.wait_for("started")["version"] == 1  # caught up inside start(), before reporting ready
        assert peer.wait_for("serving", version=1, timeout=0)["sums"] == expected[1]
        for v in (2, 3):
            expected[v] = publish(pub, v)
            assert peer.wait_for("serving", version=v)["sums"] == expected[v]
        paths = {e["path"] for e in peer.events if e["event"] == "staging"}
        staging = segments_of(peer.pid)
        if transport == "shm":  # read in place in the learner's slots
            assert paths == {str(p) for p in pub.segment_paths} and staging == []
        else:  # fetched over the control socket into one staging segment of the peer's own
            assert len(staging) == 1 and staging[0].startswith("dgrpo-r-") and paths == {f"{cfg.shm_dir}/{staging[0]}"}
        assert peer.stop() == 0
    assert peer.served() == [1, 2, 3]
    assert segments_of(peer.pid) == []  # the staging segment went with a normal exit


@pytest.mark.parametrize("second_run", ["run-b", "run-a"])
def test_a_restarted_learner_is_followed_even_to_lower_versions(second_run, channel_cfg, start_peer):
    """A new run, or the same run resumed from an older checkpoint (a learner container killed and started again):
    its versions are the ones it trains on, whatever their numbers."""
    cfg = channel_cfg()
    first = WeightPublisher(cfg, "run-a", dtype="bfloat16")
    publish(first, 3, seed=1)
    peer = start_peer(cfg)
    assert peer.wait_for("started")["version"] == 3
    first.close()
    with WeightPublisher(cfg, second_run, dtype="bfloat16") as second:  # same ports
        assert second.incarnation != first.incarnation
        expected = publish(second, 1, seed=2)
        assert peer.wait_for("serving", version=1)["sums"] == expected
        assert peer.stop() == 0
    assert peer.served() == [3, 1]


# --- loads that queue, tear, or fail ------------------------------------------------------------------------------


def test_announcements_queued_during_a_load_are_coalesced_to_the_newest(channel_cfg, start_peer):
    cfg = channel_cfg()
    with WeightPublisher(cfg, "burst", dtype="bfloat16") as pub:
        peer = start_peer(cfg, resume_delay_s=1.0)
        peer.wait_for("started")
        publish(pub, 1)
        peer.wait_for("serving", version=1)  # v1 is loaded and intact; resuming takes another second
        expected = {v: publish(pub, v) for v in range(2, 7)}  # 6 versions back to back in all
        assert peer.wait_for("serving", version=6)["sums"] == expected[6]
        assert peer.stop() == 0
    # One by one, v2..v4 would be found overwritten (rejected) and v5 loaded before v6.
    assert peer.served() == [1, 6]
    assert peer.named("rejected") == []


def test_a_rewrite_during_the_load_is_never_served_and_the_newest_loads_while_paused(channel_cfg, start_peer):
    cfg = channel_cfg()
    with WeightPublisher(cfg, "torn", dtype="bfloat16") as pub:
        peer = start_peer(cfg, apply_delay_s=1.0)
        expected = {1: publish(pub, 1)}
        assert peer.wait_for("started")["version"] == 1
        expected[2] = publish(pub, 2)
        peer.wait_for("applying", version=2)  # v2 copied into the state, overlap not yet checked
        expected[3] = publish(pub, 3)
        expected[4] = publish(pub, 4)  # reuses v2's slot
        assert "overlapped the read" in peer.wait_for("torn", version=2)["why"]
        assert peer.wait_for("serving", version=4)["sums"] == expected[4]
        assert peer.stop() == 0
    assert peer.served() == [1, 4]  # v2 (torn) never recorded, v3 skipped
    after_catch_up = peer.events[next(i for i, e in enumerate(peer.events) if e["event"] == "started") + 1:]
    assert [(e["event"], e.get("version")) for e in after_catch_up if e["event"] != "staging"] == [
        ("paused", None), ("applying", 2), ("torn", 2), ("applying", 4), ("serving", 4), ("resumed", 4),
        ("stopped", 4)]  # one pause spans the torn load and the reload


def _streamed(pub: WeightPublisher, version: int, release: threading.Event, fail: bool = False):
    """Publish `version` streamed from a thread, holding before the third tensor until `release` (failing there
    with `fail`); returns (the writer thread, the sums a replica serving it must report)."""
    tensors = weights(version)
    layout = [(name, list(t.shape)) for name, t in tensors.items()]

    def held():
        for i, item in enumerate(tensors.items()):
            if i == 2:
                release.wait(TIMEOUT_S)
                if fail:
                    raise RuntimeError("the gather failed")
            yield item

    def write():
        try:
            pub.publish(held(), version, layout=layout)
        except RuntimeError:
            assert fail

    writer = threading.Thread(target=write)
    writer.start()
    return writer, sums_of(tensors)


def test_a_streamed_version_loads_while_the_learner_still_writes_it(channel_cfg, start_peer, caplog):
    caplog.set_level(logging.INFO, logger="dgrpo.weights.publisher")
    cfg = channel_cfg()
    with WeightPublisher(cfg, "streamed", dtype="bfloat16") as pub:
        publish(pub, 1)
        peer = start_peer(cfg)
        assert peer.wait_for("started")["version"] == 1
        peer.wait_for("paused")  # the catch-up's
        release = threading.Event()
        writer, expected = _streamed(pub, 2, release)
        peer.wait_for("paused")  # the replica started on v2 while half of it is still unwritten
        assert writer.is_alive()
        release.set()
        writer.join(TIMEOUT_S)
        assert peer.wait_for("applying", version=2)["streamed"] is True
        assert peer.wait_for("serving", version=2)["sums"] == expected
        assert peer.stop() == 0
    assert peer.served() == [1, 2] and peer.named("torn", "rejected") == []
    assert all(e["version"] != 2 for e in peer.events if e["event"] == "staging")  # streamed: no separate stage
    # One name for one thing: the learner's and the replica's log lines give a version the same manifest id, streamed
    # (announced before its checksums were filled in) or not (the regexes tests/learner/test_loop_hosts.py uses).
    published = dict(re.findall(r"published weights v(\d+) .*manifest ([0-9a-f]{16})", caplog.text))
    loaded = dict(re.findall(r"loaded weight version (\d+) \(.*\).*manifest ([0-9a-f]{16})", peer.logs()))
    assert "streamed" in next(x for x in peer.logs().splitlines() if "loaded weight version 2" in x)
    assert published == loaded and sorted(loaded) == ["1", "2"], (published, loaded)


def test_an_abandoned_streamed_version_is_never_served_and_the_previous_one_comes_back(channel_cfg, start_peer):
    cfg = channel_cfg()
    with WeightPublisher(cfg, "abandoned", dtype="bfloat16") as pub:
        expected = {1: publish(pub, 1)}
        peer = start_peer(cfg)
        assert peer.wait_for("started")["version"] == 1
        peer.wait_for("paused")  # the catch-up's
        peer.wait_for("resumed")
        release = threading.Event()
        writer, _ = _streamed(pub, 2, release, fail=True)
        peer.wait_for("paused")  # loading v2 while it is written
        peer.wait_for("copied", version=2)  # ... and reading its first tensors
        release.set()
        writer.join(TIMEOUT_S)
        assert "abandoned" in peer.wait_for("torn", version=2)["why"]
        # Still paused: v1 (its slot untouched) is loaded again before generation resumes.
        assert peer.wait_for("serving", version=1)["sums"] == expected[1]
        resumed = peer.wait_for("resumed")
        assert resumed["version"] == 1
        expected[2] = publish(pub, 2)  # the same version, published whole this time
        assert peer.wait_for("serving", version=2)["sums"] == expected[2]
        assert peer.stop() == 0
    assert peer.served() == [1, 1, 2]


def test_a_first_version_whose_streamed_load_failed_loads_again_once_complete(channel_cfg, start_peer):
    """Nothing served before to fall back to: the failed streamed load is retried as the complete version of the same
    write (staged and verified first) rather than leaving the replica broken."""
    cfg = channel_cfg()
    with WeightPublisher(cfg, "first", dtype="bfloat16") as pub:
        peer = start_peer(cfg, fail_streamed_loads=1, apply_delay_s=0.3)
        assert peer.wait_for("started")["version"] == 0
        release = threading.Event()
        writer, expected = _streamed(pub, 1, release)
        peer.wait_for("paused")  # loading v1 while it is written (a write finished first is announced complete)
        release.set()
        writer.join(TIMEOUT_S)
        assert "injected fault" in peer.wait_for("torn", version=1)["why"]
        assert peer.wait_for("staging", version=1)  # the complete version, verified before it is loaded
        assert peer.wait_for("applying", version=1, streamed=False)
        assert peer.wait_for("serving", version=1)["sums"] == expected
        assert peer.wait_for("resumed")["version"] == 1
        assert peer.stop() == 0
    assert peer.served() == [1] and peer.named("broken") == []


def test_a_learner_that_outpaces_every_load_breaks_the_channel(channel_cfg, start_peer):
    cfg = channel_cfg()
    with WeightPublisher(cfg, "outpaced", dtype="bfloat16") as pub:
        peer = start_peer(cfg, apply_delay_s=0.8)
        peer.wait_for("started")
        version = 1
        publish(pub, version)
        for _ in range(MAX_TORN_RETRIES):
            peer.wait_for("applying")
            for _ in range(2):  # the slot being loaded is rewritten every time
                version += 1
                publish(pub, version)
        broken = peer.wait_for("broken")
        assert peer.proc.wait(TIMEOUT_S) == 3
    assert f"weight version after {MAX_TORN_RETRIES} tries" in broken["why"] and "must not serve" in broken["why"]
    assert len(peer.named("torn")) == MAX_TORN_RETRIES and peer.served() == [] and broken["version"] == 0
    assert peer.named("paused", "resumed")[-1] == "paused"  # never resumed on the mixed state


def corrupt_first_tensor(pub: WeightPublisher, slot: int) -> None:
    """Flip bytes of the slot's first tensor (it starts right after the 4096-byte header), after its checksum."""
    buffer = pub._slots.segments[slot].buffer  # the learner's bytes (shm file or tcp memory): no public handle
    buffer[4096 + 8:4096 + 12] = b"\xff\xff\xff\x7f"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_corrupt_version_is_rejected_by_name_and_the_next_good_one_loads(transport, channel_cfg, start_peer):
    cfg = channel_cfg(transport=transport)
    with WeightPublisher(cfg, "corrupt", dtype="bfloat16") as pub:
        expected = {1: publish(pub, 1)}
        peer = start_peer(cfg)
        assert peer.wait_for("started")["version"] == 1
        bad = list(weights(2).items())

        def corrupted_after_checksum():  # a stray write or bad DMA after the checksum was taken
            yield bad[0]
            corrupt_first_tensor(pub, 1 - pub.latest.slot)
            yield from bad[1:]

        pub.publish(corrupted_after_checksum(), 2)
        rejected = peer.wait_for("rejected")
        assert rejected["why"].startswith("weight version 2:") and f"checksum mismatch in {FIRST}" in rejected["why"]
        assert rejected["version"] == 1 and rejected["sums"] == expected[1]  # untouched: still serving v1
        expected[3] = publish(pub, 3)
        assert peer.wait_for("serving", version=3)["sums"] == expected[3]
        assert peer.stop() == 0
    assert peer.served() == [1, 3] and "applying" not in {e["event"] for e in peer.events if e.get("version") == 2}


# --- hostile announcements (in process: a rogue publisher cannot join the learner's XPUB) --------------------------


def load_module_target():
    spec = importlib.util.spec_from_file_location("channel_peer", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModuleTarget


def announcement(**overrides) -> pb.WeightAnnouncement:
    """A well-formed version-1 announcement of an shm slot, with `overrides` (manifest: a list of tensors)."""
    tensors = overrides.pop("manifest", [pb.WeightTensor(name=FIRST, dtype="bfloat16", shape=SHAPES[FIRST],
                                                         offset=4096, nbytes=64 * 96 * 2)])
    manifest = pb.WeightManifest(run_id="hostile", version=1, dtype="bfloat16", tensors=tensors)
    fields = {"slot": 0, "seq": 2, "transport": protocol.TRANSPORTS["shm"], "segment": "dgrpo-w-hostile-1-1-s0",
              "nbytes": 4096 + 64 * 96 * 2, "manifest": manifest}
    ann = protocol.announcement("hostile", 1, **fields)
    for name, value in overrides.items():
        setattr(ann, name, value)
    return ann


def frames(**overrides) -> list[bytes]:
    return protocol.encode_announcement(announcement(**overrides))


HOSTILE = {
    "wrong protocol revision": (frames(protocol=protocol.PROTOCOL + 1),
                                f"protocol revision {protocol.PROTOCOL + 1}, this side speaks {protocol.PROTOCOL}"),
    "garbage payload": ([protocol.TOPIC, b"\xff\xff\xff\xff\xff"], "not a WeightAnnouncement"),
    "one frame": ([protocol.TOPIC], "expected the 2 frames"),
    "another topic": ([b"weights-x", b"1"], "starting b'weights-x'"),
    "path traversal": (frames(segment="../../etc/passwd"), "segment '../../etc/passwd' is not a weight slot's"),
    "absolute path": (frames(segment="/etc/passwd"), "segment '/etc/passwd' is not a weight slot's"),
    "no segment": (frames(segment=""), "segment '' is not a weight slot's"),
    "parent folder": (frames(segment=".."), "segment '..' is not a weight slot's"),
    "NUL in the name": (frames(segment="dgrpo-w-run-1-2-s0\0x"), "is not a weight slot's"),
    "another file in /dev/shm": (frames(segment="sem.mylock"), "segment 'sem.mylock' is not a weight slot's"),
    "a tcp version naming a file": (frames(transport=protocol.TRANSPORTS["tcp"], segment="../../etc/passwd"),
                                    "segment '../../etc/passwd' is not a weight slot's"),
    "streamed by tcp": (frames(transport=protocol.TRANSPORTS["tcp"], streaming=True, seq=3),
                        "weights.transport=tcp streams no version"),
    "streamed without a slot": (frames(streaming=True, seq=3, segment=""), "streaming needs a slot read in place"),
    "slot 2": (frames(slot=2), "slot 2 does not exist"),
    "unknown transport": (frames(transport=7), "unknown transport 7"),
    "empty manifest": (frames(manifest=[]), "its manifest holds version 1 with 0 tensors"),
    "tensor not in the checkpoint": (
        frames(manifest=[pb.WeightTensor(name="model.evil", dtype="bfloat16", shape=[2], offset=4096, nbytes=4)]),
        "tensor 'model.evil' is not in the sampler's checkpoint"),
    "wrong shape": (
        frames(manifest=[pb.WeightTensor(name=FIRST, dtype="bfloat16", shape=[96, 64], offset=4096, nbytes=12288)]),
        f"{FIRST} has shape [96, 64], the checkpoint [64, 96]"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_announcement_is_rejected_with_its_reason_and_nothing_loads(case, sync_cfg):
    message, reason = HOSTILE[case]
    events = []
    target = load_module_target()(SHAPES, lambda event, **fields: events.append(event))

    async def handle() -> list[str]:
        subscriber = WeightSubscriber(sync_cfg(), target, SHAPES)
        try:
            await subscriber._handle(message)
            return subscriber.rejected
        finally:
            await subscriber.stop()

    rejected = asyncio.run(handle())
    assert len(rejected) == 1 and reason in rejected[0], rejected
    assert events == [] and target.weight_version == 0
    assert all(float(t.abs().sum()) == 0 for t in target.state.values())


# --- a signed channel (the run's token) ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_with_a_token_only_a_replica_holding_it_follows_the_learner(transport, channel_cfg):
    """Real sockets, in process: a replica without the token, or with another one, refuses every announcement (and
    cannot fetch); one with the token serves the version."""
    cfg = channel_cfg(transport=transport)
    ModuleTarget = load_module_target()

    async def follow(token: bytes | None) -> tuple[int, list[str], dict]:
        target = ModuleTarget(SHAPES, lambda event, **fields: None)
        subscriber = WeightSubscriber(cfg, target, SHAPES, token=token)
        try:
            await subscriber.start()  # the catch-up announcement names v1
            return target.weight_version, subscriber.rejected, target.sums()
        finally:
            await subscriber.stop()

    with WeightPublisher(cfg, "signed", dtype="bfloat16", token=b"run-secret") as pub:
        expected = publish(pub, 1)
        version, rejected, _ = asyncio.run(follow(None))
        assert version == 0 and "signed by the learner" in rejected[0]
        version, rejected, _ = asyncio.run(follow(b"guess"))
        assert version == 0 and "bad signature" in rejected[0]
        version, rejected, sums = asyncio.run(follow(b"run-secret"))
        assert version == 1 and rejected == [] and sums == expected
