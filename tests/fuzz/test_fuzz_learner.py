"""Fuzz the learner's control service (Status, Stop) in its own process, with the run's token: any body and any
`authorization` metadata get a deliberate status, and the server stays SERVING and answers a valid Status."""

from __future__ import annotations

import grpc
import pytest
from fuzz.fuzzing import (
    FUZZ,
    assert_clean,
    assert_refused_unless_the_token,
    assert_serving,
    call_raw,
    messages,
    metadata_values,
    raw_bodies,
)
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from dgrpo.v1 import learner_pb2 as pb

pytestmark = pytest.mark.slow

METHODS = {"/dgrpo.v1.Learner/Status": pb.StatusRequest, "/dgrpo.v1.Learner/Stop": pb.StopRequest}
VALID = {"/dgrpo.v1.Learner/Status": [b""],
         "/dgrpo.v1.Learner/Stop": [pb.StopRequest(reason="operator: enough steps").SerializeToString()]}


@pytest.fixture(scope="module")
def channel(learner_control):
    with grpc.insecure_channel(learner_control.address) as ch:
        yield ch


def assert_still_serves(learner_control, channel) -> None:
    assert_serving(learner_control.address, learner_control.proc)
    out = call_raw(channel, "/dgrpo.v1.Learner/Status", b"")
    assert out.code == grpc.StatusCode.OK, out
    status = pb.LearnerStatus.FromString(out.responses[0])
    assert (status.step, status.total_steps, status.phase, dict(status.metrics)) == (7, 100, "training",
                                                                                     {"loss": 0.5})


def _bodies():
    return st.sampled_from(sorted(METHODS)).flatmap(lambda m: st.tuples(st.just(m), raw_bodies(METHODS[m],
                                                                                               VALID[m])))


@settings(FUZZ, max_examples=150)
@given(_bodies())
@example(("/dgrpo.v1.Learner/Stop", pb.StopRequest(reason="\0" * 100_000 + "🙂\u202e").SerializeToString()))
@example(("/dgrpo.v1.Learner/Status", b"\x0a\x05\xff\xfe"))  # unknown field with bytes that are not UTF-8: ignored
def test_any_body(learner_control, channel, case):
    method, body = case
    out = call_raw(channel, method, body)
    event(out.code.name)
    assert_clean(out, METHODS[method], body)
    if out.code == grpc.StatusCode.OK and method.endswith("Stop"):
        assert pb.StopResponse.FromString(out.responses[0]).stopping_after_step == 8
    assert_still_serves(learner_control, channel)


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(sorted(METHODS)), metadata_values(), st.binary(max_size=32))
def test_any_authorization_metadata(learner_control, channel, method, metadata, body):
    """Anything but exactly one `authorization: Bearer <token>` is UNAUTHENTICATED, whatever the body holds."""
    out = call_raw(channel, method, body, metadata=metadata)
    event(out.code.name)
    assert_refused_unless_the_token(out, metadata, METHODS[method], body)
    assert_still_serves(learner_control, channel)


def test_undecodable_body_is_invalid_argument(channel):
    out = call_raw(channel, "/dgrpo.v1.Learner/Stop", b"\x0a\x05ab")  # a string field cut short
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out


def test_undecodable_body_without_the_token_is_unauthenticated(channel):
    out = call_raw(channel, "/dgrpo.v1.Learner/Stop", b"\x0a\x05ab", metadata=())
    assert out.code == grpc.StatusCode.UNAUTHENTICATED, out


def test_descriptor_messages_cover_every_field():
    """The strategy reaches every field of the requests (a field it never sets would never be fuzzed)."""
    from hypothesis import find

    for cls in (pb.StopRequest,):
        for field in cls.DESCRIPTOR.fields:
            find(messages(cls), lambda m, f=field: f in [x for x, _ in m.ListFields()],
                 settings=settings(database=None, max_examples=500))
