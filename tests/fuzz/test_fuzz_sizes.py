"""The fuzzers' own bodies stay bounded: a long list of groups with 200k-character Struct keys once grew the test
process to 22 GB and the kernel killed the whole suite. No service here, only the strategies of fuzz/fuzzing.py."""

import pytest
from fuzz.fuzzing import messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgrpo.v1 import learner_pb2, rewarder_pb2, sampler_pb2

LIMIT = 64 << 20  # a quarter of the servers' 256 MiB message limit


@pytest.mark.parametrize("cls", [rewarder_pb2.ScoreRequest, rewarder_pb2.ReloadRequest, sampler_pb2.GenerateRequest,
                                 learner_pb2.StopRequest], ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_request_bodies_are_bounded(cls, data):
    assert data.draw(messages(cls)).ByteSize() < LIMIT
