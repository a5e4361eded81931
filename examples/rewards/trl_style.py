"""Example reward file for `rewarder.spec.functions: [{type: file, path: examples/rewards/trl_style.py, ...}]`.

These are ordinary TRL reward functions: `fn(prompts, completions, **kwargs) -> list[float | None]`, called
with keywords; every dataset column other than the prompt arrives as a keyword argument holding one value
per completion (here `answer`). They run unchanged under TRL's GRPOTrainer and under dgrpo's rewarder.
"""

import asyncio
import re


def _text(completion):
    # TRL's conversational format gives [{"role": "assistant", "content": ...}] instead of a string.
    return completion if isinstance(completion, str) else completion[-1]["content"]


def reward_func(prompts, completions, answer, **kwargs):
    """The built-in `length_and_reference` as a TRL function: +0.5 for 10..200 characters, +0.5 when the answer
    appears in the completion."""
    rewards = []
    for completion, golden in zip(completions, answer, strict=True):
        text = _text(completion)
        score = 0.0
        if 10 <= len(text) <= 200:
            score += 0.5
        if golden is not None and str(golden) in text:
            score += 0.5
        rewards.append(score)
    return rewards


def last_number_matches(prompts, completions, answer, **kwargs):
    """1.0 when the last number of the completion equals the answer; None (not applicable) without an answer."""
    out = []
    for completion, golden in zip(completions, answer, strict=True):
        if golden is None:
            out.append(None)
            continue
        numbers = re.findall(r"-?\d+(?:\.\d+)?", _text(completion))
        out.append(float(bool(numbers) and float(numbers[-1]) == float(golden)))
    return out


async def judged(prompts, completions, **kwargs):
    """An async function (e.g. one that awaits an HTTP judge): awaited to completion in the worker."""
    await asyncio.sleep(0)
    return [min(len(_text(c)) / 100.0, 1.0) for c in completions]
