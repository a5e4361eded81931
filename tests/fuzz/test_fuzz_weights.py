"""Fuzz the weight channel with the run's token: the publisher's REP control socket (random bytes, multi-frame and
huge messages, mutated requests, unsigned and signed) answers every request and still serves "latest" and the bytes
of a new version afterwards; the subscriber refuses forged announcements (random, mutated signed ones, another
protocol, paths outside the slot folder) and still loads the next genuine version. Real zmq sockets, in process
(test_channel.py covers the same code across processes)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
import zmq
from fuzz.fuzzing import FUZZ, mutated
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from support import free_port

from dgrpo.v1 import weights_pb2 as pb
from dgrpo.weights import protocol
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import WeightPublisher
from dgrpo.weights.subscriber import WeightSubscriber

TOKEN = b"fuzz-weights-token-0123456789"
SHAPES = {"model.layers.0.w": [8, 16], "model.layers.1.w": [4, 4]}
PEER = Path(__file__).parents[1] / "weights" / "channel_peer.py"


def _module_target():
    spec = importlib.util.spec_from_file_location("channel_peer", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModuleTarget


def weights(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {n: torch.randint(-50, 50, s, generator=gen).float() for n, s in SHAPES.items()}


def sums(tensors) -> dict[str, float]:
    return {n: float(t.to(torch.bfloat16).double().sum()) for n, t in tensors.items()}


def config(transport: str) -> WeightSyncConfig:
    return WeightSyncConfig(host="127.0.0.1", bind_host="127.0.0.1", announce_port=free_port(),
                            control_port=free_port(), transport=transport, catch_up_timeout_s=5, fetch_timeout_s=5)


# ---- the publisher's control socket --------------------------------------------------------------------------

SIGNER = protocol.Signer(TOKEN)
VALID_REQUESTS = [protocol.latest_request(), protocol.fetch_request(1, 0), protocol.fetch_request(1, 1)]
_frame = st.one_of(st.binary(max_size=64), st.sampled_from(VALID_REQUESTS).flatmap(mutated),
                   st.sampled_from(VALID_REQUESTS), st.builds(lambda n: b"\x0a" * n, st.sampled_from([4097, 1 << 22])),
                   st.builds(lambda m: m.SerializeToString(), st.builds(
                       pb.WeightControlRequest, protocol=st.sampled_from([0, 2, 2**32 - 1]),
                       fetch=st.builds(pb.FetchWeightsRequest, version=st.integers(0, 2**64 - 1),
                                       slot=st.integers(0, 2**32 - 1)))))
_requests = st.tuples(st.lists(_frame, min_size=1, max_size=4), st.sampled_from(["unsigned", "signed", "forged"]))


@pytest.fixture(scope="module")
def publisher():
    cfg = config("tcp")
    with WeightPublisher(cfg, "fuzz", dtype="bfloat16", token=TOKEN) as pub:
        pub.publish(iter(weights(1).items()), 1)
        ctx = zmq.Context()
        yield cfg, pub, ctx
        ctx.destroy(linger=0)


def exchange(cfg, ctx, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{cfg.control_port}")
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(timeout_ms) else None
    finally:
        sock.close(linger=0)


def latest_version(cfg, ctx) -> int:
    reply = exchange(cfg, ctx, SIGNER.seal([protocol.latest_request()]))
    assert reply is not None, "the control socket stopped answering"
    return protocol.decode_reply(SIGNER.open(reply, "reply")[0]).latest.version


@settings(FUZZ, max_examples=150)
@given(_requests)
@example(([b"\x0a" * (1 << 22)], "signed"))  # a 4 MiB frame
@example(([protocol.fetch_request(1, 2**32 - 1)], "signed"))
@example(([protocol.latest_request(), b""], "signed"))  # two frames
@example(([b""], "unsigned"))
@example(([protocol.latest_request()], "signed"))
@example(([protocol.fetch_request(1, 0)], "signed"))
def test_control_socket_answers_every_request(publisher, case):
    cfg, pub, ctx = publisher
    frames, how = case
    sent = SIGNER.seal(frames) if how == "signed" else [*frames, b"\0" * 32] if how == "forged" else frames
    reply = exchange(cfg, ctx, sent)
    assert reply is not None, f"no reply to {[f[:40] for f in sent]}"
    body = SIGNER.open(reply, "reply")  # every reply is signed, refusals included
    try:
        decoded = protocol.decode_reply(body[0])
        event(f"served {decoded.WhichOneof('reply')}")
    except protocol.ProtocolError as e:
        event("refused")
        assert "the learner failed to answer" not in str(e), e  # an exception the control thread did not expect
    assert latest_version(cfg, ctx) == pub.latest_version
    assert pub._thread.is_alive()  # the control thread is what must survive


def test_after_the_fuzzing_a_new_version_is_published_and_fetched(publisher):
    cfg, pub, _ = publisher
    version = pub.latest_version + 1
    expected = sums(weights(version))
    pub.publish(iter(weights(version).items()), version)
    target = _module_target()(SHAPES, lambda *a, **k: None)

    async def follow():
        subscriber = WeightSubscriber(cfg, target, SHAPES, token=TOKEN)
        try:
            await subscriber.start()  # catch-up: fetches the new version over the fuzzed control socket
        finally:
            await subscriber.stop()
        return subscriber.rejected

    assert asyncio.run(follow()) == []
    assert target.weight_version == version and target.sums() == expected


# ---- the subscriber ------------------------------------------------------------------------------------------


def _announcement(pub: WeightPublisher) -> pb.WeightAnnouncement:
    return pub.latest


def _forged(genuine: pb.WeightAnnouncement):
    """Announcements a rogue or broken peer might send: field edits of a genuine one, and random ones."""
    edits = st.sampled_from([
        ("protocol", protocol.PROTOCOL + 1), ("segment", "../../etc/passwd"), ("segment", "/etc/passwd"),
        ("segment", "dgrpo-w-fuzz-1-1-s0\0x"), ("segment", "sem.lock"), ("slot", 2), ("transport", 9),
        ("version", 2**64 - 1), ("seq", 2**64 - 1), ("nbytes", 2**64 - 1), ("manifest_xxh3", 0), ("streaming", True),
        ("run_id", "other"), ("run_id", "x" * 10_000),
    ])

    def edit(changes) -> bytes:
        ann = pb.WeightAnnouncement()
        ann.CopyFrom(genuine)
        for name, value in changes:
            setattr(ann, name, value)
        return ann.SerializeToString()

    body = st.one_of(st.lists(edits, min_size=1, max_size=3).map(edit), st.just(genuine.SerializeToString())
                     .flatmap(mutated), st.binary(max_size=64))
    frames = st.one_of(body.map(lambda b: [protocol.TOPIC, b]), st.lists(st.binary(max_size=16), max_size=4))
    return st.tuples(frames, st.sampled_from(["unsigned", "signed", "forged"]))


class _Errors(logging.Handler):
    """Records what the subscriber logs with a traceback: an exception it did not turn into a rejection."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info:
            self.records.append(record)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_forged_announcements_are_refused_and_the_next_genuine_version_loads(transport):
    cfg = config(transport)
    errors = _Errors()
    logging.getLogger("dgrpo.weights").addHandler(errors)
    with WeightPublisher(cfg, "fuzz", dtype="bfloat16", token=TOKEN) as pub:
        pub.publish(iter(weights(1).items()), 1)
        target = _module_target()(SHAPES, lambda *a, **k: None)
        v1 = sums(weights(1))

        async def scenario():
            subscriber = WeightSubscriber(cfg, target, SHAPES, token=TOKEN)
            await subscriber.start()
            loop = asyncio.get_running_loop()
            assert target.weight_version == 1 and target.sums() == v1
            seen = []

            @settings(FUZZ, max_examples=100)
            @given(_forged(_announcement(pub)))
            @example(([protocol.TOPIC, b"\xff" * 8], "signed"))
            def forged(case):
                frames, how = case
                sent = SIGNER.seal(frames) if how == "signed" else [*frames, b"\0" * 32] if how == "forged" else frames
                before = len(subscriber.rejected)
                # On the subscriber's own loop (its lock and sockets live there), as its listener would call it.
                asyncio.run_coroutine_threadsafe(subscriber._handle(sent), loop).result(30)
                seen.append(len(subscriber.rejected) > before)
                # Nothing but the genuine version 1 is ever served (a signed edit of run_id re-loads v1's own bytes).
                assert target.weight_version == 1 and target.sums() == v1, (sent, subscriber.rejected[-1:])
                assert not errors.records, errors.records[-1].getMessage()

            await asyncio.to_thread(forged)  # hypothesis drives from a thread; each example runs on this loop
            pub.publish(iter(weights(2).items()), 2)  # the genuine next version, through the real SUB socket
            for _ in range(200):
                if target.weight_version == 2:
                    break
                await asyncio.sleep(0.05)
            failed = subscriber.failed
            await subscriber.stop()
            return seen, failed

        try:
            seen, failed = asyncio.run(scenario())
        finally:
            logging.getLogger("dgrpo.weights").removeHandler(errors)
    assert failed is None and target.weight_version == 2 and target.sums() == sums(weights(2))
    assert sum(seen) > len(seen) // 2  # most forgeries are refused with a reason (the rest are no-ops)
