"""Prompt data: formats, chat template, extra columns, overlong prompts, seeded epochs, resumable position."""

from __future__ import annotations

import json

import pytest

from dgrpo.common.config import ConfigError
from dgrpo.learner.config import DataConfig
from dgrpo.learner.rollout.data import PromptStream, check_files, load_prompts, tokenize_prompt


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
    from dgrpo.learner.rollout.data import PromptRecord

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


# ---- the peers' dataset files, written in exactly their schemas ----


def verl_gsm8k_rows() -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them (its make_map_fn)."""
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the final "
                    "answer after \"####\"."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                       "question": f"What is {i} + {i}?"},
    } for i in range(3)]


def test_verl_rl_parquet_loads_unchanged(tmp_path, tokenizer):
    """verl's RL parquet (pyarrow, nested structs and a list of structs) -> chat prompts and verl's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = verl_gsm8k_rows()
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = DataConfig(train_files=[str(path)])
    check_files(cfg, columns={"reward_model.ground_truth": "rewarder.spec.functions[0].field"})
    records, _ = load_prompts([str(path)], cfg, tokenizer)
    assert records[1].prompt == rows[1]["prompt"]
    assert records[1].extra == {k: v for k, v in rows[1].items() if k != "prompt"}
    assert records[1].extra["reward_model"]["ground_truth"] == "2" and records[1].extra["extra_info"]["index"] == 1
    expected = tokenizer.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(records[1].token_ids) == expected
    with pytest.raises(ConfigError, match="has no column 'answer'"):  # a dotted field needs its first part
        check_files(cfg, columns={"answer.x": "rewarder.spec.functions[0].field"})


def test_verl_parquet_rows_score_with_verl_and_dotted_fields(tmp_path, tokenizer):
    """A verl row's columns are what verl's compute_score and a dotted built-in field read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dgrpo.rewarder.builtins import build_builtin
    from dgrpo.rewarder.calling import call_function, user_function
    from dgrpo.rewarder.config import ExactMatchFunction

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_gsm8k_rows()), path)
    rec = load_prompts([str(path)], DataConfig(train_files=[str(path)]), tokenizer)[0][2]
    columns = {k: [v, v] for k, v in rec.extra.items()}  # one value per completion, as the rewarder passes them
    match = build_builtin(ExactMatchFunction(type="exact_match", field="reward_model.ground_truth",
                                             extract="last_line"))
    assert match([rec.prompt] * 2, ["so\n4", "so\n5"], **columns) == [1.0, 0.0]

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str.endswith(ground_truth)), "index": extra_info["index"],
                "gsm8k": data_source == "openai/gsm8k"}

    kind, scored = call_function(user_function(compute_score, "auto", {}), [rec.prompt] * 2,
                                 [[{"role": "assistant", "content": "#### 4"}],
                                  [{"role": "assistant", "content": "3"}]],
                                 columns)
    assert kind == "ok" and scored.values == [1.0, 0.0] and scored.extras[0] == {"index": 2.0, "gsm8k": 1.0}


def test_trl_datasets_load_unchanged(tmp_path, tokenizer):
    """TRL's formats: standard (`prompt` text + `solution`, jsonl), conversational (`prompt` messages, parquet via
    `datasets`), and a `messages` conversation whose final assistant turn is the answer."""
    import datasets

    standard = write_jsonl(tmp_path / "std.jsonl", [{"prompt": "1+1=", "solution": "2"},
                                                    {"prompt": "2+2=", "solution": "4"}])
    records, _ = load_prompts([standard], DataConfig(train_files=[standard]), tokenizer)
    assert records[0].prompt == "1+1=" and records[0].extra == {"solution": "2"}

    chat = [{"prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "3+3?"}],
             "answer": "6"}]
    conversational = str(tmp_path / "conv.parquet")
    datasets.Dataset.from_list(chat).to_parquet(conversational)
    records, _ = load_prompts([conversational], DataConfig(train_files=[conversational]), tokenizer)
    assert records[0].prompt == chat[0]["prompt"] and records[0].extra == {"answer": "6"}

    turns = [{"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "8"}]
    messages = write_jsonl(tmp_path / "msgs.jsonl", [{"messages": turns, "solution": "8"}])
    cfg = DataConfig(train_files=[messages])
    check_files(cfg)  # `messages` stands in for the default prompt column
    records, _ = load_prompts([messages], cfg, tokenizer)
    assert records[0].prompt == turns[:1] and records[0].extra == {"solution": "8"}
    # Only for the default prompt_key: a named column must exist.
    with pytest.raises(ConfigError, match="has no column 'question'"):
        check_files(DataConfig(train_files=[messages], prompt_key="question"))
