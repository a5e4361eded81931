"""Weight slots without an engine: layout, cast, sequence lock, checksums, permissions, cleanup, tcp serving."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading

import pytest
import torch
import zmq

from dgrpo.weights import slot
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.shm import open_readonly


def state(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    """fp32 tensors filled with `value`: any mix of two versions is visible in every element."""
    return {f"model.layers.{i}.w": torch.full((64, 96 + i), value) for i in range(n)}


def snapshot_of(ann: dict, private=None):
    mapped = open_readonly(ann["path"])
    try:
        return slot.snapshot(mapped, ann["version"], ann["seq"], ann["manifest_xxh3"], private)
    finally:
        mapped.close()


def test_publish_casts_to_dtype_and_roundtrips_bit_exactly(sync_cfg, segments_of):
    weights = {"a.weight": torch.randn(33, 17), "b.bias": torch.randn(5), "c.scalar": torch.tensor(3.25)}
    with WeightPublisher(sync_cfg(), "unit", dtype="bfloat16") as pub:
        stats = pub.publish(weights.items(), version=1)
        ann = pub._latest
        assert stats.num_tensors == 3 and stats.slot == 0 and stats.nbytes == ann["nbytes"]
        manifest, private = snapshot_of(ann)
        slot.verify(manifest, private)
        loaded = dict(slot.tensors(manifest, private))
        assert list(loaded) == list(weights)
        for name, t in weights.items():
            assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.to(torch.bfloat16))
        assert all(t["offset"] % slot.ALIGN == 0 for t in manifest["tensors"])
        # Owner-only segments, one per slot, named after this process.
        assert sorted(p.name for p in pub.segment_paths) == segments_of(os.getpid())
        for p in pub.segment_paths:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600
        with pytest.raises(ValueError, match="versions must increase"):
            pub.publish(weights.items(), version=1)
    assert segments_of(os.getpid()) == []


def test_slots_alternate_so_the_previous_version_stays_readable(sync_cfg):
    with WeightPublisher(sync_cfg(), "alt", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub._latest
        pub.publish(state(2.0).items(), 2)
        manifest, private = snapshot_of(v1)  # v1's slot untouched by v2
        assert all(torch.all(t == 1.0) for _, t in slot.tensors(manifest, private))
        pub.publish(state(3.0).items(), 3)  # reuses v1's slot
        with pytest.raises(slot.WeightIntegrityError, match="overwritten"):
            snapshot_of(v1)


def test_a_slot_being_written_is_rejected(sync_cfg):
    """Force the race: the writer stops half-way through a slot that a lagging reader was told to load."""
    half_written, release = threading.Event(), threading.Event()

    def slow_state():
        for i, item in enumerate(state(3.0).items()):
            if i == 2:
                half_written.set()
                release.wait(10)
            yield item

    with WeightPublisher(sync_cfg(), "race", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub._latest
        pub.publish(state(2.0).items(), 2)
        writer = threading.Thread(target=pub.publish, args=(slow_state(), 3))
        writer.start()
        assert half_written.wait(10)
        with pytest.raises(slot.WeightIntegrityError, match="being rewritten"):
            snapshot_of(v1)
        release.set()
        writer.join(10)
        manifest, private = snapshot_of(pub._latest)
        assert all(torch.all(t == 3.0) for _, t in slot.tensors(manifest, private))


def test_a_write_overlapping_the_copy_is_rejected(sync_cfg, monkeypatch):
    """Force the other interleaving: a whole publish into the slot lands while the reader copies it."""
    with WeightPublisher(sync_cfg(), "race2", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        v1 = pub._latest
        pub.publish(state(2.0).items(), 2)
        real_copy = slot._copy_bytes

        def copy_during_a_write(dst, src):
            pub.publish(state(3.0).items(), 3)
            real_copy(dst, src)

        monkeypatch.setattr(slot, "_copy_bytes", copy_during_a_write)
        with pytest.raises(slot.WeightIntegrityError, match="overlapped the copy"):
            snapshot_of(v1)


def test_racing_reader_never_sees_a_mixed_version(sync_cfg):
    """A writer publishing back-to-back against a reader: everything the reader accepts is one whole version."""
    with WeightPublisher(sync_cfg(), "stress", dtype="float32") as pub:
        pub.publish(state(1.0, n=8).items(), 1)
        stop, accepted, rejected = threading.Event(), [], []

        def write():
            v = 2
            while not stop.is_set():
                pub.publish(state(float(v), n=8).items(), v)
                v += 1

        writer = threading.Thread(target=write)
        writer.start()
        try:
            for _ in range(300):
                ann = pub._latest
                try:
                    manifest, private = snapshot_of(ann)
                    slot.verify(manifest, private)
                except slot.WeightIntegrityError:
                    rejected.append(ann["version"])
                    continue
                values = {float(t.unique().item()) for _, t in slot.tensors(manifest, private)}
                assert values == {float(ann["version"])}
                accepted.append(ann["version"])
        finally:
            stop.set()
            writer.join(10)
        assert len(accepted) > 10


def test_corrupted_bytes_fail_the_checksum(sync_cfg):
    with WeightPublisher(sync_cfg(), "corrupt", dtype="float32") as pub:
        pub.publish(state(1.0).items(), 1)
        ann = pub._latest
        victim = ann["manifest"]["tensors"][2]
        with open(ann["path"], "r+b") as f:  # a bit flip inside one tensor, header and seq untouched
            f.seek(victim["offset"] + 100)
            byte = f.read(1)
            f.seek(victim["offset"] + 100)
            f.write(bytes([byte[0] ^ 0x10]))
        manifest, private = snapshot_of(ann)
        with pytest.raises(slot.WeightIntegrityError, match=f"checksum mismatch in {victim['name']}"):
            slot.verify(manifest, private)


def test_segments_left_by_a_killed_learner_are_reclaimed(sync_cfg, segments_of, tmp_path):
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


def test_segments_are_removed_at_exit_without_close(sync_cfg, segments_of):
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


def test_control_socket_serves_latest_and_tcp_bytes(sync_cfg):
    cfg = sync_cfg(transport="tcp")
    with WeightPublisher(cfg, "tcp", dtype="float16") as pub, zmq.Context() as ctx:
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{cfg.control_port}")
        req.send(b'{"op": "latest"}')
        assert json.loads(req.recv()) == {"run_id": "tcp", "version": 0}
        pub.publish(state(1.5).items(), 4)
        req.send(b'{"op": "latest"}')
        latest = json.loads(req.recv())
        assert latest["version"] == 4 and latest["path"] is None and latest["transport"] == "tcp"
        req.send(json.dumps({"op": "fetch", "version": 4, "slot": latest["slot"]}).encode())
        meta, data = req.recv_multipart()
        manifest, private = slot.snapshot(bytearray(data), 4, json.loads(meta)["seq"], latest["manifest_xxh3"], None)
        slot.verify(manifest, private)
        assert all(t.dtype == torch.float16 and torch.all(t == 1.5) for _, t in slot.tensors(manifest, private))
        req.send(json.dumps({"op": "fetch", "version": 3, "slot": 0}).encode())
        assert "gone" in json.loads(req.recv_multipart()[0])["error"]
        req.close(linger=0)


def test_bad_run_id_is_refused(sync_cfg):
    with pytest.raises(ValueError, match="run_id"):
        WeightPublisher(sync_cfg(), "a/b")
