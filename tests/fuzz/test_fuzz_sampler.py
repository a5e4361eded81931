"""Fuzz `dgrpo sampler` (Generate, Info) running real vLLM (CPU) on the tiny model, started once for the module with
the run's token: any body and any `authorization` metadata get a deliberate status, and after every example the
replica is SERVING and a valid Generate returns its group.

Generations stay cheap: n and max_tokens are drawn from small values plus the invalid edges (0, above vLLM's
limits), a weight fence always comes with a short wait, and max_model_len is small."""

from __future__ import annotations

import math

import grpc
import pytest
from fuzz.fuzzing import (
    FUZZ,
    TOKEN,
    Outcome,
    assert_clean,
    assert_refused_unless_the_token,
    assert_serving,
    call_raw,
    messages,
    metadata_values,
    mutated,
)
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from support import ServiceProcess, free_port

from dgrpo.v1 import sampler_pb2 as pb

pytestmark = pytest.mark.slow

GENERATE, INFO = "/dgrpo.v1.Sampler/Generate", "/dgrpo.v1.Sampler/Info"
MAX_MODEL_LEN = 256


def _request(prompts, **sampling) -> pb.GenerateRequest:
    sampling = {"n": 1, "max_tokens": 2, "temperature": 1.0, **sampling}
    return pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingParams(**sampling))


# What the learner's rollout sends (learner/rollout/client.py: token ids or chat, n samples, seeded), kept short.
VALID = [
    _request([pb.Prompt(id="p0", token_ids=pb.TokenIds(ids=[1, 504, 3458, 281]))], n=2, max_tokens=3, seed=7,
             stop_token_ids=[2]),
    _request([pb.Prompt(id="c0", chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="2+2?")])),
              pb.Prompt(id="t0", text="Once upon a time")], top_p=0.9, top_k=20, min_p=0.05, stop=["\n"]),
]
CHECK = _request([pb.Prompt(id="check", text="fine")])


@pytest.fixture(scope="module")
def sampler(child_processes, tiny_model):
    port = free_port()
    svc = ServiceProcess(
        "sampler",
        [f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}", "sampler.host=127.0.0.1",
         "sampler.enforce_eager=true", f"sampler.max_model_len={MAX_MODEL_LEN}", "sampler.replica_id=fuzz",
         "sampler.shutdown_grace_s=1", "sampler.max_prompts_per_request=64", "weights.enabled=false"],
        port, env={"DGRPO_TOKEN": TOKEN},
    ).wait_ready(timeout=300)
    yield svc
    assert svc.stop() == 0, svc.logs()[-3000:]


@pytest.fixture(scope="module")
def channel(sampler):
    with grpc.insecure_channel(sampler.address) as ch:
        yield ch


def generate(channel, body: bytes, **kw) -> Outcome:
    return call_raw(channel, GENERATE, body, stream=True, timeout=60, **kw)


def assert_still_serves(sampler, channel) -> None:
    assert_serving(sampler.address, sampler.proc)
    out = generate(channel, CHECK.SerializeToString())
    assert out.code == grpc.StatusCode.OK, out
    (group,) = [pb.Group.FromString(r) for r in out.responses]
    assert group.prompt_id == "check" and group.replica_id == "fuzz" and len(group.completions) == 1
    c = group.completions[0]
    assert 1 <= len(c.token_ids) <= 2 and len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
    info = pb.SamplerInfo.FromString(call_raw(channel, INFO, b"").responses[0])
    assert info.max_model_len == MAX_MODEL_LEN and info.replica_id == "fuzz"


def assert_generate_clean(out: Outcome, body: bytes) -> None:
    if out.code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the weight fence's own answer, never the client's deadline
        assert "min_weight_version" in out.details, out
        return
    assert_clean(out, pb.GenerateRequest, body)
    if out.code == grpc.StatusCode.OK:
        request = pb.GenerateRequest.FromString(body)
        groups = [pb.Group.FromString(r) for r in out.responses]
        assert sorted(g.prompt_id for g in groups) == sorted(p.id for p in request.prompts)
        for g in groups:
            assert len(g.completions) == request.sampling.n
            for c in g.completions:
                assert len(c.logprobs) == len(c.token_ids) <= request.sampling.max_tokens
                assert all(math.isfinite(lp) or lp == -math.inf for lp in c.logprobs)


_n = st.sampled_from([0, 1, 1, 2, 3, 16385, 2**32 - 1])
_max_tokens = st.sampled_from([0, 1, 2, 4, 2**32 - 1])
_sampling = messages(pb.SamplingParams, overrides={"n": _n, "max_tokens": _max_tokens})
_fence = st.one_of(st.just((0, 0.0)),
                   st.tuples(st.sampled_from([1, 2**64 - 1]),
                             st.sampled_from([0.05, -1.0, math.nan, math.inf, -math.inf, 1e-30, 3.4e38])))


def _with_fence(msg: pb.GenerateRequest, fence) -> pb.GenerateRequest:
    msg.min_weight_version, msg.weight_wait_timeout_s = fence
    return msg


_drawn = st.builds(_with_fence, messages(pb.GenerateRequest, overrides={"sampling": _sampling,
                                                                       "min_weight_version": st.none(),
                                                                       "weight_wait_timeout_s": st.none()},
                                         long=100), _fence)
