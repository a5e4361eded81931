"""Fuzzing helpers shared by tests/fuzz (`from fuzz.fuzzing import ...`): messages drawn from proto descriptors, byte
mutations of valid messages, raw-bytes gRPC calls (the server's own deserializer sees every example), and the "still
healthy" checks.

Every server runs in its own process with the run's token; the body fuzzers send it, the metadata fuzzers vary it.
Hypothesis keeps no example database (`database=None`), so nothing is written into the repository.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

TOKEN = "fuzz-token-0123456789abcdef"
BEARER = (("authorization", f"Bearer {TOKEN}"),)

FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
"""Base settings: no deadline (every example is a network round trip), no example database in the repo; random or
derandomized as the profile says (tests/conftest.py: derandomized in CI)."""

CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE}
"""What an RPC may answer to any body: served, or refused by a deliberate status. Never UNKNOWN or INTERNAL (an
exception nobody handled), never a dead or hung server, and never RESOURCE_EXHAUSTED (no body here nears the 256 MiB
limit: it is what a client sees when a refusal's message outgrows its metadata limit, hiding the reason)."""

UNDECODABLE = "the request body is not a valid "
"""The start of the INVALID_ARGUMENT that common/grpc_server.py answers for bytes that do not parse."""


# ---- strategies over proto descriptors -------------------------------------------------------------------------

_INTS = {
    d.FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), d.FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), d.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), d.FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), d.FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), d.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
