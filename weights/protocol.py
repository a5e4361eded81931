"""The weight channel's wire format: typed messages (proto/dgrpo/v1/weights.proto), encoded and checked in one place.

Both ends (weights/publisher.py, weights/subscriber.py) and the slot layout (weights/slot.py) go through these
functions, so a message is either a complete, well-formed one of our protocol revision or a `ProtocolError` that
names what is wrong; nothing downstream indexes into untrusted dicts. The control socket answers every request,
malformed ones included, with a reply (an error reply at worst), so one bad peer never stalls a REQ/REP pair.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from google.protobuf.message import DecodeError

from dgrpo.v1 import weights_pb2 as pb

PROTOCOL = 2
"""Revision of the weight channel; bumped on any incompatible change of weights.proto or the slot layout."""
TOPIC = b"weights"
"""zmq topic of announcements (the first frame of each)."""

Announcement = pb.WeightAnnouncement
Manifest = pb.WeightManifest
TRANSPORTS = {"shm": pb.WEIGHT_TRANSPORT_SHM, "tcp": pb.WEIGHT_TRANSPORT_TCP,
              "collective": pb.WEIGHT_TRANSPORT_COLLECTIVE}
TRANSPORT_NAMES = {v: k for k, v in TRANSPORTS.items()}
SEGMENT = re.compile(r"^dgrpo-w-[A-Za-z0-9_.-]{1,64}-\d+-\d+-s[01]$")
"""A learner slot's file name (weights/shm.py segment_path): nothing else is ever opened from an announcement."""
MAX_CONTROL_REQUEST_BYTES = 4096
"""A control request is a few bytes; anything larger is refused before parsing."""


class ProtocolError(ValueError):
    """A message that is not a well-formed weight-channel message of our protocol revision."""


def _parse(message, raw: bytes, what: str):
    try:
        message.ParseFromString(raw)
    except (DecodeError, TypeError) as e:
        raise ProtocolError(f"{what}: not a {type(message).__name__} ({e})") from None
    if message.protocol != PROTOCOL:
        raise ProtocolError(f"{what}: protocol revision {message.protocol}, this side speaks {PROTOCOL} "
                            "(learner and samplers must run the same dgrpo release)")
    return message


# --- authentication -------------------------------------------------------------------------------------------


class Signer:
    """Keyed MACs over the channel's messages, from the run's shared token (BLAKE2b-256 keyed by SHA-256(token)).

    With a token every message carries one more frame, the MAC of all its frames (length-prefixed, so frames cannot
    be re-split), and a message without a valid one is refused before it is parsed: only peers holding the token can
    announce, ask for the latest version or fetch weight bytes (a fetch reply's MAC covers the bytes too). Without a
    token messages carry no MAC (a loopback-only run). The MAC authenticates; it does not encrypt: weight bytes on a
    network still cross in the clear (docs/security.md)."""

    def __init__(self, token: bytes | None):
        self._key = hashlib.sha256(token).digest() if token else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, frames) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=32)
        for frame in frames:
            view = memoryview(getattr(frame, "buffer", frame))
            h.update(view.nbytes.to_bytes(8, "little"))
            h.update(view)
        return h.digest()

    def seal(self, frames: list) -> list:
        return [*frames, self._mac(frames)] if self._key else list(frames)

    def open(self, frames: list, what: str) -> list:
        """`frames` without their MAC; raises ProtocolError when it is missing or wrong (token set)."""
        if self._key is None:
            return list(frames)
        if len(frames) < 2:
            raise ProtocolError(f"{what}: not signed (the weight channel needs the run's token)")
        mac = bytes(getattr(frames[-1], "bytes", frames[-1]))
        if not hmac.compare_digest(mac, self._mac(frames[:-1])):
            raise ProtocolError(f"{what}: bad signature (another token, or altered on the way)")
        return list(frames[:-1])


# --- announcements ------------------------------------------------------------------------------------------------


def announcement(run_id: str, version: int = 0, **fields) -> pb.WeightAnnouncement:
    """A typed announcement (version 0: nothing published yet)."""
    return pb.WeightAnnouncement(protocol=PROTOCOL, run_id=run_id, version=version, **fields)


def encode_announcement(ann: pb.WeightAnnouncement) -> list[bytes]:
    """The zmq frames of one announcement."""
    return [TOPIC, ann.SerializeToString()]


