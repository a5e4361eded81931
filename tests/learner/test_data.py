"""Prompt data: formats, chat template, extra columns, overlong prompts, seeded epochs, resumable position."""

from __future__ import annotations

import json

import pytest

from dgrpo.common.config import ConfigError
from dgrpo.learner.data import DataConfig, PromptStream, check_files, load_prompts, tokenize_prompt


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_and_chat_prompts_are_templated_once_and_extras_travel(tmp_path, tokenizer):
    rows = [
        {"prompt": "What is 2+3?", "answer": "5", "meta": {"level": 1}},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}],
         "answer": "42", "meta": {"level": 2}},
    ]
    files = [write_jsonl(tmp_path / "train.jsonl", rows)]
    records, stats = load_prompts(files, DataConfig(train_files=files), tokenizer)
    assert stats.kept == 2 and stats.dropped_overlong == 0
    text = tokenizer.decode(records[0].token_ids)
    assert "What is 2+3?" in text and text.rstrip().endswith("assistant")  # generation prompt appended
    assert text.count("What is 2+3?") == 1
    expected = tokenizer.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(records[1].token_ids) == expected
    assert records[1].prompt == rows[1]["prompt"]
    assert records[0].extra == {"answer": "5", "meta": {"level": 1}}


def test_raw_text_without_template(tmp_path, tokenizer):
    files = [write_jsonl(tmp_path / "t.jsonl", [{"question": "hello world", "answer": "x"}])]
    cfg = DataConfig(train_files=files, prompt_key="question", apply_chat_template=False)
    records, _ = load_prompts(files, cfg, tokenizer)
    assert list(records[0].token_ids) == tokenize_prompt("hello world", tokenizer, False)
    assert tokenizer.decode(records[0].token_ids) == "hello world"


def test_parquet(tmp_path, tokenizer):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]).to_parquet(str(path))
    records, stats = load_prompts([str(path)], DataConfig(train_files=[str(path)]), tokenizer)
    assert stats.kept == 5 and [r.extra["answer"] for r in records] == ["0", "1", "2", "3", "4"]


def test_overlong_prompts_are_dropped_or_truncated_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "short", "answer": "1"}, {"prompt": "word " * 200, "answer": "2"}]
    files = [write_jsonl(tmp_path / "t.jsonl", rows)]
    limit = len(tokenize_prompt("short", tokenizer, True)) + 2
    records, stats = load_prompts(files, DataConfig(train_files=files, max_prompt_length=limit), tokenizer)
    assert [r.row for r in records] == [0] and stats.dropped_overlong == 1 and stats.truncated_overlong == 0

    cfg = DataConfig(train_files=files, max_prompt_length=limit, overlong_prompts="truncate")
    records, stats = load_prompts(files, cfg, tokenizer)
    full = tokenize_prompt(rows[1]["prompt"], tokenizer, True)
    assert stats.truncated_overlong == 1 and stats.dropped_overlong == 0
    assert list(records[1].token_ids) == full[-limit:]  # the end (generation prompt) is kept


def test_missing_prompt_column_names_the_key(tmp_path, tokenizer):
    files = [write_jsonl(tmp_path / "t.jsonl", [{"question": "q"}])]
    with pytest.raises(ConfigError, match="learner.data.prompt_key='prompt'"):
        load_prompts(files, DataConfig(train_files=files), tokenizer)


