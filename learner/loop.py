"""The GRPO training loop: sample groups -> score -> advantages -> actor update -> publish weights -> log.

`Trainer.setup()` builds the components in dependency order; `Trainer.step()` reads like the algorithm. Each phase
lives in a module of its own: sampling and scoring, then advantages (learner/rollout/groups.py), the update
(learner/update/actor.py), publishing (learner/weight_sync.py), the step's figures (learner/records/metrics.py); this
module keeps
the order of the phases, the run's lifecycle (checkpoints, validation, stopping) and the state they share.

Distributed (torchrun): every rank runs this loop. Rank 0 alone talks to the samplers and the rewarder and
broadcasts each step's scored sequences; every rank then trains on its share (learner/update/actor.py) and joins the
weight gather, which only rank 0 publishes.

Weight versions: 0 is the initial checkpoint the samplers start from; each training step publishes the next version
and the following rollout asks for `min_weight_version` = that version, so sampling is on-policy. A resumed run (or
one meeting replicas that outlived an earlier learner) first publishes its weights as a version above every
replica's (`sync_initial_weights`), so versions count publishes, not steps.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dgrpo.common import tracing
from dgrpo.common.devices import detect_device
from dgrpo.common.models import resolve_model_path
from dgrpo.learner.config import LearnerRunConfig
from dgrpo.learner.records import checkpoint as ckpt
from dgrpo.learner.records import run_end
from dgrpo.learner.records.control import LoopState, start_control_server
from dgrpo.learner.records.metrics import (
    MetricsLogger,
    StepTimer,
    memory_metrics,
    rollout_metrics,
    throughput_metrics,
    validation_metrics,
)
from dgrpo.learner.records.step_reports import StepReports
from dgrpo.learner.rollout.client import RolloutClient, RolloutStats
from dgrpo.learner.rollout.data import LoadStats, PromptRecord, PromptStream, load_prompts
from dgrpo.learner.rollout.groups import GroupCollector, ScoredGroup, to_sequences
from dgrpo.learner.rollout.pipeline import RolloutPipeline, staleness_metrics
from dgrpo.learner.rollout.reward_client import RewardClient
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence
from dgrpo.learner.update.distributed import DistContext, broadcast_object, init_distributed
from dgrpo.learner.weight_sync import WeightSync, let_replicas_finish_loading
from dgrpo.v1 import rewarder_pb2

log = logging.getLogger("dgrpo.learner")


@dataclass
class StepRollout:
    """The batch a step trains on, as sampled and scored, and what its collection reports."""

    scored: list[ScoredGroup]
    stats: RolloutStats
    reward_busy_s: float
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: LearnerRunConfig):
        self.cfg = cfg
        self.learner_cfg = cfg.learner
        self.state = LoopState()  # what Status answers; written by the loop
        self.step_num = 0  # training steps completed
        self.version = 0  # the weight version the samplers are asked for
        # Built by setup(), on every rank:
        self.ctx: DistContext | None = None
        self.tokenizer = None
        self.train_data: PromptStream | None = None
        self.val_records: list[PromptRecord] = []
        self.data_stats: LoadStats | None = None
        self.total_steps = 0
        self.actor: Actor | None = None
        self.weights: WeightSync | None = None
        # Rank 0 only (setup, then the event loop for the gRPC clients):
        self.pipeline: RolloutPipeline | None = None  # with rollout.max_staleness >= 1
        self.out_dir: Path | None = None
        self.metrics: MetricsLogger | None = None
        self.reports: StepReports | None = None
        self.rollout: RolloutClient | None = None
        self.rewarder: RewardClient | None = None
        self.collector: GroupCollector | None = None
        self.control = None  # the Status/Stop server, when learner.trainer.control_port is set
        # Run state:
        self._saved_step = 0  # the last checkpoint's step (a resume starts at it)
        self._data_before_step: dict | None = None  # the data position before the batch in flight (a drop restores)
        self._reward_specs: set[str] = set()  # the reward specs of the last step (a hot swap is logged)

    # ---- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        """The components in dependency order: rank and device, data, the actor, what a resume restores; on rank 0
        the outputs and the weight publisher (the gRPC clients are created on the event loop, in `run`)."""
        torch.manual_seed(self.learner_cfg.trainer.seed)
        # Rank and device first: every later component is placed by them.
        self.ctx = init_distributed(detect_device(self.cfg.model.device))
        model_path = resolve_model_path(self.cfg.model.path)
        self.tokenizer = self._setup_tokenizer(model_path)
        self.train_data, self.val_records, self.data_stats = self._setup_data()
        self.total_steps = (self.learner_cfg.trainer.total_training_steps
                            or self.learner_cfg.trainer.total_epochs * self.train_data.steps_per_epoch)
        self.actor = self._setup_actor(model_path)
        self._resume()
        self.state.total_steps = self.total_steps
        self._show_progress()
        publisher = self._setup_outputs() if self.ctx.is_main else None
        self.weights = WeightSync(self.cfg, self.actor, self.ctx, publisher)

    def _setup_tokenizer(self, model_path: str):
        """The policy's own tokenizer: the chat template is applied once, with it."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=self.cfg.model.trust_remote_code)

    def _setup_data(self) -> tuple[PromptStream, list[PromptRecord], LoadStats]:
        """Data on every rank (cheap), so every rank knows the run's length; only rank 0 draws batches."""
        data = self.learner_cfg.data
        records, stats = load_prompts(data.train_files, data, self.tokenizer, data.max_train_samples)
        train = PromptStream(records, data.train_batch_size, seed=data.seed, shuffle=data.shuffle)
        val = load_prompts(data.val_files, data, self.tokenizer, data.max_val_samples)[0] if data.val_files else []
        return train, val, stats

    def _setup_actor(self, model_path: str) -> Actor:
        """The policy (+ frozen reference when beta > 0; with LoRA the adapter alone trains) and its optimizer."""
        lc = self.learner_cfg
        return Actor(
            model_path, lc.actor, lc.optim, lc.algorithm, total_steps=self.total_steps,
            max_response_length=lc.rollout.max_response_length, temperature=lc.rollout.temperature, ctx=self.ctx,
            trust_remote_code=self.cfg.model.trust_remote_code, lora=lc.lora, seed=lc.trainer.seed,
        )

    def _resume(self) -> None:
        """Model, optimizer, scheduler, RNG, data position and step from a checkpoint, when there is one."""
        resume = ckpt.resume_path(self.learner_cfg.checkpoint)
        if resume is None:
            return
        extra = ckpt.load_checkpoint(self.actor, resume)
        self.step_num = self._saved_step = self.actor.step
        if "data" in extra:
            self.train_data.load_state_dict(extra["data"])
        else:
            log.warning("%s holds no data position (checkpoint.contents without 'extra'): the data order "
                        "restarts from the beginning", resume)
        log.info("resumed from %s at step %d (data epoch %d, index %d)", resume, self.step_num,
                 self.train_data.epoch, self.train_data.index)

    def _setup_outputs(self):
        """Rank 0: the rollout pipeline, the weight publisher (returned), the run's folder, metrics and reports."""
        lc = self.learner_cfg
        if lc.rollout.max_staleness:  # asynchronous: batches sampled ahead of the update (learner/rollout/pipeline.py)
            self.pipeline = RolloutPipeline(self.train_data, self._collect_ahead, lc.rollout.max_staleness)
        # Samplers subscribe to its announcements (signed with the stack's token, if one is set).
        from dgrpo.weights.publisher import WeightPublisher

        token = self.cfg.auth.token()
        publisher = WeightPublisher(self.cfg.weights, lc.trainer.run_name, dtype=self.cfg.model.dtype,
                                    token=token.encode() if token else None, device=self.ctx.device)
        self.out_dir = Path(lc.trainer.log_dir) / lc.trainer.run_name
        self.metrics = MetricsLogger(lc.trainer.loggers, self.out_dir, lc.trainer.run_name,
                                     self.cfg.stack, lc.trainer.wandb_project, start_step=self.step_num,
                                     mlflow_experiment=lc.trainer.mlflow_experiment)
        # Rollout dumps, the completions table, Prometheus: each only when its key is set.
        self.reports = StepReports(lc.trainer, self.metrics)
        (self.out_dir / "config.yaml").write_text(self.cfg.stack_yaml())
        log.info("%d training prompts (%d dropped, %d truncated as overlong), %d validation prompts; %d steps",
                 self.data_stats.kept, self.data_stats.dropped_overlong, self.data_stats.truncated_overlong,
                 len(self.val_records), self.total_steps)
        return publisher

    async def _setup_clients(self) -> None:
        """Rank 0: gRPC clients live on the running event loop, so they are created inside it."""
        lc = self.learner_cfg
        credentials = self.cfg.auth.credentials()  # the stack's token and TLS (none: plaintext, no authentication)
        self.rollout = RolloutClient(self.cfg.sampler_addresses, lc.rollout, credentials=credentials)
        self.rewarder = RewardClient(lc.rollout.rewarder_address, timeout_s=lc.rollout.reward_timeout_s,
                                     retry_backoff_s=lc.rollout.retry_backoff_s, credentials=credentials,
                                     keepalive_s=lc.rollout.keepalive_s,
                                     keepalive_timeout_s=lc.rollout.keepalive_timeout_s)
        self.collector = GroupCollector(lc, self.rollout, self.rewarder, self.train_data.next_batch,
                                        self._trainer_state)
        if lc.trainer.control_port is not None:
            self.control = await start_control_server(self.state, lc.trainer.control_host, lc.trainer.control_port,
                                                      credentials=credentials)

    # ---- the loop ------------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.ctx.is_main:
            await self._setup_clients()
        try:
            await self.sync_initial_weights()
            if self.learner_cfg.trainer.val_before_train and self.step_num == 0:
                await self.validate()
            while self.step_num < self.total_steps:
                if self._should_stop():
                    break
                with tracing.span("step", step=self.step_num + 1, weight_version=self.version):  # one trace a step
                    await self.step()
                if self._checkpoint_due():
                    self.save_checkpoint()
                if self._validation_due():
                    await self.validate()
            if self.step_num >= self.total_steps and self.learner_cfg.checkpoint.export_dir:
                self.state.phase = "exporting"
                out = ckpt.export_hf(self.actor, self.learner_cfg.checkpoint.export_dir, dtype=self.cfg.model.dtype)
                log.info("exported the policy as a Hugging Face folder: %s", out)
            self.state.phase = "stopped" if self.state.stop_requested else "done"
            self._record_end()
        except asyncio.CancelledError:
            if not self._keep_last_step():
                raise
            asyncio.current_task().uncancel()
        finally:
            if self.pipeline is not None:  # batches sampled ahead are abandoned; a resume samples them again
                await self.pipeline.cancel()
            await self.close()

    async def step(self) -> None:
        """One GRPO step."""
        timer = StepTimer()
        sequences, metrics = None, {}
        if self.ctx.is_main:
            # Lockstep: this step's batch sampled now, with the current weights. Asynchronous: sampled while earlier
            # steps trained, by weights at most max_staleness behind.
            rollout = await (self._rollout_now(timer) if self.pipeline is None else self._rollout_ahead(timer))
            sequences, rewards = to_sequences(rollout.scored, self.learner_cfg, self.tokenizer.eos_token_id or 0)
            self.reports.rollouts(self.step_num + 1, rollout.scored, [s.advantage for s in sequences], self.version)
            metrics = self._rollout_metrics(rollout, rewards)
        sequences = broadcast_object(sequences, self.ctx)  # every rank trains on its share of the same batch
        metrics.update(await self.train(sequences, timer))
        self.step_num += 1
        self.version += 1
        self.state.phase = "publishing"
        with timer.phase("weight_sync"):
            # samplers load it before the next rollout
            metrics["weights/publish_s"], published_bytes = self.weights.publish(self.version)
        metrics["weights/publish_bytes"] = float(published_bytes)
        if self.pipeline is not None:  # the new version lets the next batch start at once
            self.pipeline.fill(self.step_num + 1, self.version, self.total_steps)
        self.log_step(timer, metrics, sequences)

    # ---- the pieces of a step -------------------------------------------------------------------------

    async def _rollout_now(self, timer: StepTimer) -> StepRollout:
        """Lockstep: the next batch, sampled at the current version and scored as each group arrives."""
        self.state.phase = "sampling"
        self._data_before_step = self.train_data.state_dict()
        batch = self.train_data.next_batch()
        step = self.step_num + 1
        c = await self.collector.collect_training(batch, step, self.version)
        timer.add("generate", c.generate_s)
        timer.add("reward", c.reward_tail_s)  # only the tail: scoring overlapped generation until the last group
        return StepRollout(c.scored, c.stats, c.reward_busy_s)

    async def _rollout_ahead(self, timer: StepTimer) -> StepRollout:
        """Asynchronous: this step's batch from the pipeline (started up to max_staleness steps ago)."""
        self.state.phase = "sampling"
        step = self.step_num + 1
        self.pipeline.fill(step, self.version, self.total_steps)
        with timer.phase("generate"):  # only the wait: what sampling ahead did not hide
            taken = await self.pipeline.take(step, self.version)
        self._data_before_step = taken.data_before
        return StepRollout(taken.scored, taken.stats, taken.reward_busy_s, {
            **staleness_metrics(taken.scored, self.version),
            "staleness/dropped_groups": float(taken.dropped_groups),
            "rollout/batch_latency_s": taken.latency_s,
            "rollout/batches_ahead": float(len(self.pipeline.in_flight)),
        })

    async def _collect_ahead(self, batch: list[PromptRecord], step: int, min_version: int):
        """The pipeline's collection: step `step`'s batch at >= `min_version`, scored; no phase or timer of its own."""
        c = await self.collector.collect_training(batch, step, min_version)
        return c.scored, c.stats, c.reward_busy_s

    def _rollout_metrics(self, rollout: StepRollout, rewards: torch.Tensor) -> dict[str, float]:
        metrics = rollout_metrics(rollout.scored, rewards, group_size=self.learner_cfg.rollout.n,
                                  version=self.version, reward_busy_s=rollout.reward_busy_s)
        metrics["rollout/trained_groups"] = float(len(rollout.scored))
        metrics.update(rollout.stats.as_metrics())
        metrics.update(rollout.metrics)
        metrics.update(self.collector.filter_metrics(self.step_num + 1))
        specs = {sg.reward.spec for sg in rollout.scored}
        if specs != self._reward_specs:  # a hot-swapped reward function shows up here, named and hashed
            log.info("rewards of step %d come from %s (before: %s)", self.step_num + 1, ", ".join(sorted(specs)),
                     ", ".join(sorted(self._reward_specs)) or "none")
            self._reward_specs = specs
        return metrics

    async def train(self, sequences: list[Sequence], timer: StepTimer) -> dict[str, float]:
        """The actor update, in a worker thread so the control service keeps answering."""
        self.state.phase = "training"
        with timer.phase("train"):
            metrics = await asyncio.to_thread(self.actor.update, sequences, self.learner_cfg.rollout.n)
        # The actor times its no-grad logprob forwards inside update(): report them as their own phase.
        logprob_s = metrics.get("timing/logprob_s", 0.0)
        timer.add("train", -logprob_s)
        timer.add("logprob", logprob_s)
        return metrics

    def log_step(self, timer: StepTimer, metrics: dict[str, float], sequences: list[Sequence]) -> None:
        if self.ctx.is_main:
            times, bottleneck = timer.metrics()
            metrics.update(times)
            metrics.update(throughput_metrics(times, metrics["response/tokens"], sum(len(s) for s in sequences)))
            metrics.update({"weights/version": float(self.version), **memory_metrics(),
                            "data/epoch": float(self.train_data.epoch)})
            self.metrics.log(self.step_num, self.total_steps, metrics, bottleneck)
            self.reports.step_logged(self.step_num, self.total_steps, metrics)
            self.state.metrics = metrics
        self._show_progress()

    def _show_progress(self) -> None:
        """What Status reports: steps done, the weight version, the data epoch."""
        self.state.step, self.state.weight_version = self.step_num, self.version
        self.state.epoch = self.train_data.epoch

    def _trainer_state(self) -> rewarder_pb2.RewardTrainerState:
        """TRL's trainer_state for the reward functions: steps completed now, of how many, and the data epoch."""
        return rewarder_pb2.RewardTrainerState(global_step=self.step_num, max_steps=self.total_steps,
                                               epoch=float(self.train_data.epoch))

    async def sync_initial_weights(self) -> None:
        """Make the samplers serve this run's weights before the first rollout (learner/weight_sync.py)."""
        version = await self.weights.sync_initial_weights(self.rollout, self.step_num)
        if version is not None:
            self.version = self.state.weight_version = version

    async def validate(self) -> None:
        """Greedy completions of the validation prompts, mean reward (rank 0; other ranks idle)."""
        if not self.ctx.is_main or not self.val_records:
            return
        self.state.phase = "validating"
        timer = StepTimer()
        collected = await self.collector.collect_validation(self.val_records, self.step_num, self.version)
        timer.add("generate", collected.generate_s)
        timer.add("reward", collected.reward_tail_s)
        self.reports.validation(self.step_num, collected.scored, self.version)
        metrics = validation_metrics(collected.scored, timer.metrics()[0]["time/step_s"])
        log.info("validation at step %d: mean reward %.4f over %d prompts (%.1fs)", self.step_num,
                 metrics["val/reward_mean"], len(collected.scored), metrics["val/time_s"])
        self.metrics.log(self.step_num, self.total_steps, metrics)
        self.state.metrics = {**self.state.metrics, **metrics}

    # ---- checkpoints and stopping ------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        self.state.phase = "checkpointing"
        # Where a resume continues: after the last trained batch (batches sampled ahead are sampled again).
        data = self.pipeline.data_position() if self.pipeline is not None else None
        extra = {"data": data or self.train_data.state_dict(), "step": self.step_num, "weight_version": self.version}
        path = ckpt.save_checkpoint(self.actor, self.learner_cfg.checkpoint, self.step_num, extra)
        self._saved_step = self.step_num
        if self.ctx.is_main:
            log.info("checkpoint step %d -> %s", self.step_num, path)

    def can_drop_step(self) -> bool:
        """Whether the model is still the last completed step's (sampling or validating), so the step in flight can
        be dropped without losing anything but its samples."""
        return self.state.phase in ("sampling", "validating") and self.ctx.world_size == 1

    def _keep_last_step(self) -> bool:
        """The run was cancelled mid-step (a second stop signal, e.g. from `dgrpo up` when the step's samplers or
        rewarder are gone). While sampling or validating, the model is still the last completed step's: checkpoint
        it, with the data position from before the dropped batch, so a resume redoes that step. Returns False when
        there is nothing consistent to keep (the update was under way, or ranks would have to agree)."""
        if not self.can_drop_step():
            log.warning("cancelled while %s: not checkpointing (the last checkpoint stays)", self.state.phase)
            return False
        dropped = self.state.phase == "sampling"
        if dropped and self.pipeline is not None:
            self.pipeline.abandon()  # the batches after the dropped one: sampled again on resume
        if dropped and self._data_before_step is not None:
            self.train_data.load_state_dict(self._data_before_step)
        if self.step_num > 0 and self._saved_step != self.step_num:
            self.save_checkpoint()
        if dropped:
            log.warning("cancelled while sampling: dropped step %d in flight, kept step %d", self.step_num + 1,
                        self.step_num)
        else:
            log.warning("cancelled while validating: kept step %d", self.step_num)
        self.state.phase = "stopped"
        return True

    def _should_stop(self) -> bool:
        """Rank 0's stop flag (Stop RPC or a signal), agreed by every rank; a checkpoint is written first."""
        stop = broadcast_object(self.state.stop_requested, self.ctx)
        if stop:
            self.state.phase = "stopping"
            if self.step_num > 0 and not self._checkpoint_due():  # (when due, it was written after the step)
                self.save_checkpoint()
        return stop

    def _record_end(self) -> None:
        """With on_end: idle, a run that ended (its last step, or the Stop RPC; not a signal) is recorded at once, in
        the same turn of the event loop that set the phase: no Status says `stopped` before a restart would find it."""
        trainer = self.learner_cfg.trainer
        if trainer.on_end == "idle" and self.ctx.is_main and \
                (self.state.phase == "done" or self.state.stopped_by_rpc):
            run_end.write_record(run_end.record_path(trainer.log_dir, trainer.run_name), self.state)

    def _checkpoint_due(self) -> bool:
        freq = self.learner_cfg.checkpoint.save_freq
        return self.step_num == self.total_steps or (freq > 0 and self.step_num % freq == 0)

    def _validation_due(self) -> bool:
        freq = self.learner_cfg.trainer.test_freq
        return bool(self.val_records) and freq > 0 and (self.step_num % freq == 0 or self.step_num == self.total_steps)

    async def close(self) -> None:
        if self.ctx is None or not self.ctx.is_main:
            return
        publisher = self.weights.publisher if self.weights is not None else None
        if self.rollout is not None and publisher is not None:
            await let_replicas_finish_loading(self.rollout, self.version)
        for client in (self.rollout, self.rewarder):
            if client is not None:
                await client.close()
        if self.control is not None:
            await self.control.stop(1.0)
        for resource in (publisher, self.reports, self.metrics):
            if resource is not None:
                resource.close()
