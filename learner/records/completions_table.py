"""The completions table of a step (TRL's `log_completions` / `num_completions_to_print`): prompt, completion,
each reward function, reward and advantage, one row per completion.

Built from the step's rollout records (learner/records/rollout_dump.py), rendered for the console with `rich` as TRL
does
(its `print_prompt_completions_sample`), and handed as columns and rows to the table loggers (W&B, MLflow).
"""

from __future__ import annotations

import io
from typing import Any

FIXED_COLUMNS = ("step", "prompt", "completion")
TAIL_COLUMNS = ("reward", "advantage", "status")


def prompt_text(prompt: str | list[dict]) -> str:
    """A dataset prompt as one text: chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)


def columns(records: list[dict[str, Any]]) -> list[str]:
    """step, prompt, completion, one column per reward function (in first-seen order), reward, advantage, status."""
    functions: dict[str, None] = {}
    for rec in records:
        functions.update(dict.fromkeys(rec["breakdown"]))
    return [*FIXED_COLUMNS, *functions, *TAIL_COLUMNS]


def rows(records: list[dict[str, Any]], cols: list[str]) -> list[list[Any]]:
    """One row per record, in `cols` order (a function that did not score a completion: None)."""
    out = []
    for rec in records:
        cells = {
            "step": rec["step"],
            "prompt": prompt_text(rec["prompt"]),
            "completion": rec["completion"],
            **rec["breakdown"],
            "reward": rec["reward"],
            "advantage": rec["advantage"],
            "status": rec["status"],
        }
        out.append([cells.get(c) for c in cols])
    return out


def pick(records: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """At most `limit` records, one per prompt before a second of any: sample 0 of every prompt in batch order,
    then sample 1, ... (None: all of them)."""
    if limit is None:
        return records
    return sorted(records, key=lambda r: r["sample"])[:limit]  # stable: batch order within a sample index


def render(records: list[dict[str, Any]], step: int, width: int = 160) -> str:
    """The console table of `records` as text (rich, no colour codes: it goes through the log)."""
    from rich.console import Console
    from rich.table import Table

    cols = columns(records)
    table = Table(title=f"completions, step {step}", show_lines=True, expand=True)
    for c in cols:
        numeric = c not in ("prompt", "completion", "status")
        table.add_column(
            c,
            justify="right" if numeric else "left",
            no_wrap=numeric,
            ratio=None if numeric else 3 if c == "completion" else 2,
        )
    for row in rows(records, cols):
        table.add_row(*(_cell(v) for v in row))
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(table)
    return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