HUGE_TEXT = 200_000


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Edges first (0, 1, -1, the type's bounds), then anything in range."""
    edges = sorted({v for v in (0, 1, 2, -1, lo, hi, lo + 1, hi - 1, 2**31 - 1, 2**31, 2**32 - 1) if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def texts(huge: bool = True) -> st.SearchStrategy[str]:
    """Empty, short unicode (NUL, control characters, astral planes), and (`huge`) now and then a long one of 4096
    or HUGE_TEXT characters."""
    short = [st.just(""), st.text(max_size=24),
             st.text(st.characters(codec="utf-8"), max_size=8).map(lambda s: s + "\0"),
             st.sampled_from(["\0", "\u202e", "\U0010ffff", "🙂" * 100, "../../etc/passwd"])]
    if not huge:
        return st.one_of(*short)
    return st.one_of(*short,
                     st.builds(lambda c, n: c * n, st.sampled_from("a\0é🙂"), st.sampled_from([4096, HUGE_TEXT])))


def scalar(field: d.FieldDescriptor, huge: bool = True) -> st.SearchStrategy:
    t = field.type
    if t in _INTS:
        return ints(*_INTS[t])
    if t == d.FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 3.4e38]),
                         st.floats(width=32))
    if t == d.FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324]),
                         st.floats())
    if t == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == d.FieldDescriptor.TYPE_STRING:
        return texts(huge)
    if t == d.FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == d.FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers travel too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), ints(-2**31, 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _repeated(element: st.SearchStrategy, bulk: st.SearchStrategy, long: int) -> st.SearchStrategy[list]:
    """Short lists of `element`, or one `bulk` element repeated `long` or 3 x `long` times (a long repeated field
    without drawing each element). `bulk` holds no long list and no huge text of its own, so sizes never multiply
    across levels: a long list of groups with 200k-character Struct keys grew this process to 22 GB (OOM-killed)."""
    if long <= 0:
        return st.lists(element, max_size=4)
    return st.one_of(st.lists(element, max_size=4),
                     st.builds(lambda x, n: [x] * n, bulk, st.sampled_from([long, 3 * long])))


@st.composite
def messages(draw, cls: type[Message], depth: int = 3, long: int = 300, overrides: dict | None = None,
             huge: bool = True) -> Message:
    """A `cls` message with every field drawn (or left unset), oneofs one member or none, maps and nested messages to
    `depth` levels. `overrides`: field name -> strategy, to keep an expensive field cheap (the sampler's n). `long`: the
    length of long repeated fields (0: none); `huge`: whether long texts may appear. Bodies stay far below the 256 MiB
    limit: long texts only in the top two levels' short lists, long lists only of elements with short texts and lists
    (tests/fuzz/test_fuzz_sizes.py)."""
    msg = cls()
    desc = msg.DESCRIPTOR
    chosen = {o.name: draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in desc.oneofs
              if not o.name.startswith("_")}  # "_temperature": proto3 `optional` sugar, a field of its own
    for field in desc.fields:
        real = field.containing_oneof
        if real is not None and real.name not in chosen:  # proto3 `optional`: set or not, like any other field
            real = None
        if real is not None and chosen[real.name] != field.name:
            continue
        if overrides and field.name in overrides:
            value = draw(overrides[field.name])
            if value is not None:
                _set(msg, field, value)
            continue
        if not draw(st.booleans()) and real is None:
            continue  # unset (the proto3 default)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            if depth <= 0 and value_f.message_type is not None:
                continue
            value_st = (messages(_cls(value_f), depth - 1, long, huge=huge and depth > 2) if value_f.message_type
                        else scalar(value_f, huge))
            entries = draw(st.dictionaries(scalar(key_f, huge), value_st, max_size=4))
            target = getattr(msg, field.name)
            for k, v in entries.items():
                if value_f.message_type:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
            continue
        if field.message_type is not None:
            if depth <= 0:
                continue
            element = messages(_cls(field), depth - 1, max(long // 10, 2) if long > 0 else 0, huge=huge and depth > 2)
            bulk = messages(_cls(field), depth - 1, 0, huge=False)
        else:
            element, bulk = scalar(field, huge), scalar(field, huge=False)
        if field.is_repeated:
            _set(msg, field, draw(_repeated(element, bulk, long)))
        else:
            _set(msg, field, draw(element))
    return msg


def _cls(field: d.FieldDescriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(field.message_type)


def _set(msg: Message, field: d.FieldDescriptor, value) -> None:
    if field.is_repeated:
        getattr(msg, field.name).extend(value)
    elif field.message_type is not None:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


@st.composite
def mutated(draw, valid: bytes, max_ops: int = 4) -> bytes:
    """`valid` with a few bytes flipped, inserted or deleted, or cut short: mostly not a well-formed message any more,
    sometimes a different valid one (a changed length or tag can still parse)."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "set"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12]))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
    return bytes(data)


def raw_bodies(cls: type[Message], valid: list[bytes], **kw) -> st.SearchStrategy[bytes]:
    """Request bodies for raw calls: descriptor-drawn messages, mutated valid ones, and plain random bytes."""
    return st.one_of(messages(cls, **kw).map(lambda m: m.SerializeToString()),
                     st.sampled_from(valid).flatmap(mutated), st.binary(max_size=256))


def decodes(cls: type[Message], raw: bytes) -> bool:
    try:
        cls.FromString(raw)
        return True
    except DecodeError:
        return False


# ---- raw calls and checks ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]


def call_raw(channel: grpc.Channel, method: str, body: bytes, *, stream: bool = False, metadata=BEARER,
             timeout: float = 30) -> Outcome:
    """One call with `body` as the serialized request: the server's deserializer sees exactly these bytes."""
    kind = channel.unary_stream if stream else channel.unary_unary
    fn = kind(method, request_serializer=None, response_deserializer=None)
    try:
        out = list(fn(body, timeout=timeout, metadata=metadata)) if stream else [fn(body, timeout=timeout,
                                                                                    metadata=metadata)]
        return Outcome(grpc.StatusCode.OK, "", out)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", [])


def assert_clean(outcome: Outcome, cls: type[Message], body: bytes) -> None:
    """A deliberate status; the undecodable-bytes answer (UNDECODABLE) only for bytes that really do not parse."""
    if outcome.details.startswith(UNDECODABLE):
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and not decodes(cls, body), (outcome, body[:80])
    if not decodes(cls, body):
        assert outcome.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED), (outcome,
                                                                                                     body[:80])
    assert outcome.code in CLEAN, f"{outcome.code.name}: {outcome.details[:500]!r} for {body[:120]!r}"


def assert_serving(address: str, proc: subprocess.Popen | None = None) -> None:
    assert proc is None or proc.poll() is None, f"the server at {address} exited with {proc.returncode}"
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING, f"health at {address}: {status}"


def metadata_values() -> st.SearchStrategy:
    """`authorization` metadata a client might send instead of the token: none, wrong, empty, huge, non-ASCII,
    duplicated, the token without `Bearer `, the token with a suffix."""
    single = st.one_of(
        st.just(""), st.just(TOKEN), st.just(f"Bearer {TOKEN} "), st.just(f"Bearer {TOKEN}x"), st.just("Bearer"),
        st.just(f"bearer {TOKEN}"), st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=64),
        st.text(max_size=32).map(lambda s: f"Bearer {s}"), st.sampled_from(["Bearer \u00e9\u4e2d", "Bearer 🙂"]),
        st.builds(lambda n: "Bearer " + "a" * n, st.sampled_from([1000, 7000, 20000, 100_000])),
    )
    return st.one_of(st.just(()), single.map(lambda v: (("authorization", v),)),
                     st.lists(single, min_size=2, max_size=3).map(lambda vs: tuple(("authorization", v) for v in vs)),
                     st.just((("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer x"))))


def assert_refused_unless_the_token(out: Outcome, metadata, cls: type[Message], body: bytes) -> None:
    """Anything but exactly one `authorization: Bearer <token>` is UNAUTHENTICATED (RESOURCE_EXHAUSTED when the
    metadata outgrows gRPC's limit), and never echoes the token."""
    if not all(v.isascii() and v.isprintable() for _, v in metadata):
        assert out.code != grpc.StatusCode.OK, out  # grpc's client refuses such values before sending anything
    elif metadata == BEARER:
        assert_clean(out, cls, body)
    elif out.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert sum(len(v) for _, v in metadata) > 8000, out
    else:  # the token is checked before any byte of the body is parsed
        assert out.code == grpc.StatusCode.UNAUTHENTICATED, out
    assert TOKEN not in out.details
