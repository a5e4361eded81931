"""Built-in reward functions, with the same signature as user functions (TRL's):
`fn(prompts, completions, **kwargs) -> list[float | None]`, kwargs holding one value per completion per column.

`build_builtin(config)` turns a config entry (rewarder/config.py) into such a function. Completions may be
strings (standard format) or TRL's conversational `[{"role": "assistant", "content": ...}]` (multi-turn: the
assistant and tool turns after the prompt; rules read the last assistant turn).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from dgrpo.rewarder.config import (
    ExactMatchFunction,
    LengthAndReferenceFunction,
    LengthFunction,
    MathVerifyFunction,
    RegexFormatFunction,
)

RewardFn = Callable[..., list]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"^\\boxed\{(.*)\}$", re.DOTALL)


def completion_text(completion) -> str:
    """The text of a completion in either TRL format; of a multi-turn conversation, its last assistant turn (a
    conversation cut off after a tool result is scored on what the model last said, not on the tool's output)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and all(isinstance(m, dict) for m in completion):
        said = [m for m in completion if m.get("role", "assistant") == "assistant"]
        return str(said[-1].get("content", "")) if said else ""
    raise TypeError(f"completion is neither text nor a message list: {type(completion).__name__}")


def reference_text(value) -> str | None:
    """A reference column value as text: floats that are integers lose their `.0` (Struct numbers are doubles)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _reference_column(kwargs: dict, field: str, n: int) -> list:
    """The reference of each completion: column `field`, or a key inside a column with a dotted `field` (verl's
    `reward_model.ground_truth`)."""
    head, *path = field.split(".") if field not in kwargs else [field]
    if head not in kwargs:
        raise KeyError(f"extra column {head!r} is missing from the group (columns: {sorted(kwargs) or 'none'})")
    column = kwargs[head]
    if len(column) != n:
        raise ValueError(f"column {head!r} has {len(column)} values for {n} completions")
    for key in path:
        if not all(isinstance(v, dict) and key in v for v in column):
            raise KeyError(f"column {head!r} does not hold {field!r} in every row")
        column = [v[key] for v in column]
    return column


def last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def normalize(text: str) -> str:
    """Case-folded, whitespace collapsed, without surrounding punctuation, `$` or `\\boxed{}`."""
    text = text.strip().strip("$").strip()
    boxed = _BOXED.match(text)
    if boxed:
        text = boxed.group(1)
    text = " ".join(text.casefold().split())
    return text.strip(string.punctuation + " 。，！？")


def math_verify_reward(cfg: MathVerifyFunction) -> RewardFn:
    """1.0 / 0.0 by math-verify's equivalence of the completion's final answer and the reference.

    Extraction (math-verify's configs): `\\boxed{}` first, then LaTeX, then plain expressions (the last number
    when nothing else matches); `<answer>` tags are cut out first when answer_tag is on. A reference that
    math-verify cannot parse gives None (not applicable) instead of punishing every completion.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def math_verify(prompts, completions, **kwargs) -> list[float | None]:
        refs = _reference_column(kwargs, cfg.field, len(completions))
        gold_cache: dict[str, list] = {}
        out: list[float | None] = []
        for completion, ref in zip(completions, refs):
            ref_text = reference_text(ref)
            if ref_text is None:
                out.append(None)
                continue
            if ref_text not in gold_cache:
                gold_cache[ref_text] = parse(ref_text, extraction_config=configs)
            gold = gold_cache[ref_text]
            if not gold:
                out.append(None)
                continue
            text = completion_text(completion)
            if cfg.answer_tag:
                text = last_answer_tag(text) or text
            answer = parse(text, extraction_config=configs)
            out.append(1.0 if answer and verify(gold, answer) else 0.0)
        return out

    return math_verify


def exact_match_reward(cfg: ExactMatchFunction) -> RewardFn:
    def exact_match(prompts, completions, **kwargs) -> list[float | None]:
        refs = _reference_column(kwargs, cfg.field, len(completions))
        out: list[float | None] = []
        for completion, ref in zip(completions, refs):
            ref_text = reference_text(ref)
            if ref_text is None:
                out.append(None)
                continue
            text = completion_text(completion)
            if cfg.extract == "answer_tag":
                text = last_answer_tag(text)
            elif cfg.extract == "last_line":
                lines = [line for line in text.splitlines() if line.strip()]
                text = lines[-1] if lines else ""
            if text is None:
                out.append(0.0)
            elif cfg.normalize:
                out.append(float(normalize(text) == normalize(ref_text)))
            else:
                out.append(float(text.strip() == ref_text.strip()))
        return out

    return exact_match


def regex_format_reward(cfg: RegexFormatFunction) -> RewardFn:
    pattern = re.compile(cfg.pattern, re.DOTALL)
    match = pattern.fullmatch if cfg.mode == "fullmatch" else pattern.search

    def regex_format(prompts, completions, **kwargs) -> list[float | None]:
        return [1.0 if match(completion_text(c)) else 0.0 for c in completions]

    return regex_format


def length_reward(cfg: LengthFunction) -> RewardFn:
    def measure(text: str) -> int:
        return len(text) if cfg.unit == "chars" else len(text.split())

    def length(prompts, completions, **kwargs) -> list[float | None]:
        out = []
        for c in completions:
            n = measure(completion_text(c))
            distance = max(cfg.min_length - n, 0, n - cfg.max_length)
            if cfg.mode == "bounds":
                out.append(1.0 if distance == 0 else 0.0)
            else:
                out.append(-cfg.penalty_per_unit * distance)
        return out

    return length


def length_and_reference_reward(cfg: LengthAndReferenceFunction) -> RewardFn:
    """+0.5 for 10 <= characters <= 200, +0.5 when the reference text is a substring of the completion.

    Per completion: the reference column holds one value per completion (TRL's convention), so each completion is
    tested against its own reference, never against the whole column."""

    def length_and_reference(prompts, completions, **kwargs) -> list[float | None]:
        refs = _reference_column(kwargs, cfg.field, len(completions))
        out = []
        for completion, ref in zip(completions, refs):
            text = completion_text(completion)
            score = 0.0
            if 10 <= len(text) <= 200:
                score += 0.5
            golden = reference_text(ref)
            if golden and golden in text:
                score += 0.5
            out.append(score)
        return out

    return length_and_reference


BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "math_verify": math_verify_reward,
    "exact_match": exact_match_reward,
    "regex_format": regex_format_reward,
    "length": length_reward,
    "length_and_reference": length_and_reference_reward,
}


def build_builtin(cfg) -> RewardFn:
    return BUILTINS[cfg.type](cfg)
