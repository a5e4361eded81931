"""Example verl reward file: `{type: python, path: examples/rewards/verl_style.py, name: compute_score}` in
`rewarder.spec.functions` is verl's `custom_reward_function: {path: ..., name: compute_score}`, unchanged.

verl calls it once per completion with the row's `data_source`, the completion as `solution_str`, the row's
`reward_model.ground_truth` and its `extra_info` (verl's RL parquet columns, e.g. examples/data_preprocess/gsm8k.py).
A dict result's `score` is the reward; its other numeric keys show up in the breakdown as `compute_score/<key>`.
"""

import re

_FINAL = re.compile(r"#### *(-?[0-9.,]+)")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    """GSM8K-style: the number after the last `####` must equal the ground truth; `format_score` when there is one
    but it is wrong, 0 when there is none."""
    found = _FINAL.findall(solution_str)
    if not found:
        return {"score": 0.0, "formatted": False}
    answer = found[-1].replace(",", "").rstrip(".")
    return {"score": score if answer == str(ground_truth) else format_score, "formatted": True}
