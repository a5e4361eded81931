"""Learner configuration: the sections of `learner:` assembled, and the checks that span them.

The sections live in schema-only modules, never in the code that uses them: data, rollout and trainer here,
actor, optim, algorithm and checkpoint in actor_config.py. The config must validate before torch or grpc is imported
(`dgrpo learner --help` and config errors answer in about a second), while rollout.py imports grpc and loop.py
torch; tests/test_layout.py checks it. Checks that need the sampler section as well (prompt + response must fit the
sampler's context) are in cli/stack.py's `StackConfig.check_whole_stack`.

`LearnerRunConfig` is what one learner process is handed: its own section and the shared ones it reads, cut from the
stack config by `dgrpo` (cli/), which the learner cannot import (services depend on common code only).
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from dgrpo.common.auth_config import AuthConfig
from dgrpo.common.config import StrictConfig
from dgrpo.common.model_config import ModelConfig
from dgrpo.common.tracing_config import TracingConfig
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, CheckpointConfig, OptimConfig
from dgrpo.tools.config import MultiTurnConfig
from dgrpo.weights.config import LoraConfig, WeightSyncConfig

Logger = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


class DataConfig(StrictConfig):
    """Training and validation prompts."""

    train_files: list[str] = Field(default_factory=list)
    """Training data: local .parquet or .jsonl files (one format per list), read with `datasets`."""
    val_files: list[str] = Field(default_factory=list)
    """Validation data, same format; scored greedily every `trainer.test_freq` steps (empty: no validation)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or chat messages (a list of {role, content}). With the default, a file
    without a `prompt` column but with `messages` (a conversation) uses that, minus its trailing assistant turns."""
    apply_chat_template: bool = True
    """Render string prompts as one user turn with the model's chat template (chat messages always are)."""
    max_prompt_length: int = Field(default=512, ge=1)
    """Longest prompt in tokens, after the chat template."""
    overlong_prompts: Literal["drop", "truncate"] = "drop"
    """What happens to longer prompts: drop the row, or keep its last `max_prompt_length` tokens (the end holds
    the question and the generation prompt). Either way the count is logged and reported in the metrics."""
    train_batch_size: int = Field(default=8, ge=1)
    """Prompts per training step (each sampled `rollout.n` times)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (a new permutation per epoch, seeded)."""
    seed: int = 0
    """Seed of the shuffle: the same seed gives the same order, epoch by epoch, across runs and resumes."""
    max_train_samples: int | None = Field(default=None, ge=1)
    """Use only the first N training rows (unset: all)."""
    max_val_samples: int | None = Field(default=None, ge=1)
    """Use only the first N validation rows (unset: all)."""


