"""Rollout records, the step files and the completions table, from real protos and reward results."""

from __future__ import annotations

import json
from types import SimpleNamespace

from dgrpo.learner.records import completions_table
from dgrpo.learner.records.rollout_dump import clip_text, completion_records, write_step_file
from dgrpo.learner.rollout.data import PromptRecord
from dgrpo.learner.rollout.reward_client import GroupReward
from dgrpo.v1 import sampler_pb2 as pb


def _scored():
    """Two prompts x 2 completions: one trained normally, one with an error, an aborted one, a multi-turn one."""
    g0 = pb.Group(prompt_id="s3-0", replica_id="r0", completions=[
        pb.Completion(token_ids=[1, 2, 3], text="4", finish_reason=pb.FINISH_REASON_STOP, weight_version=5,
                      first_weight_version=4),
        pb.Completion(token_ids=[1] * 16, text="x" * 40, finish_reason=pb.FINISH_REASON_LENGTH, weight_version=5),
    ])
    g1 = pb.Group(prompt_id="s3-1", replica_id="r1", completions=[
        pb.Completion(token_ids=[], text="", finish_reason=pb.FINISH_REASON_ABORT, weight_version=5),
        pb.Completion(token_ids=[7, 8], text="done", finish_reason=pb.FINISH_REASON_STOP, weight_version=5,
                      messages=[pb.ChatMessage(role="assistant", content="call",
                                               tool_calls=[pb.ToolCall(name="calc", arguments="{}")]),
                                pb.ChatMessage(role="tool", content="5", name="calc")],
                      turn_stats=pb.TurnStats(turns=2, tool_calls=1, ended_by="answer")),
    ])
    r0 = GroupReward(rewards=[1.0, 0.5], valid=[True, False], breakdown=[{"math_verify": 1.0}, {}], spec="t@1#ab",
                     errors=["boom"], no_reward=[False, False])
    r1 = GroupReward(rewards=[0.0, 1.0], valid=[True, True], breakdown=[{"math_verify": 0.0}, {"math_verify": 1.0,
                     "length": float("nan")}], spec="t@1#ab", no_reward=[False, False])
    return [
        SimpleNamespace(record=PromptRecord(10, (1,), "What is 2+2?", {"answer": "4"}), group=g0, reward=r0),
        SimpleNamespace(record=PromptRecord(11, (1,), [{"role": "user", "content": "Add"}], {}), group=g1, reward=r1),
    ]


def test_records_carry_every_field_per_completion():
    records = completion_records(3, _scored(), [0.7, 0.0, 0.0, -0.7], trained_version=6, max_chars=16)
    assert [(r["prompt_id"], r["request_id"], r["sample"]) for r in records] == [
        (10, "s3-0", 0), (10, "s3-0", 1), (11, "s3-1", 0), (11, "s3-1", 1)]
    first, clipped, aborted, multi = records
    assert first == {
        "step": 3, "prompt_id": 10, "request_id": "s3-0", "sample": 0, "prompt": "What is 2+2?", "completion": "4",
        "reward": 1.0, "breakdown": {"math_verify": 1.0}, "advantage": 0.7, "status": "ok", "length": 3,
        "finish_reason": "stop", "first_weight_version": 4, "weight_version": 5, "staleness": 2, "replica": "r0",
        "spec": "t@1#ab"}
    assert clipped["status"] == "error" and clipped["finish_reason"] == "length" and clipped["length"] == 16
    assert clipped["completion"] == "x" * 16 + "...[24 more chars]"
    assert clipped["first_weight_version"] == 5 and clipped["staleness"] == 1  # no first version: the last one
    assert aborted["status"] == "aborted" and aborted["finish_reason"] == "abort"
    assert multi["prompt"] == [{"role": "user", "content": "Add"}]
    assert multi["breakdown"] == {"math_verify": 1.0, "length": None}  # NaN is not JSON
    assert multi["messages"][0]["tool_calls"] == [{"name": "calc", "arguments": "{}"}]
    assert multi["messages"][1] == {"role": "tool", "content": "5", "name": "calc"}
    assert multi["tool_stats"] == {"turns": 2, "tool_calls": 1, "ended_by": "answer"}
    assert "messages" not in first and "tool_stats" not in first
    # Validation: nothing trained, no advantage.
    assert {r["advantage"] for r in completion_records(3, _scored(), None, 6, 100)} == {None}


def test_status_no_reward():
    scored = _scored()
    scored[0].reward.no_reward[1] = True
    assert completion_records(1, scored, None, 5, 100)[1]["status"] == "no_reward"


def test_step_file_is_replaced_whole(tmp_path):
    records = completion_records(3, _scored(), [0.1] * 4, 6, 100)
    path = write_step_file(tmp_path / "rollouts", 3, records)
    assert path == tmp_path / "rollouts" / "3.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    write_step_file(tmp_path / "rollouts", 3, records[:1])  # the step trained again after a resume
    assert len(path.read_text().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["3.jsonl"]  # no .tmp left


def test_clip_text():
    assert clip_text("abc", 3) == "abc"
    assert clip_text("abcdef", 2) == "ab...[4 more chars]"


def test_completions_table_columns_rows_pick_and_render():
    records = completion_records(3, _scored(), [0.7, 0.0, 0.0, -0.7], 6, 100)
    cols = completions_table.columns(records)
    assert cols == ["step", "prompt", "completion", "math_verify", "length", "reward", "advantage", "status"]
    rows = completions_table.rows(records, cols)
    assert rows[0] == [3, "What is 2+2?", "4", 1.0, None, 1.0, 0.7, "ok"]
    assert rows[3][1] == "user: Add"
    # One per prompt first: sample 0 of both prompts, then sample 1.
    assert [(r["prompt_id"], r["sample"]) for r in completions_table.pick(records, 3)] == [(10, 0), (11, 0), (10, 1)]
    assert completions_table.pick(records, None) == records
    text = completions_table.render(completions_table.pick(records, 2), 3)
    assert "completions, step 3" in text and "What is 2+2?" in text and "math_verify" in text
    assert "0.700" in text and "\x1b[" not in text  # no colour codes in the log
