"""Weight slots without an engine: layout, cast, sequence lock, checksums, permissions, cleanup, tcp serving."""

from __future__ import annotations

import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

from dgrpo.weights import protocol, slot
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.shm import open_readonly
from dgrpo.weights.target import SlotRef


def state(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    """fp32 tensors filled with `value`: any mix of two versions is visible in every element."""
    return {f"model.layers.{i}.w": torch.full((64, 96 + i), value) for i in range(n)}


def reader_of(ann, cfg) -> slot.SlotReader:
    """A reader of the announced version, in place in the learner's segment (as a sampler's worker reads it)."""
    return slot.SlotReader(open_readonly(os.path.join(cfg.shm_dir, ann.segment)), ann.version, ann.seq,
                           ann.manifest_xxh3)


def values(reader: slot.SlotReader) -> set[float]:
    return {float(v) for _, t in reader.tensors() for v in t.unique()}


def test_publish_casts_to_dtype_and_roundtrips_bit_exactly(sync_cfg, segments_of):
    weights = {"a.weight": torch.randn(33, 17), "b.bias": torch.randn(5), "c.scalar": torch.tensor(3.25)}
    cfg = sync_cfg()
    with WeightPublisher(cfg, "unit", dtype="bfloat16") as pub:
        stats = pub.publish(weights.items(), version=1)
        ann = pub.latest
        assert stats.num_tensors == 3 and stats.slot == 0 and stats.nbytes == ann.nbytes
        assert ann.protocol == protocol.PROTOCOL and ann.transport == protocol.TRANSPORTS["shm"]
        reader = reader_of(ann, cfg)
        reader.verify()
        loaded = dict(reader.tensors())
        assert list(loaded) == list(weights)
        for name, t in weights.items():
            assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.to(torch.bfloat16))
        assert all(t.offset % slot.ALIGN == 0 for t in reader.manifest.tensors)
        assert reader.manifest == ann.manifest  # the slot's own manifest is the announced one
        del loaded
        reader.release()
        # Owner-only segments, one per slot, named after this process.
        assert sorted(p.name for p in pub.segment_paths) == segments_of(os.getpid())
        for p in pub.segment_paths:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
        with pytest.raises(ValueError, match="versions must increase"):
            pub.publish(weights.items(), version=1)
    assert segments_of(os.getpid()) == []


