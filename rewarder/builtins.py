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


def _against_references(kwargs: dict, field: str, completions: list,
                        score: Callable[[str, str], float | None]) -> list[float | None]:
    """`score(completion text, reference text)` per completion; None (not applicable) where the reference is None."""
    refs = _reference_column(kwargs, field, len(completions))
    out: list[float | None] = []
    for completion, ref in zip(completions, refs, strict=True):
        ref_text = reference_text(ref)
        out.append(None if ref_text is None else score(completion_text(completion), ref_text))
    return out


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
        gold_cache: dict[str, list] = {}

        def score(text: str, ref_text: str) -> float | None:
            if ref_text not in gold_cache:
                gold_cache[ref_text] = parse(ref_text, extraction_config=configs)
            gold = gold_cache[ref_text]
            if not gold:
                return None
            if cfg.answer_tag:
                text = last_answer_tag(text) or text
            answer = parse(text, extraction_config=configs)
            return 1.0 if answer and verify(gold, answer) else 0.0

        return _against_references(kwargs, cfg.field, completions, score)

    return math_verify


def exact_match_reward(cfg: ExactMatchFunction) -> RewardFn:
    def score(text: str, ref_text: str) -> float:
        found: str | None = text
        if cfg.extract == "answer_tag":
            found = last_answer_tag(text)
        elif cfg.extract == "last_line":
            lines = [line for line in text.splitlines() if line.strip()]
            found = lines[-1] if lines else ""
        if found is None:
            return 0.0
        if cfg.normalize:
            return float(normalize(found) == normalize(ref_text))
        return float(found.strip() == ref_text.strip())

    def exact_match(prompts, completions, **kwargs) -> list[float | None]:
        return _against_references(kwargs, cfg.field, completions, score)

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

    def score(text: str, golden: str) -> float:
        return (0.5 if 10 <= len(text) <= 200 else 0.0) + (0.5 if golden and golden in text else 0.0)

    def length_and_reference(prompts, completions, **kwargs) -> list[float | None]:
        refs = _reference_column(kwargs, cfg.field, len(completions))
        return [score(completion_text(c), reference_text(r) or "") for c, r in zip(completions, refs, strict=True)]

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
