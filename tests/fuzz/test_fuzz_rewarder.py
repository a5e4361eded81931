"""Fuzz `dgrpo rewarder` (Score, Info, Reload) in its own process, with the run's token: any body and any
`authorization` metadata get a deliberate status; after every example the server is SERVING and a valid Score
(built as the learner builds it) gets the right rewards, or, while a fuzzed spec is active, finite ones. Reload
fuzzing ends with a Reload back to the configured spec, which scores right again."""

from __future__ import annotations

import math

import grpc
import pytest
import yaml
from fuzz.fuzzing import (
    FUZZ,
    TOKEN,
    assert_clean,
    assert_refused_unless_the_token,
    assert_serving,
    call_raw,
    messages,
    metadata_values,
    mutated,
    raw_bodies,
    texts,
)
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from support import ServiceProcess, free_port

from dgrpo.learner.rollout.reward_client import score_group
from dgrpo.v1 import rewarder_pb2 as pb

pytestmark = pytest.mark.slow

SCORE, INFO, RELOAD = "/dgrpo.v1.Rewarder/Score", "/dgrpo.v1.Rewarder/Info", "/dgrpo.v1.Rewarder/Reload"
METHODS = {SCORE: pb.ScoreRequest, INFO: pb.RewarderInfoRequest, RELOAD: pb.ReloadRequest}
GROUP = score_group("q1", "1+2?", ["\\boxed{3}", "\\boxed{4}", "it is 3"], {"answer": "3"})
VALID_SCORE = pb.ScoreRequest(groups=[GROUP], group_size=3)
EXPECTED = [1.0, 0.0, 1.0]  # math_verify: the configured (default) spec
CHAT = score_group("q2", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                   ["4", "five"], {"answer": 4, "level": [1, 2.5, None], "meta": {"src": "gsm8k"}})
VALID = {SCORE: [VALID_SCORE.SerializeToString(), pb.ScoreRequest(groups=[GROUP, CHAT]).SerializeToString()],
         INFO: [b""], RELOAD: [pb.ReloadRequest(spec_text="").SerializeToString()]}


@pytest.fixture(scope="module")
def rewarder(child_processes):
    port = free_port()
    svc = ServiceProcess("rewarder", [f"rewarder.port={port}", "rewarder.host=127.0.0.1", "rewarder.workers=1",
                                      "rewarder.grace_s=1", "rewarder.call_timeout_s=10"], port,
                         env={"DGRPO_TOKEN": TOKEN}).wait_ready(timeout=120)
    yield svc
    assert svc.stop() == 0, svc.logs()[-3000:]


@pytest.fixture(scope="module")
def channel(rewarder):
    with grpc.insecure_channel(rewarder.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def original(channel):
    """The configured spec's content hash (what a Reload to spec_text="" goes back to)."""
    out = call_raw(channel, INFO, b"")
    return pb.RewarderInfo.FromString(out.responses[0]).spec.content_hash


def assert_still_serves(rewarder, channel, original: str) -> None:
    """SERVING; Info answers; a valid Score is right on the configured spec, finite and OK on any other."""
    assert_serving(rewarder.address, rewarder.proc)
    info = pb.RewarderInfo.FromString(call_raw(channel, INFO, b"").responses[0])
    assert info.workers_alive >= 1 and info.spec.content_hash
    out = call_raw(channel, SCORE, VALID_SCORE.SerializeToString(), timeout=60)
    assert out.code == grpc.StatusCode.OK, out
    response = pb.ScoreResponse.FromString(out.responses[0])
    assert response.spec.content_hash == info.spec.content_hash
    rewards = [s.reward for s in response.groups[0].scores]
    assert all(math.isfinite(r) for r in rewards), (rewards, info)
    if info.spec.content_hash == original:
        assert rewards == EXPECTED and all(s.status == pb.SCORE_STATUS_OK for s in response.groups[0].scores)


def _bodies(methods):
    return st.sampled_from(methods).flatmap(
        lambda m: st.tuples(st.just(m), raw_bodies(METHODS[m], VALID[m], long=40)))


@settings(FUZZ, max_examples=120)
@given(_bodies([SCORE, INFO]))
@example((SCORE, pb.ScoreRequest(groups=[score_group("x", "p", ["c"], {"answer": math.nan, "b": math.inf})])
          .SerializeToString()))
@example((SCORE,
          pb.ScoreRequest(groups=[pb.ScoreGroup(prompt_id="x", completions=["c"], extra={})]).SerializeToString()))
def test_score_and_info_any_body(rewarder, channel, original, case):
    method, body = case
    out = call_raw(channel, method, body, timeout=60)
    event(out.code.name)
    assert_clean(out, METHODS[method], body)
    if out.code == grpc.StatusCode.OK and method == SCORE:
        request, response = pb.ScoreRequest.FromString(body), pb.ScoreResponse.FromString(out.responses[0])
        assert [g.prompt_id for g in response.groups] == [g.prompt_id for g in request.groups]
        for g_in, g_out in zip(request.groups, response.groups, strict=True):
            assert len(g_out.scores) == len(g_in.completions)
            assert all(math.isfinite(s.reward) for s in g_out.scores), g_out
    assert_still_serves(rewarder, channel, original)


@pytest.mark.parametrize("size", [20_000, 200_000])
def test_a_refusal_quoting_a_huge_prompt_id_still_reaches_the_client(channel, size):
    """Before: the message quoted the whole prompt_id, its trailer outgrew the client's metadata limit, and the
    client got RESOURCE_EXHAUSTED "Stream removed" instead of the reason."""
    group = pb.ScoreGroup(prompt_id="🙂" * size, text="p", completions=["c"])
    out = call_raw(channel, SCORE, pb.ScoreRequest(groups=[group, group]).SerializeToString())
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
    assert out.details.startswith("groups[1] (prompt_id") and "more bytes]" in out.details


# ---- Reload: random text, and spec-shaped YAML whose values are fuzzed ------------------------------------------

_FN_TYPES = ["math_verify", "exact_match", "regex_format", "length", "length_and_reference", "file", "model", "nope"]
_values = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), texts(),
                    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308]), st.floats(),
                    st.lists(st.integers(), max_size=3))


