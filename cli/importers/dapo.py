"""verl's DAPO keys for `dgrpo import-config --from verl`: dynamic sampling, overlong reward shaping, the reward
manager, and the reward function verl falls back to.

verl spells the overlong buffer three ways, all read here: `reward_model.overlong_buffer.*` (recipe/dapo's
dapo_trainer.yaml), `+reward_model.reward_kwargs.overlong_buffer_cfg.*` with `reward_model.reward_kwargs.max_resp_len`
(`reward_manager=dapo` under verl.trainer.main_ppo, as in recipe/dapo/test_dapo_7b_math.sh), and
`custom_reward_function.overlong_buffer.*` (older recipe scripts). Both features land in `learner.algorithm`
(learner/rollout/dapo.py).
"""

from __future__ import annotations

from typing import Any

FG, OB = "algorithm.filter_groups.", "learner.algorithm.overlong_buffer."
OVERLONG_PREFIXES = ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
                     "custom_reward_function.overlong_buffer.")
# Reward managers that call compute_score once per completion, as dgrpo's verl convention does.
SAME_MANAGERS = {"naive": "dgrpo calls compute_score once per completion, as verl's naive manager does",
                 "dapo": "dgrpo calls compute_score once per completion as verl's dapo manager does; its overlong "
                         "penalty comes from the overlong_buffer keys (learner.algorithm.overlong_buffer)"}


def verl_dapo(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    """Translate the DAPO keys into `out` (an import_config.Imported); every key read is added to `used`."""
    _filter_groups(flat, out, used)
    _overlong(flat, out, used)
    key = "reward_model.reward_manager"
    if key in flat:
        used.add(key)
        manager = flat[key]
        if manager in SAME_MANAGERS:
            out.ignored[key] = SAME_MANAGERS[manager]
        else:
            out.unsupported[key] = f"{manager!r}: dgrpo scores each completion on its own (naive / dapo managers)"
    if not flat.get("custom_reward_function.path") and not flat.get("reward_model.enable"):
        # verl then scores with its default_compute_score; dgrpo does not bundle it.
        out.set("rewarder.spec", {"name": "verl_ground_truth", "functions": [
            {"type": "math_verify", "field": "reward_model.ground_truth"}]}, "(no custom_reward_function)")
        out.unsupported["custom_reward_function.path"] = (
            "unset: verl scores with its default_compute_score (dispatch on data_source), which dgrpo does not bundle; "
            "written: math_verify against reward_model.ground_truth. verl's own: rewarder.spec.functions: "
            "[{type: python, module: verl.utils.reward_score:default_compute_score}] where verl is installed")


def _filter_groups(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    keys = [k for k in flat if k.startswith(FG)]
    used.update(keys)
    used.add("data.gen_batch_size")
    gen, train = flat.get("data.gen_batch_size"), flat.get("data.train_batch_size")
    if not flat.get(FG + "enable"):
        for k in keys:
            out.ignored[k] = "algorithm.filter_groups.enable is false: every group is trained, as in dgrpo"
        if gen is not None and gen != train:
            out.unsupported["data.gen_batch_size"] = (
                f"{gen} prompts per generation batch without filter_groups: dgrpo samples learner.data."
                f"train_batch_size={train} prompts per step")
        elif gen is not None:
            out.ignored["data.gen_batch_size"] = "equal to data.train_batch_size"
        return
    out.set("learner.algorithm.filter_groups.enable", True, FG + "enable")
    metric = flat.get(FG + "metric")
    if metric is None:
        out.set("learner.algorithm.filter_groups.metric", "acc", FG + "metric (unset; DAPO's acc)")
    else:
        out.set("learner.algorithm.filter_groups.metric", str(metric), FG + "metric")
    cap = flat.get(FG + "max_num_gen_batches")
    if cap is not None:
        out.set("learner.algorithm.filter_groups.max_num_gen_batches", max(int(cap), 0),
                FG + "max_num_gen_batches (<= 0: no cap)")
    if gen is not None:
        out.set("learner.algorithm.filter_groups.gen_batch_size", int(gen),
                "data.gen_batch_size (the unit of the cap; replacements are requested as groups are dropped)")


def _overlong(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    max_key = "reward_model.reward_kwargs.max_resp_len"
    used.add(max_key)
    for prefix in OVERLONG_PREFIXES:
        keys = [k for k in flat if k.startswith(prefix)]
        if not keys:
            continue
        used.update(keys)
        if not flat.get(prefix + "enable"):
            for k in keys:
                out.ignored[k] = f"{prefix}enable is false: no length penalty, as in dgrpo"
            continue
        out.set(OB + "enable", True, prefix + "enable")
        for name in ("len", "penalty_factor"):
            if prefix + name in flat:
                out.set(OB + name, flat[prefix + name], prefix + name)
        if prefix + "log" in flat:
            out.ignored[prefix + "log"] = "dgrpo always logs the penalty (reward/fn/overlong_reward)"
        for k in keys:
            if k.removeprefix(prefix) not in ("enable", "len", "penalty_factor", "log"):
                out.unsupported[k] = "not a setting of verl's overlong buffer (enable, len, penalty_factor, log)"
    top, response = flat.get(max_key), flat.get("data.max_response_length")
    if top is not None and top != response:
        out.set(OB + "max_response_length", top, max_key)
    elif top is not None:
        out.ignored[max_key] = "equal to data.max_response_length, where dgrpo's buffer ends by default"
