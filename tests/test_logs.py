"""`printable`: client text becomes one bounded, escaped log line; the learner's Stop reason goes through it."""

from __future__ import annotations

import asyncio
import logging

import grpc

from dgrpo.common.logs import printable
from dgrpo.learner.records.control import LoopState, start_control_server
from dgrpo.v1 import learner_pb2, learner_pb2_grpc


def test_plain_text_is_unchanged():
    assert printable("stop: loss diverged at step 12 (ünïcode ok)") == "stop: loss diverged at step 12 (ünïcode ok)"
    assert printable("") == ""
    assert printable(42) == "42"


def test_line_breaks_controls_and_invisible_characters_are_escaped():
    assert printable("a\nb\r\nc\td") == "a\\nb\\r\\nc\\td"
    assert printable("\x1b[31mred\x00\x7f") == "\\x1b[31mred\\x00\\x7f"
    # NEL, the Unicode line and paragraph separators, a bidi override and a zero-width space.
    assert printable("x\x85y\u2028z\u2029\u202e\u200b") == "x\\x85y\\u2028z\\u2029\\u202e\\u200b"
    # A backslash is escaped too: a literal "\n" in the text cannot pass for an escaped newline.
    assert printable("a\\nb") == "a\\\\nb"
    assert "\n" not in printable("\n" * 1000, limit=10_000)


def test_output_is_bounded_with_a_marker():
    assert printable("x" * 200) == "x" * 200
    assert printable("x" * 201) == "x" * 200 + "...[1 more chars]"
    out = printable("ab\n" * 1_000_000, limit=50)
    # 12 x "ab\\n" (4 output chars each) + "ab" fill 50 characters: 38 of the 3,000,000 were read.
    assert out.startswith("ab\\nab\\n") and out.endswith("...[2999962 more chars]")
    assert len(out) < 80
    # An escape is never cut in half.
    assert printable("abcd\n", limit=5) == "abcd...[1 more chars]"


def test_stop_reason_over_a_real_channel_is_logged_as_one_bounded_line(caplog):
    state = LoopState(step=3)
    reason = "bye\n12:00:00 INFO [learner] dgrpo.learner: forged line\n" + "z" * 1_000_000

    async def scenario():
        server = await start_control_server(state, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = learner_pb2_grpc.LearnerStub(channel)
                return await stub.Stop(learner_pb2.StopRequest(reason=reason), timeout=30)
        finally:
            await server.stop(0)

    with caplog.at_level(logging.INFO, logger="dgrpo.learner.records.control"):
        response = asyncio.run(scenario())
    assert response.stopping_after_step == 4 and state.stop_requested
    lines = [r.getMessage() for r in caplog.records if "stop requested" in r.getMessage()]
    assert len(lines) == 1
    assert "\n" not in lines[0] and "bye\\n12:00:00 INFO" in lines[0] and len(lines[0]) < 400
    assert "more chars]" in lines[0] and state.stop_reason == printable(reason)
