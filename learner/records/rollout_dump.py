"""Rollout data dumps: every trained completion of a step as one JSONL record (verl's `trainer.rollout_data_dir`),
and the validation generations likewise (verl's `trainer.validation_data_dir`).

One file per step, `<dir>/<step>.jsonl`, written whole and renamed into place: a resumed run that trains a step
again replaces that step's file, and a crash never leaves half a file. A record (`completion_records`):

    step, prompt_id (dataset row), request_id (the Generate prompt id), sample (index in the group), prompt (as the
    dataset holds it: text or chat messages), completion (text), reward, breakdown (per reward function), advantage,
    status (ok / error / no_reward / aborted), length (completion tokens), finish_reason, first_weight_version,
    weight_version, staleness (trained version - first version), replica, spec (the reward spec that scored it),
    and for multi-turn rollouts messages and tool_stats.

Texts longer than `max_chars` are cut (with a marker naming how much was cut), so a record stays under about
3 x max_chars + 1 kB whatever the model writes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from dgrpo.learner.rollout.pipeline import first_version
from dgrpo.v1 import sampler_pb2

FINISH_REASONS = {
    sampler_pb2.FINISH_REASON_STOP: "stop",
    sampler_pb2.FINISH_REASON_LENGTH: "length",
    sampler_pb2.FINISH_REASON_ABORT: "abort",
}


def clip_text(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and a marker saying how many more there were."""
    return text if len(text) <= max_chars else f"{text[:max_chars]}...[{len(text) - max_chars} more chars]"


def _clip_prompt(prompt: str | list[dict], max_chars: int) -> str | list[dict]:
    if isinstance(prompt, str):
        return clip_text(prompt, max_chars)
    return [{**m, "content": clip_text(str(m.get("content", "")), max_chars)} for m in prompt]


def completion_status(valid: bool, no_reward: bool, tokens: int) -> str:
    """ok: scored and trained on; aborted: the sampler returned no tokens; no_reward: every reward function
    returned None; error: the rewarder failed on it (both of the last out of the loss, advantage 0)."""
    if not tokens:
        return "aborted"
    if valid:
        return "ok"
    return "no_reward" if no_reward else "error"


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


def completion_records(
    step: int, scored: Sequence[Any], advantages: Sequence[float] | None, trained_version: int, max_chars: int
) -> list[dict[str, Any]]:
    """One record per completion of `scored` (groups.ScoredGroup: record, group, reward), in batch order.

    `advantages`: one per completion in the same order (None for validation: nothing is trained);
    `trained_version`: the weight version the step trains from (staleness is measured against it)."""
    out: list[dict[str, Any]] = []
    k = 0
    for sg in scored:
        reward = sg.reward
        for j, c in enumerate(sg.group.completions):
            no_reward = bool(reward.no_reward[j]) if j < len(reward.no_reward) else False
            first = first_version(c)
            rec: dict[str, Any] = {
                "step": step,
                "prompt_id": sg.record.row,
                "request_id": sg.group.prompt_id,
                "sample": j,
                "prompt": _clip_prompt(sg.record.prompt, max_chars),
                "completion": clip_text(c.text, max_chars),
                "reward": _number(reward.rewards[j]),
                "breakdown": {name: _number(v) for name, v in reward.breakdown[j].items()},
                "advantage": None if advantages is None else _number(advantages[k]),
                "status": completion_status(reward.valid[j], no_reward, len(c.token_ids)),
                "length": len(c.token_ids),
                "finish_reason": FINISH_REASONS.get(c.finish_reason, "unspecified"),
                "first_weight_version": first,
                "weight_version": c.weight_version,
                "staleness": max(trained_version - first, 0),
                "replica": sg.group.replica_id,
                "spec": reward.spec,
            }
            if c.messages:
                rec["messages"] = _clip_prompt(
                    [MessageToDict(m, preserving_proto_field_name=True) for m in c.messages], max_chars
                )
            if c.HasField("turn_stats"):
                rec["tool_stats"] = MessageToDict(c.turn_stats, preserving_proto_field_name=True)
            out.append(rec)
            k += 1
    return out


def write_step_file(directory: str | Path, step: int, records: list[dict[str, Any]]) -> Path:
    """`<directory>/<step>.jsonl` holding `records`, replaced whole (a re-trained step overwrites its file)."""
    path = Path(directory) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    os.replace(tmp, path)
    return path
