"""Configuration of the training side of the learner: the actor, its optimizer, the GRPO algorithm (with DAPO's
`overlong_buffer` and `filter_groups`, which learner/rollout/dapo.py applies), checkpoints.

Kept apart from learner/update/actor.py and learner/update/grpo.py on purpose: the CLI validates the whole config before
it imports torch (`--help` and config errors answer in about a second), so this module imports only pydantic.
`dgrpo.learner.config.LearnerConfig` assembles these sections as `actor`, `optim`, `algorithm`, `checkpoint`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dgrpo.common import devices
from dgrpo.common.config import StrictConfig

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# TRL's GRPOConfig.loss_type names accepted for loss_agg (docs/peers.md states what differs).
TRL_LOSS_TYPES = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
AdvantageScale = Literal["group", "batch", "none"]
OffPolicy = Literal["none", "tis", "mask"]
DEFAULT_TIS_CAP = 2.0
"""tis_cap of off_policy=tis when none is set (Yao et al. 2025's choice, verl's rollout_is_threshold default)."""


@dataclass(frozen=True)
class TruncatedIS:
    """off_policy=tis: each token's policy-gradient term x min(r, cap) (TIS, Yao et al. 2025)."""

    cap: float
    type: Literal["tis"] = "tis"


@dataclass(frozen=True)
class MaskedIS:
    """off_policy=mask: tokens (level token) or whole sequences (level sequence) whose r leaves `band` are dropped
    from the loss; the kept tokens x min(r, cap) when `cap` is set (IcePop; verl's rollout_rs)."""

    band: tuple[float, float]
    level: Literal["token", "sequence"]
    cap: float | None = None
    type: Literal["mask"] = "mask"


OffPolicyCorrection = TruncatedIS | MaskedIS | None
"""The off-policy correction as one typed variant (None: off), built from the config's keys by
`AlgorithmConfig.correction`: the loss code takes this, never the separate keys."""


class OverlongBufferConfig(StrictConfig):
    """DAPO's overlong reward shaping (verl: `reward_model.overlong_buffer`, or
    `reward_model.reward_kwargs.overlong_buffer_cfg` with `reward_manager=dapo`)."""

    enable: bool = False
    """Add the length penalty to every scored completion's reward."""
    len: int = Field(default=0, ge=0)
    """Tokens of the buffer before the maximum length: a completion of L tokens gets
    min(-(L - (max - len)) / len x penalty_factor, 0)."""
    penalty_factor: float = Field(default=1.0, ge=0)
    """The penalty at the maximum length (DAPO: 1.0)."""
    max_response_length: int | None = Field(default=None, ge=1)
    """The maximum the buffer ends at (verl's `max_resp_len`). Unset: learner.rollout.max_response_length."""

    @model_validator(mode="after")
    def _check(self) -> OverlongBufferConfig:
        if self.enable and self.len <= 0:
            raise ValueError("overlong_buffer.len must be positive when overlong_buffer.enable is true (verl asserts "
                             "the same); to turn the penalty off set enable: false")
        if self.max_response_length is not None and self.len > self.max_response_length:
            raise ValueError(f"overlong_buffer.len={self.len} exceeds overlong_buffer.max_response_length="
                             f"{self.max_response_length}")
        return self


class FilterGroupsConfig(StrictConfig):
    """DAPO's dynamic sampling (verl: `algorithm.filter_groups`)."""

    enable: bool = False
    """Drop groups whose `metric` is the same for every completion, and sample other prompts in their place until
    the step has learner.data.train_batch_size informative groups."""
    metric: str = "acc"
    """What must differ within a group. `acc`: a breakdown value named `acc` (a verl compute_score returning
    {"score", "acc", ...}), else a built-in 0/1 check (math_verify, exact_match), else the score. `score`: the
    rewarder's reward before the overlong penalty. `reward` (verl's `seq_reward` / `seq_final_reward`): the final
    reward. Any other name: the reward breakdown entry of that name (or ending in `/name`)."""
    max_num_gen_batches: int = Field(default=0, ge=0)
    """Cap: at most this many generation batches (of gen_batch_size prompts) sampled for one step; reaching it with
    too few informative groups stops training with an error, as in verl (0: no cap)."""
    gen_batch_size: int | None = Field(default=None, ge=1)
    """Prompts per generation batch, the unit of the cap (verl's `data.gen_batch_size`). Unset:
    learner.data.train_batch_size. Sampling itself asks only for the prompts still missing."""