def decode_announcement(frames: list[bytes]) -> pb.WeightAnnouncement:
    """Frames from the SUB socket -> a checked announcement (raises ProtocolError)."""
    if len(frames) == 3 and frames[0] == TOPIC:
        raise ProtocolError("announcement: signed by the learner, and this side has no token (give it the run's)")
    if len(frames) != 2 or frames[0] != TOPIC:
        raise ProtocolError(f"announcement: expected the 2 frames [{TOPIC!r}, message], got {len(frames)} frames "
                            f"starting {frames[0][:20]!r}" if frames else "announcement: no frames")
    ann = _parse(pb.WeightAnnouncement(), frames[1], "announcement")
    if ann.version == 0:
        return ann
    if ann.slot not in (0, 1):
        raise ProtocolError(f"announcement of version {ann.version}: slot {ann.slot} does not exist")
    if ann.transport not in TRANSPORT_NAMES:
        raise ProtocolError(f"announcement of version {ann.version}: unknown transport {ann.transport}")
    # Field checks, whatever the transport: a segment is a file opened in /dev/shm, so only a weight slot's name
    # passes; which transports must name one is the strategy's check (WeightTransport.check_announcement).
    if ann.segment and not SEGMENT.match(ann.segment):
        raise ProtocolError(segment_error(ann))
    if ann.streaming and (ann.seq % 2 == 0 or not ann.segment):
        raise ProtocolError(f"announcement of version {ann.version}: streaming needs a slot read in place (a "
                            f"segment) and an odd seq (got seq {ann.seq}, segment {ann.segment!r})")
    if ann.manifest.version != ann.version or not ann.manifest.tensors:
        raise ProtocolError(f"announcement of version {ann.version}: its manifest holds version "
                            f"{ann.manifest.version} with {len(ann.manifest.tensors)} tensors")
    return ann


def segment_error(ann: pb.WeightAnnouncement) -> str:
    return f"announcement of version {ann.version}: segment {ann.segment!r} is not a weight slot's file name"


# --- control requests and replies ---------------------------------------------------------------------------------


def latest_request() -> bytes:
    return pb.WeightControlRequest(protocol=PROTOCOL, latest=pb.LatestWeightsRequest()).SerializeToString()


def fetch_request(version: int, slot: int) -> bytes:
    fetch = pb.FetchWeightsRequest(version=version, slot=slot)
    return pb.WeightControlRequest(protocol=PROTOCOL, fetch=fetch).SerializeToString()


def join_request(host_key: str, host_name: str, address: str) -> bytes:
    join = pb.JoinCollectiveRequest(host_key=host_key[:200], host_name=host_name[:200], address=address[:100])
    return pb.WeightControlRequest(protocol=PROTOCOL, join=join).SerializeToString()


def decode_request(raw: bytes) -> pb.WeightControlRequest:
    if len(raw) > MAX_CONTROL_REQUEST_BYTES:
        raise ProtocolError(f"control request of {len(raw)} bytes (at most {MAX_CONTROL_REQUEST_BYTES})")
    request = _parse(pb.WeightControlRequest(), raw, "control request")
    if request.WhichOneof("request") is None:
        raise ProtocolError("control request: neither `latest` nor `fetch` nor `join`")
    if request.WhichOneof("request") == "join" and not request.join.host_key:
        raise ProtocolError("control request `join`: no host_key")
    return request


def latest_reply(ann: pb.WeightAnnouncement) -> bytes:
    return pb.WeightControlReply(protocol=PROTOCOL, latest=ann).SerializeToString()


def fetched_reply(version: int, seq: int, nbytes: int) -> bytes:
    fetched = pb.FetchedWeights(version=version, seq=seq, nbytes=nbytes)
    return pb.WeightControlReply(protocol=PROTOCOL, fetched=fetched).SerializeToString()


def group_reply(port: int, backend: str, timeout_s: float) -> bytes:
    group = pb.CollectiveGroup(port=port, backend=backend, timeout_s=timeout_s)
    return pb.WeightControlReply(protocol=PROTOCOL, group=group).SerializeToString()


def error_reply(message: str) -> bytes:
    return pb.WeightControlReply(protocol=PROTOCOL, error=message[:1000]).SerializeToString()


def decode_reply(raw: bytes) -> pb.WeightControlReply:
    """A checked reply; an `error` reply raises ProtocolError with the learner's message."""
    reply = _parse(pb.WeightControlReply(), raw, "control reply")
    if reply.WhichOneof("reply") == "error":
        raise ProtocolError(f"the learner answered: {reply.error}")
    if reply.WhichOneof("reply") is None:
        raise ProtocolError("control reply: empty")
    return reply