class RolloutConfig(StrictConfig):
    """Sampling: group size, sampling parameters, and how the learner talks to the replicas and the rewarder."""

    n: int = Field(default=4, ge=2)
    """Group size: completions sampled per prompt. GRPO's advantage compares them, so at least 2."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (> 0: GRPO needs diverse groups; validation is always greedy)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass (1: off)."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens (0: off)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Drop tokens below min_p times the top probability (0: off)."""
    max_response_length: int = Field(default=256, ge=1)
    """New tokens per completion."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the model's EOS always stops)."""
    seed: int | None = None
    """Base seed of the sampler requests (the step number is added, so steps differ). Unset: unseeded."""
    prompts_per_request: int | None = Field(default=None, ge=1)
    """Prompts per Generate call. Unset: the step's batch split evenly over the replicas (one call each, so every
    engine batches its whole share)."""
    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Bound on one Generate call; a call past it is retried elsewhere."""
    weight_wait_timeout_s: float = Field(default=0.0, ge=0)
    """How long a replica may wait to load `min_weight_version` before the call is retried elsewhere
    (0: the replica's `sampler.weight_wait_timeout_s`)."""
    retry_backoff_s: float = Field(default=0.5, gt=0)
    """First wait before a replica that failed is probed again; doubles per failure up to `max_backoff_s`."""
    max_backoff_s: float = Field(default=10.0, gt=0)
    """Longest wait between probes of one replica."""
    keepalive_s: float = Field(default=10.0, gt=0)
    """HTTP/2 keepalive ping interval on the sampler and rewarder channels. A peer that does not answer a ping
    within `keepalive_timeout_s` (a frozen process, a host whose packets are dropped) has its connection closed and
    its calls fail, instead of hanging until `request_timeout_s`."""
    keepalive_timeout_s: float = Field(default=5.0, gt=0)
    """How long a keepalive ping may go unanswered."""
    progress_timeout_s: float = Field(default=60.0, gt=0)
    """A replica that holds prompts and has neither delivered a group nor advanced its engine (Info's
    engine_steps, checked every half of this) for this long, or has not answered two such checks, is declared
    stuck: its call is cancelled and its prompts go to the other replicas. Replicas generating long completions
    keep stepping, so they are not."""
    probe_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on one Info probe: of a quiet call's replica, and of an unhealthy replica before it gets prompts
    again (it must answer with the weight version asked for)."""
    hedge_after_s: float | None = Field(default=2.0, gt=0)
    """Hedged requests ("The Tail at Scale", Dean & Barroso 2013): a replica left with nothing to do while another
    still holds prompts of the step duplicates those prompts once it has waited this long and at least
    `hedge_after_share` of the batch's sampling time so far; the first complete group wins, the late one is dropped
    (rollout/duplicates_dropped) and a call whose prompts are all done elsewhere is cancelled. A straggler then no
    longer sets every step's pace. null: never hedge."""
    hedge_after_share: float = Field(default=0.25, ge=0)
    """The idle wait before a hedge, as a share of the time the batch has been sampling: replicas of equal speed
    finish their chunks within a fraction of each other, so only one at least this much slower than the idle
    replica is hedged, at every batch length (seconds on a small model, minutes on a large one). 0: `hedge_after_s`
    alone."""
    straggler_speed: float | None = Field(default=0.5, gt=0, lt=1)
    """A replica holding prompts whose engine steps slower than this share of the fastest replica's, over a trailing
    window of at least two checks that holds enough of the fastest one's steps (7 at 0.5; more the closer this is
    to 1, so that engine steps longer than a check never make equal replicas read slow), is a straggler: its pending
    prompts are hedged at once on the fastest healthy replica, busy or not (its engine batches them with its own
    work), instead of after that replica has finished its chunk and waited `hedge_after_s`. An idle replica does not
    duplicate the prompts of one found keeping pace: that copy would start from the first token behind an original
    already generating at about its speed (learner/rollout/stragglers.py). null: hedge from idle replicas only,
    whatever their speed. Off with `hedge_after_s: null`."""
    straggler_check_s: float = Field(default=0.25, gt=0)
    """How often the engine step counters (Info's engine_steps) of the replicas holding prompts are read; a verdict
    needs readings spanning two checks (one for a straggler of the previous batch) and the fastest one's steps."""
    max_staleness: int = Field(default=0, ge=0, le=16)
    """Asynchronous GRPO (learner/rollout/pipeline.py): how many versions behind the policy being updated a sample may
    be. 0: lockstep, on-policy (sample, then train, then publish). k >= 1: batches t+1 ... t+k are sampled and
    scored while batch t trains, so the samplers never wait for the update; a group sampled by weights older than
    (current version - k) is never trained on. Pair it with weights.pause_mode=keep (updates land between engine
    steps without draining the requests in flight) and the algorithm.off_policy correction (docs/learner.md)."""
    step_timeout_s: float = Field(default=3600.0, gt=0)
    """Give up (and stop training with an error) when a step's groups are not all in after this long."""
    rewarder_address: str = "localhost:50052"
    """The reward service: host:port (or any gRPC target, e.g. dns:///rewarder:50052)."""
    reward_timeout_s: float = Field(default=600.0, gt=0)
    """Bound on scoring one group, waits for a restarting rewarder included."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls (verl's rollout.multi_turn; docs/multi_turn.md). The samplers read this
    same section of their stack config to load the tools; the learner sends the limits and the tool set's digest."""


class TrainerConfig(StrictConfig):
    """How long to train, validation, logging, and the learner's control service."""

    total_epochs: int = Field(default=1, ge=1)
    """Passes over the training prompts (used when total_training_steps is unset)."""
    total_training_steps: int | None = Field(default=None, ge=1)
    """Training steps to run; overrides total_epochs (verl's convention)."""
    test_freq: int = Field(default=0, ge=0)
    """Validate on data.val_files every this many steps, and after the last step (0: never)."""
    val_before_train: bool = False
    """Also validate once before the first step (the baseline to compare against)."""
    seed: int = 0
    """Seed of the learner's torch RNG (model init is from the checkpoint; this covers dropout and the like)."""
    run_name: str = Field(default="dgrpo", pattern=r"^[A-Za-z0-9_.]{1,64}$")
    """Name of the run (1-64 of A-Z a-z 0-9 _ .): the metrics folder under log_dir, and the weight-sync run id
    (it names the shared-memory segments)."""
    log_dir: str = "runs"
    """Metrics go to <log_dir>/<run_name>/: metrics.jsonl and TensorBoard event files."""
    loggers: list[Logger] = Field(default_factory=lambda: ["console", "jsonl"])
    """Where metrics go (verl's `trainer.logger`). console: one progress line per step; jsonl: every metric, one line
    per step (both need nothing beyond the default install). tensorboard: event files (`pip install
    'dgrpo[tensorboard]'`); wandb: Weights & Biases (`pip install 'dgrpo[wandb]'`, then `wandb login`, or
    WANDB_MODE=offline); mlflow: MLflow tracking (`pip install 'dgrpo[mlflow]'`; the server or folder in
    MLFLOW_TRACKING_URI, else MLflow's default). A logger whose package is missing stops the learner at start,
    naming it (learner/records/metrics.py, LOGGER_PACKAGES)."""
    wandb_project: str = "dgrpo"
    """W&B project, with loggers including wandb (the run is named `run_name`)."""
    mlflow_experiment: str = "dgrpo"
    """MLflow experiment, with loggers including mlflow (the run is named `run_name`)."""
    log_completions: bool = False
    """TRL's `log_completions`: each step, a table of prompts, completions, rewards per function and advantages,
    printed on the console (with `rich`) and logged as a table to wandb (key `completions`) and mlflow (artifact
    `completions/step_<N>.json`) when those loggers are on."""
    num_completions_to_print: int | None = Field(default=None, ge=1)
    """TRL's `num_completions_to_print`: rows of the console table, taken one per prompt before a second of any
    prompt (unset: every completion of the step, as TRL). The wandb and mlflow tables hold every completion."""
    rollout_data_dir: str | None = None
    """verl's `trainer.rollout_data_dir`: write every trained completion of step N to `<dir>/<N>.jsonl`, one record
    each (prompt, completion, reward and breakdown, advantage, status, versions, replica, ...; docs/learner.md,
    "Rollout data"). Unset: nothing is written. Size: about prompt + completion characters + 0.6 kB per record,
    train_batch_size x n records per step."""
    validation_data_dir: str | None = None
    """verl's `trainer.validation_data_dir`: each validation's greedy generations go to `<dir>/<step>.jsonl`,
    records as in rollout_data_dir (advantage null)."""
    log_val_generations: int = Field(default=0, ge=0)
    """verl's `trainer.log_val_generations`: this many validation generations (the first prompts of val_files) go to
    wandb (table `val/generations`) and mlflow (artifact `val/generations/step_<N>.json`) at each validation; 0:
    none."""
    rollout_data_max_chars: int = Field(default=8192, ge=16)
    """Longest prompt, completion or message text a rollout record or completions table keeps (longer ones are cut,
    the number of characters cut noted): bounds a record to about 3 x this + 1 kB."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the learner's Prometheus `/metrics` endpoint (unset: none; 0: any free port, logged): step, phase
    seconds, reward, sampling wait, staleness, publish seconds (`dgrpo_learner_*`, docs/learner.md)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds. Loopback by default; `0.0.0.0` for a Prometheus in another container or
    host (it serves numbers only, and takes no token)."""
    control_host: str = "127.0.0.1"
    """Address the learner control service (Status, Stop; health and reflection) binds. Loopback by default: Stop
    ends the run, so bind `0.0.0.0` only together with a token (`auth.token_file` or DGRPO_TOKEN)."""
    control_port: int | None = Field(default=50053, ge=0, le=65535)
    """Port of the learner control service (0: any free port, logged; null: no control service)."""
    on_end: Literal["exit", "idle"] = "exit"
    """What the learner does once its run has ended (the last step, or the Stop RPC). exit: exit 0 (dgrpo up,
    compose's `restart: on-failure`). idle: record the end in <log_dir>/<run_name>/ended.json and keep the control
    service answering Status (phase done / stopped) until SIGTERM, for supervisors that restart every exit (a
    Kubernetes StatefulSet): a restarted learner that finds the record trains nothing. A run ended by a signal
    writes no record, so its restart resumes from the newest checkpoint. learner/records/run_end.py."""


class LearnerConfig(StrictConfig):
    """The GRPO trainer."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling and scoring: group size, sampling parameters, sampler and rewarder clients."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The policy update: mini/micro-batches, precision, memory savers, data parallelism."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """AdamW, warmup and schedule, gradient clipping."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The GRPO objective: advantages, clipping, KL to the reference, off-policy corrections."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints (save, resume) and the final export."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default; docs/lora.md). The samplers read it too: they serve
    each published adapter with vLLM's LoRA support."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Length of training, validation, logging, control service."""

    @model_validator(mode="after")
    def _check_batches(self) -> LearnerConfig:
        batch, mini = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        if batch % mini:
            raise ValueError(
                f"learner.data.train_batch_size={batch} is not a multiple of learner.actor.ppo_mini_batch_size="
                f"{mini} (prompts per optimizer update)"
            )
        return self


class LearnerRunConfig(StrictConfig):
    """Everything one learner process reads: `learner`, the shared `model` and `weights`, where the samplers are,
    and the whole resolved stack config it records."""

    model: ModelConfig
    """The policy it trains and publishes (path, dtype of the published weights, device)."""
    learner: LearnerConfig
    """The trainer's own section."""
    weights: WeightSyncConfig
    """How published weights reach the samplers."""
    sampler_addresses: list[str]
    """`sampler.addresses`: the replicas the rollout client reaches."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """`auth`: the token its clients send and its control service requires."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """`tracing`: where its step traces go (off by default)."""
    stack: dict[str, Any]
    """The whole resolved stack config (JSON types), written to the run's config.yaml and given to the metrics
    loggers, so a run records every service's settings, not only the learner's."""

    @model_validator(mode="after")
    def _check_published_bf16(self) -> LearnerRunConfig:
        actor = self.learner.actor
        actor = actor.on_device(self.model.device)
        if actor.dtype == "bfloat16" and actor.bf16_weights == "published" and self.model.dtype != "bfloat16":
            raise ValueError(f"learner.actor.bf16_weights=published computes with the bf16 weights it publishes "
                             f"(learner.actor.dtype {self.learner.actor.dtype}): model.dtype is {self.model.dtype}, "
                             f"set it to bfloat16 (or bf16_weights=autocast)")
        return self

    def stack_yaml(self) -> str:
        return yaml.safe_dump(self.stack, sort_keys=False)
