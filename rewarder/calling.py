"""How a worker calls a reward function, and what it accepts back: TRL's convention and verl's, in one place.

- TRL (`GRPOTrainer._calculate_rewards`): one call per group, keywords `prompts`, `completions`, `completion_ids`,
  `trainer_state`, `log_extra`, `log_metric` and every dataset column (one value per completion); returns one value
  per completion, None meaning "not applicable".
- verl (`NaiveRewardManager` with `custom_reward_function`): `compute_score(data_source=, solution_str=,
  ground_truth=, extra_info=, **reward_kwargs)` once per completion; `ground_truth` is the row's
  `reward_model["ground_truth"]`; returns a number or a dict whose `score` is the reward (its other keys are logged).

Values: numbers and booleans (1.0 / 0.0, as TRL's float tensor makes them), None, verl's dicts. Anything else, NaN
or infinity is an error for that completion that names the function's file and line, so a user can find it.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import traceback
from dataclasses import dataclass, field
from pathlib import Path

Value = float | None | str  # a reward, "not applicable", or why the value is unusable


class BadReturn(ValueError):
    """A function's return value has the wrong shape (not a list, the wrong length)."""


class CallError(Exception):
    """The call cannot be made as the convention says (verl's ground truth missing from the group)."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` offers reward functions that shape rewards by progress (a TrainerState subset)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class Scored:
    """One call's result: a value per completion, extra numbers per completion (verl dict keys, log_extra
    columns) and the scalars logged with log_metric."""

    values: list[Value]
    extras: list[dict[str, float]]
    metrics: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class UserFunction:
    """A user's function with the way to call it."""

    fn: object
    convention: str  # "trl" | "verl"
    reward_kwargs: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        """`file.py:12 (compute_score)`: where the function is defined."""
        code = getattr(inspect.unwrap(self.fn), "__code__", None)
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"{code.co_filename}:{code.co_firstlineno} ({name})" if code else name


def user_function(fn, convention: str, reward_kwargs: dict) -> UserFunction:
    """`auto` is verl's convention when the function takes `solution_str` (verl's name for the completion)."""
    if convention == "auto":
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # some builtins have no signature: TRL's convention
            params = {}
        convention = "verl" if "solution_str" in params and "completions" not in params else "trl"
    return UserFunction(fn, convention, dict(reward_kwargs))


def check_value(v) -> float | None | str:
    """One returned value as a reward, None, or the reason it is unusable."""
    if v is not None and not isinstance(v, (int, float)) and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        v = v.item()  # numpy scalars, 0-d arrays and tensors (numpy's bool_ is no numbers.Real)
    if v is None:
        return None
    if isinstance(v, bool):
        return float(v)
    if not isinstance(v, numbers.Real):
        text = repr(v)
        text = text if len(text) <= 80 else text[:80] + "..."
        return f"returned {text} ({type(v).__name__}), not a number"
    if not math.isfinite(float(v)):
        return f"returned {float(v)} (not finite)"
    return float(v)


