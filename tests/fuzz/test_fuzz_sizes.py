"""The fuzzers' own bodies stay bounded: a long list of long lists of huge texts once grew the test process to
22 GB and the kernel killed the whole suite. No service here, only the strategies of fuzz/fuzzing.py."""

from fuzz.fuzzing import messages
from hypothesis import HealthCheck, given, settings

from dgrpo.v1 import learner_pb2, rewarder_pb2, sampler_pb2

LIMIT = 64 << 20  # a quarter of the servers' 256 MiB message limit
SIZES = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@SIZES
@given(messages(rewarder_pb2.ScoreRequest))
def test_score_bodies_are_bounded(msg):
    assert msg.ByteSize() < LIMIT


@SIZES
@given(messages(sampler_pb2.GenerateRequest))
def test_generate_bodies_are_bounded(msg):
    assert msg.ByteSize() < LIMIT


@SIZES
@given(messages(learner_pb2.StopRequest))
def test_stop_bodies_are_bounded(msg):
    assert msg.ByteSize() < LIMIT