class AlgorithmConfig(StrictConfig):
    """The GRPO objective: advantages, clipped surrogate, KL to the reference, off-policy corrections."""

    adv_scale: AdvantageScale = "group"
    """Advantage normalisation. group: (r - group mean) / (group std + eps) (DeepSeekMath GRPO); batch: the
    group mean, divided by the std of the whole batch; none: r - group mean (Dr. GRPO, no std division)."""
    adv_eps: float = Field(default=1e-6, gt=0)
    """Added to the std before dividing, so a group whose rewards are all equal gets advantage 0, not NaN."""
    beta: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL-to-reference term in the loss (TRL's beta). 0 skips the frozen reference model
    entirely (no memory, no forward), as DAPO and Dr. GRPO do; TRL's former default was 0.04."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip below: the ratio is clipped at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0)
    """PPO clip above: the ratio is clipped at 1 + clip_high. DAPO's clip-higher uses 0.28 (> clip_low) to
    keep exploring low-probability tokens."""
    clip_ratio_c: float | None = Field(default=None, gt=1)
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): for tokens with a negative advantage the loss is
    bounded by -A * clip_ratio_c, so a ratio far above 1 cannot blow the loss up. Null: off (plain PPO clip, as
    TRL). verl applies it by default with 3.0; `dgrpo import-config --from verl` writes that default."""
    kl_cap: float | None = Field(default=None, gt=0)
    """Cap of the per-token KL value (k3) before it enters the loss; a capped token passes no KL gradient.
    verl's low_var_kl clamps at 10; null: no cap (TRL)."""
    loss_agg: LossAgg = "token-mean"
    """How token losses become one number (verl's loss_agg_mode). token-mean: sum over every completion token
    of the mini-batch / their count (DAPO); seq-mean-token-mean: mean per sequence, then over sequences
    (original GRPO); seq-mean-token-sum: sum per sequence, then mean over sequences; seq-mean-token-sum-norm:
    sum per sequence / loss_scale_factor, then mean (Dr. GRPO). TRL's loss_type names are accepted for the
    matching mode: dapo and bnpo -> token-mean, grpo -> seq-mean-token-mean, dr_grpo -> seq-mean-token-sum-norm
    (docs/peers.md)."""
    loss_scale_factor: int | None = Field(default=None, ge=1)
    """The constant seq-mean-token-sum-norm divides each sequence's sum by (verl's loss_scale_factor, TRL's
    max_completion_length). Null: rollout.max_response_length."""
    old_logprobs: Literal["sampler", "recompute"] = "recompute"
    """The behaviour policy of the PPO ratio. recompute: the learner's own logprobs before the update (one
    extra no-grad forward when a step has more than one optimizer update; skipped when it has one, since the
    ratio is then exactly 1 at the first update); sampler: the sampler's logprobs as sent with each token."""
    off_policy: OffPolicy = "none"
    """Correction for tokens drawn by another policy than the learner's: the sampler's numerics, or older weights
    (asynchronous GRPO). The sampler's logprobs are the behaviour policy, the learner's own logprobs at the start
    of the step the proximal policy the PPO clip is anchored to (AReaL's decoupled PPO, Fu et al. 2025); r =
    exp(proximal - behaviour) per token. none: no correction. tis: each token's policy-gradient term is weighted by
    min(r, tis_cap) (TIS, Yao et al. 2025; verl's rollout_is: token). mask: tokens (off_policy_level: token) or
    whole sequences (sequence) whose r leaves off_policy_band are dropped from the loss, staying in its denominator
    (IcePop; verl's rollout_rs; "MIS"); the kept tokens are also weighted by min(r, tis_cap) when tis_cap is set.
    tis and mask need old_logprobs=recompute and the sampler's logprobs. Unset with tis_cap set: tis (the
    shorthand configs/cpu-demo.yaml uses). docs/peers.md maps each to verl and AReaL."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Truncation of the importance weight min(exp(old_logp - sampler_logp), tis_cap) (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; verl's rollout_is_threshold, and
    tis_imp_ratio_cap in verl's older configs, which import-config reads too). Used by off_policy tis (null there:
    2.0, the note's choice) and mask (null there: kept tokens are not weighted). Setting it alone means
    off_policy=tis."""
    off_policy_band: tuple[float, float] = (0.5, 2.0)
    """[low, high] of the ratio r that off_policy=mask keeps (edges included; low 0: no lower bound). verl's
    rollout_rs_threshold "low_high"; AReaL's behav_imp_weight_cap c is [0, c]."""
    off_policy_level: Literal["token", "sequence"] = "token"
    """What off_policy=mask decides on. token: each token's own r; sequence: the geometric mean of the sequence's
    token ratios, exp(mean log r), keeps or drops all its tokens (verl's Geo-RS, rollout_rs seq_mean_k1)."""
    mask_truncated: bool = False
    """Drop completions that hit max_tokens (finish_reason length) from the loss (DAPO's overlong filtering):
    a cut-off answer is neither right nor wrong."""
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): train only on groups whose rewards differ, sampling
    other prompts in place of the rest (learner/rollout/dapo.py)."""
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (verl's reward_model.overlong_buffer): a linear penalty over the last `len`
    tokens before the maximum response length (learner/rollout/dapo.py)."""

    @field_validator("loss_agg", mode="before")
    @classmethod
    def _trl_loss_type(cls, value: object) -> object:
        """TRL's loss_type names become the matching mode (shown resolved by show-config)."""
        if isinstance(value, str) and value in TRL_LOSS_TYPES:
            return TRL_LOSS_TYPES[value]
        if isinstance(value, str) and value not in typing.get_args(LossAgg):
            raise ValueError(
                f"loss_agg {value!r} is not one of {', '.join(typing.get_args(LossAgg))} (verl's loss_agg_mode) "
                f"or TRL's loss_type {', '.join(TRL_LOSS_TYPES)}"
            )
        return value

    @property
    def correction(self) -> OffPolicyCorrection:
        """off_policy with the keys that belong to it (tis_cap, off_policy_band, off_policy_level), as one variant.
        The YAML keeps the flat keys users write (docs/actor.md); the config checks below keep them consistent."""
        if self.off_policy == "tis":
            return TruncatedIS(self.tis_cap)
        if self.off_policy == "mask":
            return MaskedIS(self.off_policy_band, self.off_policy_level, self.tis_cap)
        return None

    @model_validator(mode="before")
    @classmethod
    def _resolve_off_policy(cls, data: object) -> object:
        """tis_cap alone means truncated IS (a shorthand the demo configs use); tis without a cap gets 2.0.
        Resolved here so show-config prints what runs."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("off_policy") is None and data.get("tis_cap") is not None:
            data["off_policy"] = "tis"
        if data.get("off_policy") == "tis" and data.get("tis_cap") is None:
            data["tis_cap"] = DEFAULT_TIS_CAP
        return data

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        if self.off_policy == "none" and self.tis_cap is not None:
            raise ValueError(
                f"tis_cap={self.tis_cap} is set but off_policy='none' turns importance weighting off: drop tis_cap, "
                "or set off_policy to 'tis' (or 'mask')"
            )
        if self.off_policy != "none" and self.old_logprobs != "recompute":
            raise ValueError(
                f"off_policy={self.off_policy!r} (or tis_cap) needs old_logprobs='recompute': the proximal policy is "
                "the learner's own logprobs (with old_logprobs='sampler' the PPO ratio is already taken against the "
                "sampler)"
            )
        if self.off_policy_level == "sequence" and self.off_policy != "mask":
            raise ValueError(
                f"off_policy_level='sequence' applies to off_policy='mask', not {self.off_policy!r} (tis weighs each "
                "token)"
            )
        low, high = self.off_policy_band
        if not (0 <= low <= 1 <= high and low < high):
            raise ValueError(
                f"off_policy_band=[{low}, {high}] must satisfy 0 <= low <= 1 <= high, low < high (a band without 1 "
                "would drop on-policy tokens)"
            )
        return self


class OptimConfig(StrictConfig):
    """AdamW with warmup and a schedule. The schedule advances once per training step (verl's convention)."""

    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1, beta2 (the seeds use 0.9, 0.99)."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW decoupled weight decay (applied to every parameter)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Training steps of linear warmup from 0 to lr."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warmup: keep lr, or decay it (cosine / linear) to min_lr_ratio * lr at the last training step."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the decaying schedules, as a fraction of lr."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value before each optimizer update; null: no clipping (the
    norm is still measured and logged)."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        for i, b in enumerate(self.betas):
            if not 0 <= b < 1:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1)")
        return self


