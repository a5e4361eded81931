"""Prompt data for the learner: parquet / jsonl files -> tokenized prompts, shuffled per epoch, resumable.

A row holds a prompt (plain text, or chat messages `[{role, content}, ...]`) in `data.prompt_key`; every other
column travels untouched with the prompt to the reward functions (e.g. `answer`). The peers' files load unchanged:
verl's RL parquet (`prompt` as chat messages, `data_source`, `ability`, `reward_model: {style, ground_truth}`,
`extra_info`) and TRL's datasets (`prompt` as text or messages, or a `messages` conversation whose trailing
assistant turn is left out of the prompt, plus answer / solution columns). The chat template is applied
once, here, so samplers receive token ids and the learner trains on exactly the tokens that were sampled.
Prompts longer than `max_prompt_length` are dropped or left-truncated, and counted either way.

`datasets` is imported lazily: the config (and `dgrpo learner --help`) must not pay for it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgrpo.common.config import ConfigError
from dgrpo.learner.config import DataConfig

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row, ready to sample and to score."""

    row: int
    """Row index in the (concatenated) files: a stable identity for logs and resume checks."""
    token_ids: tuple[int, ...]
    """Prompt tokens after the chat template (and truncation): what the sampler and the learner see."""
    prompt: str | list[dict[str, str]]
    """The prompt as the dataset holds it, for the reward functions."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other column of the row (e.g. `answer`)."""


@dataclass
class LoadStats:
    rows: int = 0
    kept: int = 0
    dropped_overlong: int = 0
    truncated_overlong: int = 0


def check_files(cfg: DataConfig, prefix: str = "learner.data", columns: dict[str, str] | None = None) -> None:
    """Fail at start, naming the key, when a data file is missing, unreadable, empty, of an unknown format, or lacks
    the prompt column or one of `columns` (column -> the key that asks for it, e.g. a reward function's `field`).

    Reads only each file's schema or first row: a typo costs a second, not the load of a large file.
    """
    if not cfg.train_files:
        raise ConfigError(f"{prefix}.train_files is empty: give at least one .parquet or .jsonl file")
    needed = {col.split(".")[0]: asker for col, asker in (columns or {}).items()}  # `a.b`: a key of column `a`
    for key in ("train_files", "val_files"):
        files = getattr(cfg, key)
        formats = set()
        for i, name in enumerate(files):
            path = Path(name).expanduser()
            if path.suffix not in FORMATS:
                raise ConfigError(f"{prefix}.{key}[{i}]={name!r}: unknown format (use .parquet, .jsonl or .json)")
            if not path.is_file():
                raise ConfigError(f"{prefix}.{key}[{i}]={name!r}: no such file")
            formats.add(FORMATS[path.suffix])
            try:
                found = first_row_columns(path)
            except (OSError, ValueError, TypeError) as e:
                raise ConfigError(f"{prefix}.{key}[{i}]={name!r}: cannot be read: {e}") from None
            missing = [(col, asker) for col, asker in {prompt_column(cfg, found): f"{prefix}.prompt_key",
                                                       **needed}.items() if col not in found]
            if missing:
                col, asker = missing[0]
                raise ConfigError(f"{prefix}.{key}[{i}]={name!r} has no column {col!r} ({asker}={col!r} names it); "
                                  f"its columns: {found}")
        if len(formats) > 1:
            raise ConfigError(f"{prefix}.{key}={files!r}: mixes parquet and json files; use one format per list")


