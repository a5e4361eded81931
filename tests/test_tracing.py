"""common/tracing.py in one process against a real OTLP receiver: the step's span, a client span whose metadata a
server span continues, a traceparent carried in a message, all in one trace; off means no-ops."""

from __future__ import annotations

import pytest
from otlp_support import OtlpReceiver

from dgrpo.common import tracing
from dgrpo.common.config import ConfigError
from dgrpo.common.tracing_config import TracingConfig


def test_off_is_a_no_op():
    assert tracing.client_span("Generate").metadata is None
    traceparent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    assert tracing.server_span("Generate", [("traceparent", traceparent)]).metadata is None
    assert tracing.traceparent() == ""
    with tracing.span("step") as s, tracing.span_from("load", "") as t:
        assert s is None and t is None
    tracing.check(TracingConfig())  # nothing to check


def test_one_trace_across_calls_and_messages():
    receiver = OtlpReceiver()
    try:
        tracing.init(TracingConfig(otlp_endpoint=receiver.endpoint), "learner")
        with tracing.span("step", step=3):
            call = tracing.client_span("Generate", replica="r0")
            assert dict(call.metadata)["traceparent"].startswith("00-")
            server = tracing.server_span("Generate", list(call.metadata), replica="r0")  # the callee's side
            server.end(outcome="ok")
            call.end(groups=2)
            with tracing.span("publish", weight_version=4):
                parent = tracing.traceparent()  # what the announcement carries
        with tracing.span_from("load_weights", parent, weight_version=4):
            pass
        tracing.shutdown()  # flushes
    finally:
        tracing.shutdown()
        receiver.stop()
    spans = {(s.name, s.attributes.get("outcome", "")): s for s in receiver.spans()}
    step = spans[("step", "")]
    client, server = spans[("Generate", "")], spans[("Generate", "ok")]
    publish, load = spans[("publish", "")], spans[("load_weights", "")]
    assert {s.trace_id for s in spans.values()} == {step.trace_id}
    assert step.parent_id == "" and step.attributes["step"] == 3 and step.service == "dgrpo-learner"
    assert client.parent_id == step.span_id and server.parent_id == client.span_id
    assert client.attributes == {"replica": "r0", "groups": 2}
    assert publish.parent_id == step.span_id and load.parent_id == publish.span_id
    assert load.attributes["weight_version"] == 4


def test_missing_packages_name_the_key(monkeypatch):
    monkeypatch.setattr(tracing, "PACKAGES", ("dgrpo_test_absent_module",))
    with pytest.raises(ConfigError, match=r"tracing.otlp_endpoint='http://x:4317': tracing needs "
                                          r"dgrpo_test_absent_module \(pip install 'dgrpo\[tracing\]'\)"):
        tracing.check(TracingConfig(otlp_endpoint="http://x:4317"))


def test_endpoint_must_be_a_url():
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    with pytest.raises(ConfigError, match=r"tracing.otlp_endpoint='localhost:4317': .*must be a URL starting with "
                                          r"http://"):
        load_config(StackConfig, None, ["tracing.otlp_endpoint=localhost:4317"])
