"""Rewarder configuration: the service settings and the reward specification (functions with weights).

The specification (`RewardSpec`) is the part that can change while training runs: the Reload RPC and
SIGHUP validate a new one with these same models, so a reloaded spec fails exactly like a bad config would.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from dgrpo.common.config import StrictConfig


class _FunctionBase(StrictConfig):
    name: str | None = Field(default=None, min_length=1, max_length=64)
    """Name in breakdowns, logs and metrics. Unset: the built-in's type, the file function's name, or "reward_model"."""
    weight: float = Field(default=1.0, allow_inf_nan=False)
    """Weight of this function in the sum (the reward is the weighted sum of the functions that did not return None)."""
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    """Seconds one call (one group, or one batch for a model) may take before its worker is killed and the
    completions get an error. Unset: rewarder.call_timeout_s."""


class MathVerifyFunction(_FunctionBase):
    """Math answer correctness with the math-verify library: 1.0 when the final answer equals the reference."""

    type: Literal["math_verify"]
    field: str = "answer"
    """Extra column holding the reference answer (LaTeX, an expression or a number); a dotted name reads a key of a
    column (`reward_model.ground_truth` in verl's datasets)."""
    answer_tag: bool = True
    """Look inside the last <answer>...</answer> of the completion first, if there is one."""


class ExactMatchFunction(_FunctionBase):
    """String match against a reference column: 1.0 when equal, else 0.0."""

    type: Literal["exact_match"]
    field: str = "answer"
    """Extra column holding the reference string (dotted: a key of a column, e.g. `reward_model.ground_truth`)."""
    normalize: bool = True
    """Compare after case folding, collapsing whitespace and dropping surrounding punctuation, `$` and `\\boxed{}`."""
    extract: Literal["full", "answer_tag", "last_line"] = "full"
    """Which part of the completion to compare: all of it, the last <answer>...</answer>, or its last non-empty line."""


class RegexFormatFunction(_FunctionBase):
    """Format check by regular expression (Python `re`, DOTALL): 1.0 when the completion matches, else 0.0."""

    type: Literal["regex_format"]
    pattern: str = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
    """The regular expression."""
    mode: Literal["fullmatch", "search"] = "fullmatch"
    """fullmatch: the whole completion must match; search: it must occur somewhere."""

    @model_validator(mode="after")
    def _compiles(self) -> RegexFormatFunction:
        import re

        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {e}") from None
        return self


class LengthFunction(_FunctionBase):
    """Length bounds: 1.0 inside [min_length, max_length] (bounds) or a linear penalty outside it (penalty)."""

    type: Literal["length"]
    unit: Literal["chars", "words"] = "chars"
    """What the length counts: characters, or whitespace-separated words."""
    min_length: int = Field(default=0, ge=0)
    """Shortest length without penalty."""
    max_length: int = Field(default=1000, ge=1)
    """Longest length without penalty."""
    mode: Literal["bounds", "penalty"] = "bounds"
    """bounds: 1.0 inside, 0.0 outside. penalty: 0.0 inside, -penalty_per_unit x distance to the range outside."""
    penalty_per_unit: float = Field(default=0.001, ge=0)
    """Penalty per character (or word) outside the range, in penalty mode."""

    @model_validator(mode="after")
    def _ordered(self) -> LengthFunction:
        if self.min_length > self.max_length:
            raise ValueError(f"min_length={self.min_length} is above max_length={self.max_length}")
        return self


class LengthAndReferenceFunction(_FunctionBase):
    """+0.5 when the completion has 10 to 200 characters, plus +0.5 when the reference answer appears in it
    (a substring test, so 0, 0.5 or 1). The type name `seed_rule` is accepted for it, with a FutureWarning."""

    type: Literal["length_and_reference"]
    field: str = "answer"
    """Extra column holding the reference answer."""


MODULE_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$"
"""`package.module` or `package.module:function`: an import path, never a file path."""


class FileFunction(_FunctionBase):
    """A user function from a Python file or an importable module (plain or async def), called the way TRL calls it
    (`fn(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns)`) or the way verl
    calls a `custom_reward_function` (`compute_score(data_source, solution_str, ground_truth, extra_info)`, once per
    completion). `type: python` is verl's spelling of the same entry: `name` there names the function."""

    type: Literal["file"]
    path: str | None = Field(default=None, min_length=1)
    """Python file defining the function (relative paths are resolved against the working directory). A file inside
    a package (folders with __init__.py) is imported as part of it, so its relative imports work."""
    module: str | None = Field(default=None, pattern=MODULE_PATTERN, max_length=256)
    """Instead of `path`: an importable module, `package.module` or `package.module:function` (e.g.
    `trl.rewards:think_format_reward`); it must be allowed by rewarder.allowed_modules."""
    function: str = Field(default="reward_func", min_length=1)
    """Name of the function in that file or module."""
    convention: Literal["auto", "trl", "verl"] = "auto"
    """How it is called: trl (one call per group, TRL's keywords), verl (one call per completion with verl's
    arguments), or auto: verl when the function has a `solution_str` parameter, else trl."""
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for every call (verl's custom_reward_function.reward_kwargs)."""

    @model_validator(mode="after")
    def _one_source(self) -> FileFunction:
        if (self.path is None) == (self.module is None):
            raise ValueError("give exactly one of `path` (a Python file) and `module` (an import path)")
        if self.module and ":" in self.module:
            module, function = self.module.split(":")
            if "function" in self.model_fields_set and self.function != function:
                raise ValueError(f"module {self.module!r} names function {function!r} but `function` is "
                                 f"{self.function!r}")
            self.module, self.function = module, function
        return self

    @property
    def source(self) -> str:
        """`/abs/file.py:function` or `module:function` (Info's source, logs)."""
        if self.module:
            return f"{self.module}:{self.function}"
        from pathlib import Path

        return f"{Path(self.path).expanduser().resolve()}:{self.function}"


class ModelFunction(_FunctionBase):
    """A reward model: a local Hugging Face AutoModelForSequenceClassification folder scoring prompt + completion."""

    type: Literal["model"]
    path: str = Field(min_length=1)
    """Local folder with config.json, weights and tokenizer."""
    max_length: int = Field(default=2048, ge=8)
    """Tokens per scored sequence; longer ones are truncated (see truncation_side)."""
    truncation_side: Literal["left", "right"] = "left"
    """left drops the start of the prompt and keeps the completion's end, which is what the score is about."""
    max_tokens_per_batch: int = Field(default=16384, ge=8)
    """Token budget per forward pass (padded length x rows), like verl's forward_max_token_len_per_gpu."""
    label_index: int = Field(default=0, ge=0)
    """Which logit is the reward (0 for the usual single-output reward model)."""
    device: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    """Where the model runs: auto picks an NPU, else a CUDA GPU, else the CPU (dgrpo.common.devices)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight dtype; auto keeps float32 on the CPU and uses bfloat16 on accelerators."""


RENAMED_TYPES = {"seed_rule": "length_and_reference"}
"""Deprecated reward function type -> its current name."""


def _from_verl_spelling(f: dict) -> dict:
    """`{type: python, path, name}` (verl's custom_reward_function: `name` is the function, default compute_score)
    -> a `file` entry whose function and breakdown name are `name`; with `function` also given, `name` is the label."""
    f = {k: v for k, v in f.items() if k != "type"}
    if "function" not in f:
        f["function"] = f.get("name") or "compute_score"
    return {"type": "file", **f}

RewardFunctionConfig = Annotated[
    MathVerifyFunction | ExactMatchFunction | RegexFormatFunction | LengthFunction | LengthAndReferenceFunction
    | FileFunction | ModelFunction,
    Field(discriminator="type"),
]


class RewardSpec(StrictConfig):
    """A reward specification: the reward of a completion is the weighted sum of these functions."""

    name: str = Field(default="default", min_length=1, max_length=128)
    """Name reported with every score (with a version and a content hash), e.g. "math-v2"."""
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [MathVerifyFunction(type="math_verify")], min_length=1
    )
    """Reward functions; each entry has a `type`: math_verify, exact_match, regex_format, length,
    length_and_reference, file (or python: verl's spelling) or model, plus name / weight / timeout_s and the type's
    options (docs/rewarder.md)."""

    @field_validator("functions", mode="before")
    @classmethod
    def _renamed_types(cls, functions: object) -> object:
        """Old type names still load, with a warning; an unnamed entry keeps its old breakdown key (its old type)."""
        if not isinstance(functions, list):
            return functions  # the field's own validation reports it
        out = []
        for f in functions:
            old = f.get("type") if isinstance(f, dict) else None
            if old == "python":
                f = _from_verl_spelling(f)
            elif old in RENAMED_TYPES:
                new = RENAMED_TYPES[old]
                # FutureWarning, not DeprecationWarning: Python hides the latter outside __main__, and the user
                # who wrote the spec is the one to tell.
                warnings.warn(f"reward function type {old!r} is deprecated; use {new!r} (same reward)", FutureWarning)
                f = {"name": old, **f, "type": new}
            out.append(f)
        return out

    @model_validator(mode="after")
    def _unique_names(self) -> RewardSpec:
        seen: set[str] = set()
        for f in self.functions:
            name = function_name(f)
            if name in seen:
                raise ValueError(f"two reward functions are named {name!r}; give one a distinct `name`")
            seen.add(name)
        return self


def function_name(f: _FunctionBase) -> str:
    """The name a function goes by in breakdowns: its `name`, else its file function name, type or "reward_model"."""
    if f.name:
        return f.name
    if isinstance(f, FileFunction):
        return f.function
    if isinstance(f, ModelFunction):
        return "reward_model"
    return f.type  # type: ignore[attr-defined]


class RewarderConfig(StrictConfig):
    """The reward service."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds. Loopback by default: only this host can call it; `0.0.0.0` (all interfaces, e.g.
    inside a container) together with a token (`auth.token_file` or DGRPO_TOKEN; docs/security.md)."""
    port: int = Field(default=50052, ge=0, le=65535)
    """gRPC port (0: any free port)."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the Prometheus `/metrics` endpoint (unset: none; 0: any free port, logged; docs/rewarder.md)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds. Loopback by default; `0.0.0.0` for a Prometheus in another container or
    host (it serves counts and timings, no prompts, and takes no token)."""
    spec: RewardSpec = Field(default_factory=RewardSpec)
    """The reward specification used at start (unless spec_file is set)."""
    spec_file: str | None = None
    """YAML/JSON file holding the reward specification; when set it replaces `spec`, and Reload without text and
    SIGHUP re-read it (edit the file, send SIGHUP)."""
    allowed_dirs: list[Annotated[str, Field(min_length=1)]] | None = None
    """Folders every reward file (`type: file`) and reward model (`type: model`) must lie in, after resolving
    symlinks and `..`, for every spec: at start, on SIGHUP and on Reload (a client may not pick files elsewhere).
    Unset: the folder of spec_file, or for an inline spec the folders of the files and models it names itself
    (none when it names none: then a Reload may use built-ins only). []: built-ins only."""
    allowed_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")]] | None = None
    """Modules whose functions a spec may name by import path (`module:`), for every spec: at start, on SIGHUP and
    on Reload; a name allows its submodules (`trl` allows `trl.rewards`). Importing a module runs its code, and
    a function such as `os:system` is a shell, so a client may not pick them. Unset: the modules the spec at start
    names itself (spec_file or the inline spec). []: none."""
    workers: int = Field(default=2, ge=1, le=256)
    """Worker processes running the reward functions (user code never runs in the server process)."""
    call_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """Default seconds one function call may take before its worker is killed and replaced."""
    load_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a worker may take to load the specification (import user files, load models)."""
    on_error: Literal["error", "zero", "fail_request"] = "error"
    """When a function fails on a completion: error = that completion gets status ERROR (the others are scored);
    zero = the function counts 0 and the completion stays OK (the message says why); fail_request = the whole
    Score call fails with FAILED_PRECONDITION."""
    max_completions_per_request: int = Field(default=65536, ge=1)
    """Larger requests are rejected with INVALID_ARGUMENT."""
    max_request_chars: int = Field(default=64 * 1024 * 1024, ge=1)
    """Total characters of prompts and completions per request; larger requests are rejected with INVALID_ARGUMENT."""
    grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, seconds running requests get to finish before they are cancelled."""
