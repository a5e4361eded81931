"""The bundled demo tasks (dgrpo.cli.tasks): deterministic files, right answers, held-out validation questions."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from dgrpo.cli.tasks import DEMO_TASK, INSTRUCTION, TASKS, last_number_reward, make_rows, write_task

_QUESTION = re.compile(r"(\d+) ([+×-]) (\d+)(?: \+ (\d+))?")
_WORD = re.compile(r"has (\d+) \w+ and (gets|gives away) (\d+)")


def solve(question: str) -> int:
    """An independent reading of the question text (not the generator's own arithmetic)."""
    if m := _WORD.search(question):
        a, verb, b = int(m[1]), m[2], int(m[3])
        return a + b if verb == "gets" else a - b
    m = _QUESTION.search(question)
    assert m, f"cannot read {question!r}"
    a, op, b = int(m[1]), m[2], int(m[3])
    value = {"+": a + b, "×": a * b, "-": a - b}[op]
    return value + int(m[4]) if m[4] else value


def read(path) -> list[dict]:
    if str(path).endswith(".jsonl"):
        return [json.loads(line) for line in open(path)]
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_answers_are_right(name):
    rows = make_rows(name, 40, seed=3)
    for row in rows:
        assert row["answer"] == str(solve(row["question"])), row
        assert row["prompt"] == [{"role": "user", "content": row["question"] + INSTRUCTION}]
        assert row["task"] == name
    assert len({r["question"] for r in rows}) == len(rows)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_is_deterministic_and_val_is_held_out(tmp_path, fmt):
    a_train, a_val = write_task(tmp_path / "a", DEMO_TASK, n_train=50, n_val=20, seed=7, fmt=fmt)
    b_train, b_val = write_task(tmp_path / "b", DEMO_TASK, n_train=50, n_val=20, seed=7, fmt=fmt)
    assert a_train.read_bytes() == b_train.read_bytes() and a_val.read_bytes() == b_val.read_bytes()
    assert a_train.name == f"{DEMO_TASK}-train.{fmt}" and a_val.name == f"{DEMO_TASK}-val.{fmt}"

    train, val = read(a_train), read(a_val)
    assert len(train) == 50 and len(val) == 20
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    assert len({r["id"] for r in train + val}) == 70
    assert set(train[0]) == {"id", "task", "question", "prompt", "answer"}

    other_train, _ = write_task(tmp_path / "c", DEMO_TASK, n_train=50, n_val=20, seed=8, fmt=fmt)
    assert [r["question"] for r in read(other_train)] != [r["question"] for r in train]


def test_default_train_split_takes_every_question_not_in_val(tmp_path):
    train, val = write_task(tmp_path, "add", n_val=16)  # single-digit a + b: 81 questions
    assert len(read(train)) == 81 - 16 and len(read(val)) == 16


def test_too_many_questions_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="only 64 distinct questions"):
        make_rows("mul", 65, seed=0)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        write_task(tmp_path, "nope")


def test_last_number_reward():
    assert last_number_reward("3 + 4 = 7", "7") == 1.0
    assert last_number_reward("It is 7. Check: 7 - 4 = 3", "7") == 0.0
    assert last_number_reward("1,200 apples", "1200") == 1.0
    assert last_number_reward("no digits", "7") == 0.0


def test_write_command(child_processes, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli.tasks", "write", str(tmp_path), "--n-val", "8"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    train, val = proc.stdout.split()
    assert len(read(val)) == 8 and len(read(train)) > 100