def test_check_files_names_the_key(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q"}])
    with pytest.raises(ConfigError, match="train_files is empty"):
        check_files(DataConfig())
    with pytest.raises(ConfigError, match=r"learner.data.val_files\[1\]='.*nope.jsonl': no such file"):
        check_files(DataConfig(train_files=[good], val_files=[good, str(tmp_path / "nope.jsonl")]))
    with pytest.raises(ConfigError, match=r"train_files\[0\]=.*unknown format"):
        check_files(DataConfig(train_files=[str(tmp_path / "a.csv")]))


def test_check_files_reads_only_the_first_row_for_columns(tmp_path):
    """Columns checked in every format from the schema or the first row; empty, unreadable or malformed files named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "q", "answer": "1"}] * 3
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    pretty = tmp_path / "a.json"
    pretty.write_text(json.dumps(rows, indent=2))  # one JSON array, its first element over several lines
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for name in (jsonl, str(pretty), str(parquet)):
        check_files(DataConfig(train_files=[name]), columns={"answer": "rewarder.spec.functions[0].field"})
        with pytest.raises(ConfigError, match=r"train_files\[0\]=.*has no column 'label' \(my.key='label' names it\); "
                                              r"its columns: \['prompt', 'answer'\]"):
            check_files(DataConfig(train_files=[name]), columns={"label": "my.key"})
        with pytest.raises(ConfigError, match=r"no column 'question' \(learner.data.prompt_key='question'"):
            check_files(DataConfig(train_files=[name], prompt_key="question"))
    # The rest of a file is not read: a broken later row is the loader's to report (with its row number).
    (tmp_path / "b.jsonl").write_text(json.dumps(rows[0]) + "\n{broken\n")
    check_files(DataConfig(train_files=[str(tmp_path / "b.jsonl")]))

    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empty.json").write_text("[ ]")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])), tmp_path / "empty.parquet")
    (tmp_path / "scalar.jsonl").write_text("\"just text\"\n")
    (tmp_path / "text.parquet").write_text("not parquet")
    (tmp_path / "bad.jsonl").write_text("{prompt: q}\n")
    for name, why in [("empty.jsonl", "no rows"), ("empty.json", "no rows"), ("empty.parquet", "no rows"),
                      ("scalar.jsonl", "rows must be JSON objects, the first is str"),
                      ("text.parquet", "not a parquet file"), ("bad.jsonl", "the first row is not JSON")]:
        with pytest.raises(ConfigError, match=rf"learner.data.val_files\[0\]='.*{name}': cannot be read: {why}"):
            check_files(DataConfig(train_files=[jsonl], val_files=[str(tmp_path / name)]))


def _records(n):
    from dgrpo.learner.data import PromptRecord

    return [PromptRecord(row=i, token_ids=(i,), prompt=str(i)) for i in range(n)]


def test_stream_is_seeded_covers_each_epoch_and_resumes():
    rows = lambda batch: [r.row for r in batch]
    a = PromptStream(_records(10), 4, seed=7)
    first = [rows(a.next_batch()) for _ in range(5)]  # 20 prompts: two epochs exactly
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))  # epoch 0 visits every row once
    assert first[2][2:] + first[3] + first[4] != first[0] + first[1] + first[2][:2]  # epoch 1: new order
    assert a.epoch == 1
    b = PromptStream(_records(10), 4, seed=7)
    assert [rows(b.next_batch()) for _ in range(5)] == first  # same seed, same order
    assert rows(PromptStream(_records(10), 4, seed=8).next_batch()) != first[0]

    c = PromptStream(_records(10), 4, seed=7)
    c.next_batch(), c.next_batch(), c.next_batch()
    state = c.state_dict()
    d = PromptStream(_records(10), 4, seed=7)
    d.load_state_dict(state)
    assert [rows(d.next_batch()) for _ in range(2)] == first[3:]
    with pytest.raises(ValueError, match="does not match"):
        PromptStream(_records(11), 4, seed=7).load_state_dict(state)
    assert [rows(PromptStream(_records(5), 2, shuffle=False).next_batch()) for _ in range(1)] == [[0, 1]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_values_are_refused_at_load_naming_file_row_and_column(tmp_path, tokenizer, bad):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": ["p0", "p1"], "score": [1.0, 2.0]}), good)
    path = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"prompt": ["p2", "p3"], "score": [3.0, bad]}), path)
    with pytest.raises(ConfigError, match=rf"b\.parquet \(row 1 of that file\), row 3, column 'score': {bad}"):
        load_prompts([good, path], DataConfig(train_files=[good, path]), tokenizer)


def test_non_json_values_are_refused_at_load(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "raw.parquet")
    pq.write_table(pa.table({"prompt": ["p0"], "blob": [b"\x00\x01"]}), path)
    with pytest.raises(ConfigError, match=r"raw\.parquet, row 0, column 'blob': bytes is not a JSON type"):
        load_prompts([path], DataConfig(train_files=[path]), tokenizer)
