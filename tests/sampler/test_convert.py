"""Sampler proto <-> domain conversions round-trip, including unset optional sampling fields."""

from __future__ import annotations

import dataclasses

from dgrpo.sampler.convert import group_from_pb, group_to_pb, prompt_from_pb, sampling_from_pb, sampling_to_pb
from dgrpo.sampler.engine import CompletionResult, GroupResult, SamplingRequest
from dgrpo.v1 import sampler_pb2 as pb


def test_group_round_trip():
    group = GroupResult("p1", [1, 2, 3], [
        CompletionResult([4, 5], [-0.5, -1.25], "hi", "stop", 3),
        CompletionResult([6], [-2.0], "x", "length", 3),
    ])
    assert group_from_pb(group_to_pb(group, "r0")) == group


def test_sampling_round_trip_and_defaults_for_unset_fields():
    # float32-exact values, each unlike its default: a field the conversion drops comes back as the default
    s = SamplingRequest(n=4, temperature=0.0, top_p=0.75, top_k=20, min_p=0.125, max_tokens=64, stop=["\n\n"],
                        stop_token_ids=[2], seed=7)
    default = SamplingRequest()
    assert [f.name for f in dataclasses.fields(s) if getattr(s, f.name) == getattr(default, f.name)] == []
    # the proto and the domain type name the same fields, and the conversion writes every one of them
    proto_fields = sorted(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
    assert proto_fields == sorted(f.name for f in dataclasses.fields(SamplingRequest))
    msg = sampling_to_pb(s)
    assert sorted(f.name for f, _ in msg.ListFields()) == proto_fields
    assert sampling_from_pb(msg) == s
    unset = sampling_from_pb(pb.SamplingParams(n=2, max_tokens=8))
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.seed) == (1.0, 1.0, 0, 0.0, None)
    # temperature 0 (greedy) survives: it is not confused with "unset"
    assert sampling_from_pb(pb.SamplingParams(n=1, max_tokens=1, temperature=0.0)).temperature == 0.0


def test_prompt_variants():
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

    from dgrpo.sampler.engine import InvalidRequest, SamplerEngine

    engine = SamplerEngine.__new__(SamplerEngine)  # _vllm_params needs no engine, only the flag
    engine.seeds_safe = False
    with pytest.raises(InvalidRequest, match=r"sampling\.seed: .*enable_chunked_prefill=false"):
        engine._vllm_params(SamplingRequest(seed=3))
    with pytest.raises(InvalidRequest, match=r"sampling\.seed"):
        engine._vllm_params(SamplingRequest(), seed=5)  # a multi-turn sample's own seed
    assert engine._vllm_params(SamplingRequest()).seed is None
    engine.seeds_safe = True
    assert engine._vllm_params(SamplingRequest(seed=3)).seed == 3