def first_row_columns(path: Path) -> list[str]:
    """The columns of a data file, from the parquet schema or the first JSON row; ValueError when it has no rows or
    is not of its format, TypeError when its rows are not objects."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise ValueError(f"not a parquet file ({e})") from None
        if meta.metadata.num_rows == 0:
            raise ValueError("no rows")
        return list(meta.schema_arrow.names)
    with open(path, encoding="utf-8") as f:
        line = f.readline()
        while line and not line.strip():
            line = f.readline()
        if not line:
            raise ValueError("no rows")
        if not line.lstrip().startswith("["):  # JSON lines
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"the first row is not JSON ({e})") from None
        else:  # one JSON array: decode its first element only, reading on as far as it reaches
            text = line.lstrip()[1:]
            while True:
                if text.lstrip().startswith("]"):
                    raise ValueError("no rows")
                try:
                    row, _ = json.JSONDecoder().raw_decode(text.lstrip())
                    break
                except json.JSONDecodeError as e:
                    more = f.read(1 << 20)
                    if not more:
                        raise ValueError(f"not valid JSON ({e})") from None
                    text += more
    if not isinstance(row, dict):
        raise TypeError(f"rows must be JSON objects, the first is {type(row).__name__}")
    return list(row)


FALLBACK_PROMPT_KEY = "messages"
"""The column a conversational dataset without `prompt` holds its turns in (TRL's conversational format)."""


def prompt_column(cfg: DataConfig, columns: list[str]) -> str:
    """The column holding the prompt: `prompt_key`, or `messages` when prompt_key is the default and absent."""
    default = DataConfig.model_fields["prompt_key"].default
    if cfg.prompt_key not in columns and cfg.prompt_key == default and FALLBACK_PROMPT_KEY in columns:
        return FALLBACK_PROMPT_KEY
    return cfg.prompt_key


def _non_json(value: Any) -> str | None:
    """Why `value` is not plain JSON (NaN / ±inf floats, other types), or None when it is.

    Columns go to the reward functions as a protobuf Struct: NaN would arrive as a silent NaN reward input, and a
    non-JSON type (bytes, a timestamp) has no faithful Struct form, so both are refused at load.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, list):
        return next((why for why in map(_non_json, value) if why), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "a mapping with non-string keys"
        return next((why for why in map(_non_json, value.values()) if why), None)
    return f"{type(value).__name__} is not a JSON type"


def _file_of_row(files: list[str], row: int) -> str:
    """Which file a row of the concatenated dataset came from (counted without decoding the rows)."""
    if len(files) == 1:
        return files[0]
    start = 0
    for name in files:
        path = Path(name).expanduser()
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            count = pq.ParquetFile(path).metadata.num_rows
        else:
            text = path.read_text()
            count = len(json.loads(text)) if text.lstrip().startswith("[") else sum(1 for ln in text.splitlines()
                                                                                     if ln.strip())
        if row < start + count:
            return f"{name} (row {row - start} of that file)"
        start += count
    return str(files)


def _as_messages(value: Any, row: int, key: str) -> list[dict[str, str]] | None:
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
        if key == FALLBACK_PROMPT_KEY:  # a whole conversation: the model is to write its final assistant turn
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
        if not messages:
            raise ValueError(f"row {row}: column {key!r} holds no turn before the assistant's")
        return messages
    if isinstance(value, str):
        return None
    raise ValueError(f"row {row}: column {key!r} is neither text nor chat messages [{{role, content}}]: {value!r}")


def tokenize_prompt(prompt: str | list[dict[str, str]], tokenizer, apply_chat_template: bool) -> list[int]:
    """The token ids the sampler receives: chat messages (or text as one user turn) through the chat template."""
    if isinstance(prompt, str) and not apply_chat_template:
        return list(tokenizer(prompt).input_ids)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    # Render to text, then tokenize without special tokens: the template already holds them.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def load_prompts(
    files: list[str], cfg: DataConfig, tokenizer, max_samples: int | None = None
) -> tuple[list[PromptRecord], LoadStats]:
    """Read, template, tokenize and length-filter the rows of `files`."""
    import datasets

    if not files:
        return [], LoadStats()
    builder = FORMATS[Path(files[0]).suffix]
    ds = datasets.load_dataset(builder, data_files=[str(Path(f).expanduser()) for f in files], split="train")
    prompt_key = prompt_column(cfg, ds.column_names)
    if prompt_key not in ds.column_names:
        raise ConfigError(
            f"learner.data.prompt_key={cfg.prompt_key!r}: no such column in {files} (columns: {ds.column_names})"
        )
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    stats = LoadStats(rows=len(ds))
    records: list[PromptRecord] = []
    for row, example in enumerate(ds):
        for key, value in example.items():
            why = _non_json(value)
            if why:
                raise ConfigError(
                    f"learner.data: {_file_of_row(files, row)}, row {row}, column {key!r}: {why} "
                    "(every column must hold JSON values: fix or drop the row)"
                )
        raw = example[prompt_key]
        messages = _as_messages(raw, row, prompt_key)
        prompt = messages if messages is not None else raw
        ids = tokenize_prompt(prompt, tokenizer, cfg.apply_chat_template)
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong_prompts == "drop":
                stats.dropped_overlong += 1
                continue
            ids = ids[-cfg.max_prompt_length :]
            stats.truncated_overlong += 1
        extra = {k: v for k, v in example.items() if k != prompt_key}
        records.append(PromptRecord(row=row, token_ids=tuple(ids), prompt=prompt, extra=extra))
    stats.kept = len(records)
    if stats.dropped_overlong or stats.truncated_overlong:
        log.warning(
            "%s: %d of %d prompts exceed max_prompt_length=%d (%s)", files, stats.dropped_overlong
            + stats.truncated_overlong, stats.rows, cfg.max_prompt_length, cfg.overlong_prompts,
        )
    if not records:
        raise ConfigError(
            f"learner.data: no prompt of {files} fits max_prompt_length={cfg.max_prompt_length} "
            f"({stats.dropped_overlong} dropped)"
        )
    return records, stats


class PromptStream:
    """An endless, seeded, epoch-by-epoch stream of prompt batches with a resumable position.

    Epoch e visits every record once in the order `permutation(seed + e)`; a batch that crosses an epoch boundary
    continues into the next epoch, so every batch is full. The position (epoch, index) is all the state there is.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not records:
            raise ValueError("PromptStream needs at least one record")
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import numpy as np

        if not self.shuffle:
            return list(range(len(self.records)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records)).tolist()

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.records) / self.batch_size)

    def next_batch(self, size: int | None = None) -> list[PromptRecord]:
        """The next `size` records (default: the batch size)."""
        batch: list[PromptRecord] = []
        while len(batch) < (size or self.batch_size):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.records[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": len(self.records)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != len(self.records) or state.get("seed") != self.seed:
            raise ValueError(
                f"data position {state} does not match this dataset (size {len(self.records)}, seed {self.seed}):"
                " resuming would replay a different order"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