class ActorConfig(StrictConfig):
    """The policy being trained: batching of the update, precision, memory savers, data parallelism."""

    ppo_mini_batch_size: int = Field(default=8, ge=1)
    """Prompts (groups) per optimizer update, over all data-parallel ranks; data.train_batch_size must be a
    multiple of it. Equal to it: one update per step (on-policy)."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each step's rollouts."""
    micro_batch_size_per_device: int = Field(default=4, ge=1)
    """Sequences per forward/backward on one device; gradients are accumulated over the micro-batches of a
    mini-batch. Ignored when use_dynamic_bsz is on."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by a token budget (max_tokens_per_micro_batch) instead of a sequence count, with
    the padding removed: sequences are concatenated into one row and attend only within themselves."""
    share_prompts: bool = True
    """With use_dynamic_bsz: a group's completions follow one copy of their prompt in the packed row, each
    attending to the prompt and itself, so the prompt is computed once per group instead of once per completion
    (same logits and gradients). Attention runs as one sdpa call per group block with that block's own mask
    (learner/update/attention.py): ~block^2 work instead of budget^2, and no [budget, budget] mask."""
    skip_zero_advantage: bool = True
    """Leave out of the forwards and backwards the sequences whose gradient is exactly zero: those with advantage 0
    when algorithm.beta is 0 (a group whose completions all scored the same; PPO-clip's -A x ratio is 0 at every
    token) and those with no loss token. The loss denominator still counts them, so the update is identical; the
    per-token metrics (entropy, sampler_logp_diff, ...) are then over the sequences computed. actor/skipped_frac
    says how many were left out: the share grows as the policy solves more prompts."""
    max_tokens_per_micro_batch: int = Field(default=4096, ge=16)
    """Token budget of one packed micro-batch per device (prompt + completion tokens), with use_dynamic_bsz.
    A single longer sequence still gets a micro-batch of its own."""
    logprob_max_tokens_per_micro_batch: int | None = Field(default=None, ge=16)
    """Token budget of the packed no-grad forwards (reference and old-policy logprobs), which keep no
    activations for backward and can take more. Null: 2x max_tokens_per_micro_batch. (Padded no-grad
    forwards take 2x micro_batch_size_per_device sequences.)"""
    dtype: Literal["auto", "bfloat16", "float32"] = "bfloat16"
    """Compute dtype of forwards and backwards (master weights and optimizer states stay fp32). bfloat16 runs on
    every device, and is faster where it computes bf16 natively; float32 computes in fp32. auto: bfloat16 on NPUs,
    CUDA GPUs with bf16 and CPUs with AMX-BF16 or AVX512-BF16 instructions, float32 on other CPUs (where bf16 matmuls
    are emulated: 2.7x slower; common/devices.py computes_bf16). The learner logs what auto chose."""
    bf16_weights: Literal["autocast", "published"] = "autocast"
    """Where bfloat16 compute gets its bf16 weights. autocast: each op casts the fp32 master to nearest bf16
    (torch.autocast), in every forward and backward. published: once per optimizer update the masters are rounded
    stochastically into a bf16 copy of the model (as weights.rounding=stochastic publishes them); forwards and
    backwards run on the copy, its gradients accumulate in fp32 on the masters, and the next publish sends the
    copy's bits, so the learner computes with exactly the weights the samplers run (learner/update/compute_copy.py).
    Needs model.dtype bfloat16. Full fine-tuning on one device: with learner.lora (whose frozen base is stored in
    bf16 already) or under torchrun the learner computes under autocast."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward: less memory, about 30% more compute."""
    compute_entropy: bool = True
    """Log the mean token entropy of the policy (one extra pass over the logits per micro-batch, no grad)."""
    balance_batch: bool = True
    """With several data-parallel ranks, deal sequences so each rank gets about the same number of tokens
    (verl's balance_batch) instead of contiguous slices."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (ZeRO-3, least memory) or keep them until backward
    (ZeRO-2, less communication)."""

    def on_device(self, device: str) -> ActorConfig:
        """This config with dtype `auto` decided for the device the learner computes on (auto: this host's)."""
        if self.dtype != "auto":
            return self
        return self.model_copy(update={"dtype": devices.auto_dtype(device)})


class CheckpointConfig(StrictConfig):
    """Checkpoints for resuming, and the export to a Hugging Face folder for deployment."""

    dir: str = "checkpoints"
    """Folder holding step_<N>/ checkpoints (created if missing)."""
    save_freq: int = Field(default=0, ge=0)
    """Save every this many training steps (and at the last step); 0 saves only at the end."""
    contents: list[Literal["model", "optimizer", "extra"]] = Field(
        default_factory=lambda: ["model", "optimizer", "extra"]
    )
    """What a checkpoint holds. model: the policy weights; optimizer: AdamW state and the lr scheduler;
    extra: RNG states, the step and the data position (what resuming exactly needs)."""
    keep_last: int | None = Field(default=2, ge=1)
    """Keep only the newest this many checkpoints; null keeps all."""
    resume: Literal["auto", "never"] | str = "auto"
    """auto: continue from the newest complete checkpoint in dir if there is one; never: start fresh; or the
    path of a step_<N> folder to resume from."""
    export_dir: str | None = None
    """At the end of training, write the policy as a Hugging Face folder here (config, tokenizer, chat
    template, safetensors in model.dtype) that transformers and `vllm serve` load. Null: no export."""