def _function():
    keys = st.sampled_from(["name", "weight", "timeout_s", "field", "normalize", "extract", "pattern", "mode", "unit",
                            "min_length", "max_length", "penalty_per_unit", "path", "function", "answer_tag", "x"])
    return st.builds(lambda t, extra: {"type": t, **extra}, st.sampled_from(_FN_TYPES),
                     st.dictionaries(keys, _values, max_size=4))


_specs = st.one_of(
    st.builds(lambda name, fns: {"name": name, "functions": fns}, st.one_of(texts(), _values),
              st.one_of(st.lists(_function(), max_size=3), _values)),
    st.dictionaries(texts(), _values, max_size=3),
)


def _spec_text(spec) -> str:
    return yaml.safe_dump(spec, allow_unicode=True) if spec is not None else ""


_reload_bodies = st.one_of(
    _specs.map(lambda s: pb.ReloadRequest(spec_text=_spec_text(s)).SerializeToString()),
    messages(pb.ReloadRequest).map(lambda m: m.SerializeToString()),
    st.sampled_from(["[" * 5000, "a: &a [*a]", "{a: !!python/object:os.system x}", "--- !!binary AAAA", "\t\0"])
    .map(lambda t: pb.ReloadRequest(spec_text=t).SerializeToString()),
    st.builds(lambda s: pb.ReloadRequest(spec_text=s).SerializeToString(), st.just(
        yaml.safe_dump({"name": "fuzz", "functions": [{"type": "length", "max_length": 5}]}))).flatmap(mutated),
)


@settings(FUZZ, max_examples=40)
@given(_reload_bodies)
@example(pb.ReloadRequest(spec_text="functions: [{type: length, weight: .nan}]").SerializeToString())
@example(pb.ReloadRequest(spec_text="functions: [{type: exact_match, weight: .inf}]").SerializeToString())
# finite weights, an infinite sum: that completion's score is an error, not inf
@example(pb.ReloadRequest(
    spec_text="functions: [{type: length, weight: 1e308}, {type: length, name: b, weight: 1e308}]").SerializeToString())
@example(pb.ReloadRequest(spec_text="functions: [{type: regex_format, pattern: '(a+)+$'}]").SerializeToString())
@example(pb.ReloadRequest(spec_text="[" * 2000).SerializeToString())
def test_reload_any_body(rewarder, channel, original, body):
    out = call_raw(channel, RELOAD, body, timeout=120)
    event(out.code.name)
    assert_clean(out, pb.ReloadRequest, body)
    info = pb.RewarderInfo.FromString(call_raw(channel, INFO, b"").responses[0])
    if out.code == grpc.StatusCode.OK:
        assert pb.ReloadResponse.FromString(out.responses[0]).spec == info.spec
    assert_still_serves(rewarder, channel, original)


def test_reload_back_to_the_configured_spec_scores_right(rewarder, channel, original):
    """After the Reload fuzzing (module order): back to the configured spec by Reload, and Score is right."""
    out = call_raw(channel, RELOAD, pb.ReloadRequest(spec_text="").SerializeToString(), timeout=120)
    assert out.code == grpc.StatusCode.OK, out
    assert pb.ReloadResponse.FromString(out.responses[0]).spec.content_hash == original
    explicit = yaml.safe_dump({"name": "default", "functions": [{"type": "math_verify"}]})
    out = call_raw(channel, RELOAD, pb.ReloadRequest(spec_text=explicit).SerializeToString(), timeout=120)
    assert out.code == grpc.StatusCode.OK and pb.ReloadResponse.FromString(out.responses[0]).spec.content_hash \
        == original, out  # the same spec as text: unchanged
    assert_still_serves(rewarder, channel, original)


@settings(FUZZ, max_examples=60)
@given(st.sampled_from([SCORE, INFO, RELOAD]), metadata_values(), st.sampled_from([*VALID[SCORE], b"", b"\x0a\x05ab"]))
def test_any_authorization_metadata(rewarder, channel, original, method, metadata, body):
    out = call_raw(channel, method, body, metadata=metadata, timeout=60)
    event(out.code.name)
    assert_refused_unless_the_token(out, metadata, METHODS[method], body)
    assert_still_serves(rewarder, channel, original)