VOCAB = 49152  # SmolLM2's tokenizer, which the tiny model uses
_EDGES = {  # field of a valid request -> values at or across its bounds
    "temperature": [0.0, -0.0, 1e-30, 100.0, math.nan, math.inf, -1.0],
    "top_p": [1e-30, 1.0, 1.0000001, 0.0, math.nan, -math.inf],
    "top_k": [-1, 0, 1, VOCAB, VOCAB + 1, 2**31 - 1, -2**31],
    "min_p": [0.0, 1.0, 1.1, -0.0, math.nan],
    "seed": [0, -1, 2**63 - 1, -2**63],
    "n": [1, 2, 4],
    "max_tokens": [1, 2, MAX_MODEL_LEN, MAX_MODEL_LEN + 1],
}


def _perturb(valid: pb.GenerateRequest, changes) -> bytes:
    """A valid request with a few fields set to edge values: mostly refused, often still served."""
    msg = pb.GenerateRequest()
    msg.CopyFrom(valid)
    for kind, value in changes:
        if kind in _EDGES:
            setattr(msg.sampling, kind, value)
        elif kind == "stop":
            msg.sampling.stop.append(value)
        elif kind == "stop_token_ids":
            msg.sampling.stop_token_ids.append(value)
        elif kind == "id":
            msg.prompts[0].id = value
        elif kind == "token_ids":
            msg.prompts[0].token_ids.ids[:] = value
        elif kind == "chat":
            msg.prompts[-1].chat.messages.add(role=value[0], content=value[1])
    return msg.SerializeToString()


_change = st.one_of(
    *[st.tuples(st.just(k), st.sampled_from(v)) for k, v in _EDGES.items()],
    st.tuples(st.just("stop"), st.sampled_from(["", "\0", "🙂", "a" * 10_000, "\n\n"])),
    st.tuples(st.just("stop_token_ids"), st.sampled_from([0, VOCAB - 1, VOCAB, 2**32 - 1])),
    st.tuples(st.just("id"), st.sampled_from(["", "\0", "🙂" * 1000, "t0"])),
    st.tuples(st.just("token_ids"), st.sampled_from([[], [0], [VOCAB - 1], [VOCAB], [5] * (MAX_MODEL_LEN - 1),
                                                     [5] * MAX_MODEL_LEN])),
    st.tuples(st.just("chat"), st.tuples(st.sampled_from(["", "user", "assistant", "tool", "system", "User"]),
                                         st.sampled_from(["", "\0", "{{ raise }}", "<|im_end|>", "🙂" * 50]))),
)
_perturbed = st.builds(_perturb, st.sampled_from(VALID), st.lists(_change, min_size=1, max_size=3))
_bodies = st.one_of(_drawn.map(lambda m: m.SerializeToString()), _perturbed, _perturbed,
                    st.sampled_from([v.SerializeToString() for v in VALID]).flatmap(mutated),
                    st.binary(max_size=128))


@settings(FUZZ, max_examples=120)
@given(_bodies)
@example(VALID[0].SerializeToString())
@example(_with_fence(_request([pb.Prompt(id="a", text="x")]), (3, math.nan)).SerializeToString())
@example(_with_fence(_request([pb.Prompt(id="a", text="x")]), (3, math.inf)).SerializeToString())
@example(_request([pb.Prompt(id="a", text="x")], seed=-2**63).SerializeToString())
@example(_request([pb.Prompt(id="a", text="x")], stop=[""]).SerializeToString())
@example(_request([pb.Prompt(id="a", text="x")], top_k=2**31 - 1).SerializeToString())
@example(_request([pb.Prompt(id="a", text="x")], temperature=math.nan).SerializeToString())
@example(_request([pb.Prompt(id="a", text="x")], stop_token_ids=[2**32 - 1]).SerializeToString())
@example(_request([pb.Prompt(id="a", chat=pb.ChatMessages())]).SerializeToString())
@example(_request([pb.Prompt(id="a", text="")]).SerializeToString())
@example(_request([pb.Prompt(id="a", token_ids=pb.TokenIds())]).SerializeToString())
@example(_request([pb.Prompt(id=str(i), text="x") for i in range(65)]).SerializeToString())
@example(_request([pb.Prompt(id="🙂" * 20_000, text="x")] * 2).SerializeToString())  # was RESOURCE_EXHAUSTED
def test_generate_any_body(sampler, channel, body):
    out = generate(channel, body)
    event(out.code.name)
    assert_generate_clean(out, body)
    assert_still_serves(sampler, channel)


@settings(FUZZ, max_examples=25)
@given(st.one_of(messages(pb.InfoRequest).map(lambda m: m.SerializeToString()), st.binary(max_size=64),
                 st.sampled_from([VALID[0].SerializeToString()])))
def test_info_any_body(sampler, channel, body):
    out = call_raw(channel, INFO, body)
    event(out.code.name)
    assert_clean(out, pb.InfoRequest, body)
    assert_still_serves(sampler, channel)


@settings(FUZZ, max_examples=40)
@given(st.sampled_from([GENERATE, INFO]), metadata_values(),
       st.sampled_from([CHECK.SerializeToString(), b"", b"\x0a\x05ab"]))
def test_any_authorization_metadata(sampler, channel, method, metadata, body):
    out = call_raw(channel, method, body, stream=method == GENERATE, metadata=metadata, timeout=60)
    event(out.code.name)
    cls = pb.GenerateRequest if method == GENERATE else pb.InfoRequest
    assert_refused_unless_the_token(out, metadata, cls, body)
    assert_still_serves(sampler, channel)