def test_slots_alternate_so_the_previous_version_stays_readable(sync_cfg):
    cfg = sync_cfg()
    with WeightPublisher(cfg, "alt", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub.latest
        pub.publish(state(2.0).items(), 2)
        assert values(reader_of(v1, cfg)) == {1.0}  # v1's slot untouched by v2
        pub.publish(state(3.0).items(), 3)  # reuses v1's slot
        with pytest.raises(slot.WeightIntegrityError, match="overwritten"):
            reader_of(v1, cfg)


def test_a_slot_being_written_is_rejected(sync_cfg):
    """Force the race: the writer stops half-way through a slot that a lagging reader was told to load."""
    half_written, release = threading.Event(), threading.Event()

    def slow_state():
        for i, item in enumerate(state(3.0).items()):
            if i == 2:
                half_written.set()
                release.wait(10)
            yield item

    cfg = sync_cfg()
    with WeightPublisher(cfg, "race", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub.latest
        pub.publish(state(2.0).items(), 2)
        writer = threading.Thread(target=pub.publish, args=(slow_state(), 3))
        writer.start()
        assert half_written.wait(10)
        with pytest.raises(slot.WeightIntegrityError, match="being rewritten"):
            reader_of(v1, cfg)
        release.set()
        writer.join(10)
        assert values(reader_of(pub.latest, cfg)) == {3.0}


def test_a_write_overlapping_the_load_is_caught_after_it(sync_cfg):
    """The other interleaving: a whole publish into the slot lands while the reader loads from it in place. The
    reader cannot prevent seeing a mix, so it must tell afterwards (its caller then loads the newest version)."""
    cfg = sync_cfg()
    with WeightPublisher(cfg, "race2", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub.latest
        pub.publish(state(2.0).items(), 2)
        reader = reader_of(v1, cfg)
        reader.verify()
        loaded = []
        for i, (_, t) in enumerate(reader.tensors()):
            if i == 2:
                pub.publish(state(3.0).items(), 3)  # rewrites v1's slot under the reader
            loaded.append(float(t.unique()[0]))
        assert loaded == [1.0, 1.0, 3.0, 3.0]  # what a loader got: a mix of two versions
        with pytest.raises(slot.WeightIntegrityError, match="overlapped the read"):
            reader.check_intact()


def _subscribed(ctx, cfg):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
    sub.connect(f"tcp://127.0.0.1:{cfg.announce_port}")
    assert protocol.decode_announcement(sub.recv_multipart()).version == 0  # the catch-up answer
    return sub


def _held_at(weights: dict, index: int, held: threading.Event, release: threading.Event, fail: bool = False):
    """The tensors of `weights`, stopping before `index` until `release` (or failing there)."""
    for i, item in enumerate(weights.items()):
        if i == index:
            held.set()
            release.wait(10)
            if fail:
                raise RuntimeError("the gather failed")
        yield item


def test_a_streamed_version_is_read_while_it_is_written(sync_cfg):
    """weights.stream: the version is announced when its write begins; a reader gets each tensor as soon as it is
    complete (checked against the slot's checksum table), waits for the rest, and the complete version is announced
    again at the end."""
    cfg = sync_cfg()
    weights = state(2.0)
    layout = [(name, list(t.shape)) for name, t in weights.items()]
    held, release = threading.Event(), threading.Event()
    with WeightPublisher(cfg, "stream", dtype="float32") as pub, zmq.Context() as ctx:
        sub = _subscribed(ctx, cfg)
        writer = threading.Thread(target=pub.publish, args=(_held_at(weights, 2, held, release), 1),
                                  kwargs={"layout": layout})
        writer.start()
        early = protocol.decode_announcement(sub.recv_multipart())
        assert early.streaming and early.version == 1 and early.seq % 2 == 1
        assert all(t.xxh3 == slot.UNKNOWN_XXH3 for t in early.manifest.tensors)
        assert held.wait(10)
        reader = reader_of(early, cfg)
        tensors = reader.tensors(verify=True)
        assert [float(next(tensors)[1][0, 0]) for _ in range(2)] == [2.0, 2.0]  # written before the hold
        threading.Timer(0.3, release.set).start()
        t0 = time.monotonic()
        assert [float(t[0, 0]) for _, t in tensors] == [2.0, 2.0]
        assert time.monotonic() - t0 >= 0.2  # it waited for the writer instead of reading unwritten bytes
        reader.check_intact()
        writer.join(10)
        complete = protocol.decode_announcement(sub.recv_multipart())
        assert not complete.streaming and complete.version == 1 and complete.seq == early.seq + 1
        reread = reader_of(complete, cfg).manifest.tensors
        assert [t.xxh3 for t in complete.manifest.tensors] == [t.xxh3 for t in reread]
        assert slot.UNKNOWN_XXH3 not in [t.xxh3 for t in complete.manifest.tensors]
        sub.close(linger=0)


def test_a_streamed_read_that_outruns_the_writers_finish_waits_for_it(sync_cfg):
    """The loader can take the last tensor before the writer has made the slot complete (its gather still running,
    the final manifest not yet written): `check_intact` then waits for the finish instead of calling the read
    abandoned. (Seen in CI: a replica gave up its first version this way and shut down.)"""
    cfg = sync_cfg()
    weights = state(4.0)
    layout = [(name, list(t.shape)) for name, t in weights.items()]
    held, release = threading.Event(), threading.Event()

    def then_held():
        yield from weights.items()
        held.set()  # every tensor is written; the writer now waits on its source before finishing
        release.wait(10)

    with WeightPublisher(cfg, "finish", dtype="float32") as pub, zmq.Context() as ctx:
        sub = _subscribed(ctx, cfg)
        writer = threading.Thread(target=pub.publish, args=(then_held(), 1), kwargs={"layout": layout})
        writer.start()
        early = protocol.decode_announcement(sub.recv_multipart())
        assert held.wait(10)
        reader = reader_of(early, cfg)
        assert [float(t[0, 0]) for _, t in reader.tensors(verify=True)] == [4.0] * 4
        threading.Timer(0.3, release.set).start()
        t0 = time.monotonic()
        reader.check_intact()
        assert time.monotonic() - t0 >= 0.2  # it waited for the write to finish
        writer.join(10)
        assert pub.latest_version == 1
        sub.close(linger=0)


def test_a_streamed_version_opened_while_its_write_completes_is_read_not_rejected(sync_cfg):
    """The writer's last step rewrites the manifest (checksums filled in) and then makes `seq` even. A reader that
    opens the announced version in between sees the odd `seq` with the final manifest: it reads again once the write
    is complete instead of calling the slot corrupt. (Seen in CI: a replica's streamed load refused this way.)"""
    cfg = sync_cfg()
    weights = state(3.0)
    layout = [(name, list(t.shape)) for name, t in weights.items()]
    with WeightPublisher(cfg, "closing", dtype="float32") as pub, zmq.Context() as ctx:
        sub = _subscribed(ctx, cfg)
        pub.publish(iter(weights.items()), 1, layout=layout)
        early = protocol.decode_announcement(sub.recv_multipart())
        assert early.streaming and early.seq % 2 == 1
        buffer = pub._slots.segments[early.slot].buffer  # the learner's bytes: no public handle
        struct.pack_into("<Q", buffer, slot.SEQ_OFFSET, early.seq)  # back inside the window: final manifest, odd seq
        threading.Timer(0.2, lambda: struct.pack_into("<Q", buffer, slot.SEQ_OFFSET, early.seq + 1)).start()
        t0 = time.monotonic()
        reader = reader_of(early, cfg)
        assert time.monotonic() - t0 >= 0.15  # it waited for the write to complete
        assert values(reader) == {3.0} and slot.UNKNOWN_XXH3 not in [t.xxh3 for t in reader.manifest.tensors]
        reader.check_intact()

        # A write that never leaves the window (its manifest really is not the announced one) is still refused.
        struct.pack_into("<Q", buffer, slot.SEQ_OFFSET, early.seq)
        with pytest.raises(slot.WeightIntegrityError, match="manifest checksum mismatch"):
            reader_of(early, cfg)
        sub.close(linger=0)


def test_a_streamed_versions_completed_manifest_id_is_the_one_the_learner_announces_once_complete(sync_cfg):
    """The announcement at a streamed write's start carries the id of the manifest without its checksums; once the
    write is done, `completed_manifest_xxh3` reads from the slot the id the learner logs and announces as complete
    (what a replica logs for the version), and nothing once the slot holds another write."""
    cfg = sync_cfg()
    with WeightPublisher(cfg, "ids", dtype="float32") as pub, zmq.Context() as ctx:
        sub = _subscribed(ctx, cfg)
        weights = state(2.0)
        pub.publish(iter(weights.items()), 1, layout=[(name, list(t.shape)) for name, t in weights.items()])
        early = protocol.decode_announcement(sub.recv_multipart())
        complete = protocol.decode_announcement(sub.recv_multipart())
        assert early.streaming and not complete.streaming and early.manifest_xxh3 != complete.manifest_xxh3
        path = os.path.join(cfg.shm_dir, early.segment)
        ref = SlotRef(path, 1, early.seq, early.manifest_xxh3, True, 1.0)
        assert slot.completed_manifest_xxh3(ref) == complete.manifest_xxh3 == pub.latest.manifest_xxh3
        pub.publish(iter(state(3.0).items()), 2)  # the other slot: this one still holds version 1
        assert slot.completed_manifest_xxh3(ref) == complete.manifest_xxh3
        pub.publish(iter(state(4.0).items()), 3)  # this slot rewritten
        assert slot.completed_manifest_xxh3(ref) is None
        assert slot.completed_manifest_xxh3(SlotRef(path + "-gone", 1, early.seq, 0, True, 1.0)) is None
        sub.close(linger=0)


def test_an_abandoned_or_stalled_streamed_write_is_refused(sync_cfg):
    cfg = sync_cfg()
    weights = state(3.0)
    layout = [(name, list(t.shape)) for name, t in weights.items()]
    with WeightPublisher(cfg, "abandon", dtype="float32") as pub, zmq.Context() as ctx:
        sub = _subscribed(ctx, cfg)
        held, release = threading.Event(), threading.Event()
        failed = []
        writer = threading.Thread(target=lambda: failed.append(pytest.raises(RuntimeError, pub.publish,
                                  _held_at(weights, 2, held, release, fail=True), 1, layout=layout)))
        writer.start()
        early = protocol.decode_announcement(sub.recv_multipart())
        assert held.wait(10)
        stalled = slot.SlotReader(open_readonly(os.path.join(cfg.shm_dir, early.segment)), 1, early.seq,
                                  early.manifest_xxh3, stall_timeout_s=0.2)
        with pytest.raises(slot.WeightIntegrityError, match="stalled at tensor 2 of 4"):
            list(stalled.tensors())
        reader = reader_of(early, cfg)
        release.set()
        writer.join(10)
        assert failed and pub.latest_version == 0  # nothing was announced complete
        with pytest.raises(slot.WeightIntegrityError, match="abandoned"):
            list(reader.tensors())
        pub.publish(weights.items(), 1)  # the version can be published again
        assert values(reader_of(pub.latest, cfg)) == {3.0}
        sub.close(linger=0)


def test_racing_reader_never_sees_a_mixed_version(sync_cfg):
    """A writer publishing back-to-back against a reader: everything the reader accepts is one whole version."""
    cfg = sync_cfg()
    with WeightPublisher(cfg, "stress", dtype="float32") as pub:
        pub.publish(state(1.0, n=8).items(), 1)
        stop, accepted, rejected = threading.Event(), [], []

        def write():
            v = 2
            while not stop.is_set():
                pub.publish(state(float(v), n=8).items(), v)
                v += 1
                time.sleep(0.002)  # back to back, but leaving readers windows (xxhash releases the GIL mid-read)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            for _ in range(300):
                ann = pub.latest
                try:
                    reader = reader_of(ann, cfg)
                    reader.verify()
                    seen = {float(v) for _, t in reader.tensors() for v in t.clone().unique()}
                    reader.check_intact()  # only now is what was read known to be one version
                except slot.WeightIntegrityError:
                    rejected.append(ann.version)
                    continue
                assert seen == {float(ann.version)}
                accepted.append(ann.version)
        finally:
            stop.set()
            writer.join(10)
        assert len(accepted) > 10


def test_corrupted_bytes_fail_the_checksum(sync_cfg):
    cfg = sync_cfg()
    with WeightPublisher(cfg, "corrupt", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        ann = pub.latest
        victim = ann.manifest.tensors[2]
        with open(os.path.join(cfg.shm_dir, ann.segment), "r+b") as f:  # a bit flip inside one tensor
            f.seek(victim.offset + 100)
            byte = f.read(1)
            f.seek(victim.offset + 100)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(slot.WeightIntegrityError, match=f"checksum mismatch in {victim.name}"):
            reader_of(ann, cfg).verify()


def test_segments_left_by_a_killed_learner_are_reclaimed(child_processes, sync_cfg, segments_of, tmp_path):
    cfg = sync_cfg()
    code = (
        "import os, signal, torch\n"
        "from dgrpo.weights.config import WeightSyncConfig\n"
        "from dgrpo.weights.publisher import WeightPublisher\n"
        f"pub = WeightPublisher(WeightSyncConfig.model_validate_json({cfg.model_dump_json()!r}), 'crashed')\n"
        "pub.publish([('w', torch.ones(1000))], 1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    assert proc.wait(60) == -signal.SIGKILL
    assert len(segments_of(proc.pid)) == 2  # SIGKILL: nothing ran at exit
    with WeightPublisher(sync_cfg(), "next", dtype="float32"):
        assert segments_of(proc.pid) == []


def test_segments_are_removed_at_exit_without_close(child_processes, sync_cfg, segments_of):
    cfg = sync_cfg()
    code = (
        "import torch\n"
        "from dgrpo.weights.config import WeightSyncConfig\n"
        "from dgrpo.weights.publisher import WeightPublisher\n"
        f"pub = WeightPublisher(WeightSyncConfig.model_validate_json({cfg.model_dump_json()!r}), 'forgot')\n"
        "pub.publish([('w', torch.ones(1000))], 1)\n"
        "print(len(pub.segment_paths))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "2"
    assert segments_of(proc.pid) == []


def _ask(req, message: bytes) -> list[bytes]:
    req.send(message)
    return req.recv_multipart()


def test_control_socket_serves_latest_and_tcp_bytes(sync_cfg):
    cfg = sync_cfg(transport="tcp")
    with WeightPublisher(cfg, "tcp", dtype="float16") as pub, zmq.Context() as ctx:
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{cfg.control_port}")
        nothing = protocol.decode_reply(_ask(req, protocol.latest_request())[0]).latest
        assert (nothing.run_id, nothing.version) == ("tcp", 0)
        pub.publish(state(1.5).items(), 4)
        latest = protocol.decode_reply(_ask(req, protocol.latest_request())[0]).latest
        assert latest.version == 4 and latest.segment == "" and latest.transport == protocol.TRANSPORTS["tcp"]
        meta, data = _ask(req, protocol.fetch_request(4, latest.slot))
        fetched = protocol.decode_reply(meta).fetched
        assert (fetched.version, fetched.nbytes) == (4, len(data))
        reader = slot.SlotReader(bytearray(data), 4, fetched.seq, latest.manifest_xxh3)
        reader.verify()
        assert all(t.dtype == torch.float16 and torch.all(t == 1.5) for _, t in reader.tensors())
        with pytest.raises(protocol.ProtocolError, match="slot 7 does not exist"):
            protocol.decode_reply(_ask(req, protocol.fetch_request(4, 7))[0])
        with pytest.raises(protocol.ProtocolError, match="version 3 is gone"):
            protocol.decode_reply(_ask(req, protocol.fetch_request(3, 0))[0])
        req.close(linger=0)


def test_hostile_control_requests_get_an_error_and_the_channel_keeps_serving(sync_cfg):
    """Garbage, wrong revisions, oversized and multi-frame requests, bad slots: each gets an error reply naming the
    problem; the control thread survives them all and still answers and announces."""
    cfg = sync_cfg()
    with WeightPublisher(cfg, "hostile", dtype="float32") as pub, zmq.Context() as ctx:
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{cfg.control_port}")
        wrong_revision = protocol.pb.WeightControlRequest(protocol=99, latest=protocol.pb.LatestWeightsRequest())
        cases = {
            b'{"op": "fetch", "version": "x", "slot": 0}': "not a WeightControlRequest|protocol revision 0",
            b"\xff" * 50: "not a WeightControlRequest|protocol revision",
            wrong_revision.SerializeToString(): f"protocol revision 99, this side speaks {protocol.PROTOCOL}",
            protocol.pb.WeightControlRequest(protocol=protocol.PROTOCOL).SerializeToString():
                "neither `latest` nor `fetch`",
            b"x" * 100_000: "control request of 100000 bytes",
            protocol.fetch_request(1, 0): "weight bytes are served only with weights.transport=tcp",
        }
        for message, expected in cases.items():
            with pytest.raises(protocol.ProtocolError, match=expected):
                protocol.decode_reply(_ask(req, message)[0])
        req.send_multipart([protocol.latest_request(), b"extra"])
        with pytest.raises(protocol.ProtocolError, match="expected 1 frame"):
            protocol.decode_reply(req.recv())
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
        sub.connect(f"tcp://127.0.0.1:{cfg.announce_port}")
        assert protocol.decode_announcement(sub.recv_multipart()).version == 0  # the catch-up answer
        pub.publish(state(1.0).items(), 1)
        assert protocol.decode_announcement(sub.recv_multipart()).version == 1
        assert protocol.decode_reply(_ask(req, protocol.latest_request())[0]).latest.version == 1
        for s in (req, sub):
            s.close(linger=0)


def test_with_a_token_only_signed_requests_are_served_and_every_reply_is_signed(sync_cfg):
    """The run's token: an unsigned or wrongly signed request gets a refusal (signed, so the sampler can trust it),
    never weight bytes; a signed fetch gets the bytes with a MAC over them too, so an altered byte is caught."""
    cfg = sync_cfg(transport="tcp")
    signer, stranger = protocol.Signer(b"run-secret"), protocol.Signer(b"guess")
    with WeightPublisher(cfg, "signed", dtype="float32", token=b"run-secret") as pub, zmq.Context() as ctx:
        pub.publish(state(1.0).items(), 1)
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{cfg.control_port}")

        def ask(frames: list[bytes]) -> list[bytes]:
            req.send_multipart(frames)
            return signer.open(req.recv_multipart(), "reply")  # every reply verifies with the token

        fetch = protocol.fetch_request(1, pub.latest.slot)
        for frames, refusal in (([fetch], "not signed"), (stranger.seal([fetch]), "bad signature"),
                                ([fetch, b"\0" * 32], "bad signature")):
            reply = ask(frames)
            assert len(reply) == 1  # no bytes frame
            with pytest.raises(protocol.ProtocolError, match=refusal):
                protocol.decode_reply(reply[0])
        meta, data = ask(signer.seal([fetch]))
        assert protocol.decode_reply(meta).fetched.nbytes == len(data)
        req.send_multipart(signer.seal([fetch]))
        tampered = req.recv_multipart()
        tampered[1] = b"\x01" + tampered[1][1:]
        with pytest.raises(protocol.ProtocolError, match="bad signature"):
            signer.open(tampered, "fetch reply")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
        sub.connect(f"tcp://127.0.0.1:{cfg.announce_port}")
        frames = sub.recv_multipart()
        assert protocol.decode_announcement(signer.open(frames, "announcement")).version == 1
        with pytest.raises(protocol.ProtocolError, match="bad signature"):
            stranger.open(frames, "announcement")
        for s in (req, sub):
            s.close(linger=0)


def test_a_dead_control_thread_fails_the_next_publish_loudly(sync_cfg):
    with WeightPublisher(sync_cfg(), "dead", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        pub._stop.set()  # what an unexpected exit of the thread would leave
        pub._thread.join(5)
        with pytest.raises(RuntimeError, match="control thread has stopped"):
            pub.publish(state(2.0).items(), 2)


def test_bad_run_id_is_refused(sync_cfg):
    with pytest.raises(ValueError, match="run_id"):
        WeightPublisher(sync_cfg(), "a/b")