def check_values(values, n: int) -> list[Value]:
    """Validate a reward function's return value for n completions (raises ValueError on a wrong shape)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise BadReturn(f"returned {type(values).__name__}, expected a list of {n} floats or None")
    if hasattr(values, "tolist"):  # numpy arrays, torch tensors
        values = values.tolist()
    if len(values) != n:
        raise BadReturn(f"returned {len(values)} values for {n} completions")
    return [check_value(v) for v in values]


def split_result(v) -> tuple[float | None | str, dict[str, float]]:
    """One returned value -> (the checked reward, None or why it is unusable; extra numbers): verl's dict gives its
    `score` and its other numeric keys."""
    if not isinstance(v, dict):
        return check_value(v), {}
    if "score" not in v:
        keys = ", ".join(map(str, list(v)[:10]))
        return f"returned a dict without 'score' (keys: {keys})", {}
    extras = {}
    for key, x in v.items():
        checked = check_value(x) if key != "score" and isinstance(key, str) else None
        if isinstance(checked, float):  # text and other values (verl logs them) have no place in a breakdown
            extras[key] = checked
    return check_value(v["score"]), extras


def describe_exception(e: BaseException, home: str | None = None) -> str:
    """`TypeError: msg (at file.py:12)`: the deepest frame in the user's own folder (`home`), else the innermost
    frame. A SyntaxError (a file compiled or imported during the call) quotes that file: its type and place only."""
    if isinstance(e, SyntaxError):
        return f"raised {type(e).__name__} (at {e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if home and f.filename.startswith(home)]
    frame = (own or frames or [None])[-1]
    where = f" (at {frame.filename}:{frame.lineno})" if frame else ""
    return f"raised {type(e).__name__}: {e}{where}"


def _home(fn) -> str | None:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return str(Path(code.co_filename).parent) + "/" if code else None


_LOOP: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One loop for the worker's life: an async function may keep a client (e.g. an HTTP session to a judge)
    bound to the loop it was created on across calls, which a fresh asyncio.run per call would break."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


async def _await(awaitable):
    return await awaitable


def _resolve(result):
    return _event_loop().run_until_complete(_await(result)) if inspect.isawaitable(result) else result



def _ground_truth(kwargs: dict, i: int):
    reward_model = kwargs.get("reward_model", [None] * (i + 1))[i]
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    if "ground_truth" in kwargs:
        return kwargs["ground_truth"][i]
    raise CallError("verl's compute_score takes ground_truth from the row's reward_model.ground_truth (or a "
                   f"ground_truth column); the group has neither (columns: {sorted(kwargs) or 'none'})")


def _call_verl(uf: UserFunction, completions: list, kwargs: dict) -> Scored:
    from dgrpo.rewarder.builtins import completion_text  # verl scores the final answer's text

    values: list[Value] = []
    extras: list[dict[str, float]] = []
    for i, c in enumerate(completions):
        arguments = {"data_source": kwargs.get("data_source", [None] * len(completions))[i],
                     "solution_str": completion_text(c), "ground_truth": _ground_truth(kwargs, i),
                     "extra_info": kwargs.get("extra_info", [None] * len(completions))[i]}
        try:  # one call per completion, as verl makes them: a failure is that completion's alone
            result = _resolve(uf.fn(**arguments, **uf.reward_kwargs))
        except Exception as e:  # noqa: BLE001 - user code
            values.append(describe_exception(e, _home(uf.fn)))
            extras.append({})
            continue
        value, extra = split_result(result)
        values.append(value)
        extras.append(extra)
    return Scored(values, extras)


def _call_trl(uf: UserFunction, prompts: list, completions: list, kwargs: dict, state: TrainerState) -> Scored:
    n = len(completions)
    extras: list[dict[str, float]] = [{} for _ in range(n)]
    metrics: dict[str, list[float]] = {}

    def log_metric(name: str, value: float) -> None:
        """TRL's log_metric: a scalar for this batch, averaged per step (it reaches the learner's metrics)."""
        if not isinstance(name, str) or not isinstance(check_value(value), float):
            raise TypeError(f"log_metric(name, value) takes a name and a finite number, got {name!r}, {value!r}")
        metrics.setdefault(name, []).append(float(value))

    def log_extra(column: str, values: list) -> None:
        """TRL's log_extra: a column for the completions table; numeric values join each completion's breakdown."""
        if not isinstance(column, str) or len(values) != n:
            raise TypeError(f"log_extra(column, values) takes a name and {n} values, got {column!r}, "
                            f"{len(values)} values")
        for e, v in zip(extras, values, strict=True):
            checked = check_value(v)
            if isinstance(checked, float):
                e[column] = checked

    result = _resolve(uf.fn(prompts=prompts, completions=completions, trainer_state=state, log_extra=log_extra,
                            log_metric=log_metric, **kwargs, **uf.reward_kwargs))
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        raise BadReturn(f"returned {type(result).__name__}, expected a list of {n} floats or None")
    if hasattr(result, "tolist"):
        result = result.tolist()
    if len(result) != n:
        raise BadReturn(f"returned {len(result)} values for {n} completions")
    values: list[Value] = []
    for e, v in zip(extras, result, strict=True):
        value, extra = split_result(v)
        values.append(value)
        e.update(extra)
    return Scored(values, extras, metrics)


def call_function(fn, prompts: list, completions: list, kwargs: dict,
                  state: TrainerState | None = None) -> tuple[str, object]:
    """One call: ("ok", Scored) or ("error", message). Built-ins and reward models are called TRL style without the
    trainer's extra keywords; user functions by their convention. Async functions run to completion."""
    kwargs = dict(kwargs)
    completion_ids = kwargs.pop("completion_ids", None)
    try:
        if isinstance(fn, UserFunction):
            if fn.convention == "verl":
                scored = _call_verl(fn, completions, kwargs)
            else:
                if completion_ids is not None:
                    kwargs["completion_ids"] = completion_ids
                scored = _call_trl(fn, prompts, completions, kwargs, state or TrainerState())
        else:
            values = check_values(_resolve(fn(prompts=prompts, completions=completions, **kwargs)), len(completions))
            scored = Scored(values, [{} for _ in completions])
    except BadReturn as e:
        return "error", f"{e} ({fn.where})" if isinstance(fn, UserFunction) else str(e)
    except CallError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - user code: every failure becomes an error for this call
        return "error", describe_exception(e, _home(getattr(fn, "fn", fn)))
    if isinstance(fn, UserFunction):  # a value that is unusable names where the function lives (a raise has its line)
        scored.values = [f"{v} ({fn.where})" if isinstance(v, str) and v.startswith("returned") else v
                         for v in scored.values]
    return "ok", scored
