"""The bundled demo tasks (dgrpo.cli.tasks): deterministic files, right answers, held-out validation questions."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from dgrpo.cli.tasks import (
    DEMO_TASK,
    INSTRUCTION,
    TASKS,
    announce_written,
    bundled_task_file,
    last_number_reward,
    make_rows,
    write_missing_task_files,
    write_task,
)
from dgrpo.common.config import ConfigError
from dgrpo.learner.config import DataConfig
from dgrpo.learner.rollout.data import check_files

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


# ---- a config naming a bundled task's files that are missing (dgrpo up / dgrpo learner on a fresh clone) ----------

@pytest.mark.parametrize(("name", "found"), [
    ("arith-train.parquet", ("arith", "train", "parquet")),
    ("add_word-val.jsonl", ("add_word", "val", "jsonl")),
    ("nope-train.parquet", None),       # not a bundled task
    ("arith-test.parquet", None),       # not a split write_task writes
    ("arith-train.json", None),         # nor a format
    ("arith-train.parquet.bak", None),
    ("my-arith-train.parquet", None),
])
def test_bundled_task_file_names(name, found):
    assert bundled_task_file(f"some/dir/{name}") == found


def test_missing_bundled_task_files_are_written_as_the_write_command_writes_them(tmp_path, capsys):
    reference = write_task(tmp_path / "reference")  # what `python -m dgrpo.cli.tasks write` writes
    data = DataConfig(train_files=[str(tmp_path / "data" / "arith-train.parquet")],
                      val_files=[str(tmp_path / "data" / "arith-val.parquet")])
    written = write_missing_task_files(data)
    assert written == [tmp_path / "data" / "arith-train.parquet", tmp_path / "data" / "arith-val.parquet"]
    for made, ref in zip(written, reference, strict=True):
        assert made.read_bytes() == ref.read_bytes(), made
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["arith-train.parquet", "arith-val.parquet"]
    check_files(data)
    announce_written("dgrpo up", written)

    # Another task, in jsonl, train only: its val split (never named) is not left behind.
    add_ref = write_task(tmp_path / "reference", "add", fmt="jsonl")
    add = DataConfig(train_files=[str(tmp_path / "x" / "add-train.jsonl")])
    assert write_missing_task_files(add) == [tmp_path / "x" / "add-train.jsonl"]
    assert (tmp_path / "x" / "add-train.jsonl").read_bytes() == add_ref[0].read_bytes()
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["add-train.jsonl"]
    announce_written("dgrpo learner", [tmp_path / "x" / "add-train.jsonl"])
    announce_written("dgrpo learner", [])
    assert capsys.readouterr().out.splitlines() == [
        (f"dgrpo up: wrote the missing {written[0]}, {written[1]} from the bundled tasks (what `python -m "
        f"dgrpo.cli.tasks write {tmp_path / 'data'}` writes)"),
        (f"dgrpo learner: wrote the missing {tmp_path / 'x' / 'add-train.jsonl'} from the bundled tasks (what `python "
        f"-m dgrpo.cli.tasks write {tmp_path / 'x'} --name add --format jsonl` writes)")]

    # Present files are never touched, even the user's own under a bundled task's name; only the missing one is made.
    (tmp_path / "data" / "arith-train.parquet").write_bytes(b"mine")
    (tmp_path / "data" / "arith-val.parquet").unlink()
    assert write_missing_task_files(data) == [tmp_path / "data" / "arith-val.parquet"]
    assert (tmp_path / "data" / "arith-train.parquet").read_bytes() == b"mine"
    assert (tmp_path / "data" / "arith-val.parquet").read_bytes() == reference[1].read_bytes()
    assert write_missing_task_files(data) == []


def test_any_other_missing_file_keeps_its_error(tmp_path):
    data = DataConfig(train_files=[str(tmp_path / "data" / "nope-train.parquet")],
                      val_files=[str(tmp_path / "data" / "arith-test.parquet")])
    assert write_missing_task_files(data) == []
    assert not (tmp_path / "data").exists()
    with pytest.raises(ConfigError, match=r"learner.data.train_files\[0\]=.*nope-train.parquet': no such file"):
        check_files(data)


def test_a_folder_that_cannot_be_written_names_the_key(tmp_path):
    (tmp_path / "afile").write_text("x")
    data = DataConfig(train_files=[str(tmp_path / "afile" / "arith-train.parquet")])
    with pytest.raises(ConfigError, match=r"learner.data.train_files\[0\]=.*afile/arith-train.parquet': missing, and "
                                          r"the bundled task 'arith' cannot be written there"):
        write_missing_task_files(data)
