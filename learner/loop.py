"""The GRPO training loop: sample groups -> score -> advantages -> actor update -> publish weights -> log.

`Trainer.setup()` builds the components in dependency order; `Trainer.step()` reads like the algorithm. Timing,
checkpoint and conversion plumbing live in helpers below it.

Distributed (torchrun): every rank runs this loop. Rank 0 alone talks to the samplers and the rewarder and
broadcasts each step's scored sequences; every rank then trains on its share (learner/actor.py) and joins the
weight gather, which only rank 0 publishes.

Weight versions: 0 is the initial checkpoint the samplers start from; each training step publishes the next version
and the following rollout asks for `min_weight_version` = that version, so sampling is on-policy. A resumed run (or
one meeting replicas that outlived an earlier learner) first publishes its weights as a version above every
replica's (`sync_initial_weights`), so versions count publishes, not steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from dgrpo.common.config import ConfigError
from dgrpo.common.devices import detect_device
from dgrpo.common.models import resolve_model_path
from dgrpo.learner import checkpoint as ckpt
from dgrpo.learner import dapo, grpo
from dgrpo.learner.actor import Actor
from dgrpo.learner.batch import Sequence
from dgrpo.learner.config import LearnerRunConfig
from dgrpo.learner.control import LoopState, start_control_server
from dgrpo.learner.data import PromptRecord, PromptStream, load_prompts
from dgrpo.learner.distributed import DistContext, broadcast_object, init_distributed
from dgrpo.learner.metrics import MetricsLogger, StepTimer, multi_turn_metrics
from dgrpo.learner.pipeline import RolloutPipeline, staleness_metrics
from dgrpo.learner.reward_client import GroupReward, RewardClient, score_group
from dgrpo.learner.rollout import RolloutClient, RolloutStats, make_prompt
from dgrpo.v1 import rewarder_pb2, sampler_pb2
from dgrpo.weights.gather import layout as weight_layout
from dgrpo.weights.rounding import publish_cast

log = logging.getLogger("dgrpo.learner")

LENGTH = sampler_pb2.FINISH_REASON_LENGTH
# Breakdown names that are 0/1 correctness checks: their mean is reported as the accuracy.
ACCURACY_FUNCTIONS = ("math_verify", "exact_match", "accuracy", "correct")


@dataclass
class ScoredGroup:
    """One prompt's group as sampled and scored."""

    record: PromptRecord
    group: sampler_pb2.Group
    reward: GroupReward


class Trainer:
    def __init__(self, cfg: LearnerRunConfig):
        self.cfg, self.lc = cfg, cfg.learner
        self.state = LoopState()
        self.step_num = 0
        self.version = 0
        self._reward_specs: set[str] = set()
        self._filter_metrics: dict[int, dict[str, float]] = {}  # step -> dynamic sampling's metrics (learner/dapo.py)

    # ---- setup ---------------------------------------------------------------------------------------

    def setup(self) -> None:
        lc = self.lc
        torch.manual_seed(lc.trainer.seed)
        # Rank and device first: every later component is placed by them.
        self.ctx: DistContext = init_distributed(detect_device(self.cfg.model.device))
        self.model_path = resolve_model_path(self.cfg.model.path)
        # The chat template is applied once, with the policy's own tokenizer.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.cfg.model.trust_remote_code)
        # Data on every rank (cheap), so every rank knows the run's length; only rank 0 draws batches.
        records, self.data_stats = load_prompts(lc.data.train_files, lc.data, self.tokenizer, lc.data.max_train_samples)
        self.train_data = PromptStream(records, lc.data.train_batch_size, seed=lc.data.seed, shuffle=lc.data.shuffle)
        self.val_records, _ = (load_prompts(lc.data.val_files, lc.data, self.tokenizer, lc.data.max_val_samples)
                               if lc.data.val_files else ([], None))
        self.total_steps = lc.trainer.total_training_steps or lc.trainer.total_epochs * self.train_data.steps_per_epoch
        self.state.total_steps = self.total_steps
        # Policy (+ frozen reference when beta > 0) and its optimizer.
        self.actor = Actor(
            self.model_path, lc.actor, lc.optim, lc.algorithm, total_steps=self.total_steps,
            max_response_length=lc.rollout.max_response_length, temperature=lc.rollout.temperature, ctx=self.ctx,
            trust_remote_code=self.cfg.model.trust_remote_code,
        )
        # Resume: model, optimizer, scheduler, RNG, data position and step from a checkpoint.
        resume = ckpt.resume_path(lc.checkpoint)
        if resume is not None:
            extra = ckpt.load_checkpoint(self.actor, resume)
            self.step_num = self.actor.step
            if "data" in extra:
                self.train_data.load_state_dict(extra["data"])
            else:
                log.warning("%s holds no data position (checkpoint.contents without 'extra'): the data order "
                            "restarts from the beginning", resume)
            log.info("resumed from %s at step %d (data epoch %d, index %d)", resume, self.step_num,
                     self.train_data.epoch, self.train_data.index)
        self.state.step, self.state.weight_version, self.state.epoch = self.step_num, self.version, self.train_data.epoch
        self._saved_step = self.step_num  # (resumed from it, or step 0: nothing to keep)
        self._data_before_step: dict | None = None
        self.pipeline: RolloutPipeline | None = None
        if not self.ctx.is_main:
            return
        if lc.rollout.max_staleness:  # asynchronous: batches sampled ahead of the update (learner/pipeline.py)
            self.pipeline = RolloutPipeline(self.train_data, self._sample_ahead, lc.rollout.max_staleness)
        # Weight publisher: samplers subscribe to its announcements (signed with the stack's token, if one is set).
        from dgrpo.weights.publisher import WeightPublisher

        token = self.cfg.auth.token()
        self.publisher = WeightPublisher(self.cfg.weights, lc.trainer.run_name, dtype=self.cfg.model.dtype,
                                         token=token.encode() if token else None)
        self.out_dir = Path(lc.trainer.log_dir) / lc.trainer.run_name
        self.metrics = MetricsLogger(lc.trainer.loggers, self.out_dir, lc.trainer.run_name,
                                     self.cfg.stack, lc.trainer.wandb_project, start_step=self.step_num)
        (self.out_dir / "config.yaml").write_text(self.cfg.stack_yaml())
        log.info("%d training prompts (%d dropped, %d truncated as overlong), %d validation prompts; %d steps",
                 self.data_stats.kept, self.data_stats.dropped_overlong, self.data_stats.truncated_overlong,
                 len(self.val_records), self.total_steps)

    async def _start_clients(self) -> None:
        """gRPC clients live on the running event loop, so they are created inside it."""
        lc = self.lc
        credentials = self.cfg.auth.credentials()  # the stack's token and TLS (none: plaintext, no authentication)
        self.rollout = RolloutClient(self.cfg.sampler_addresses, lc.rollout, credentials=credentials)
        self.rewarder = RewardClient(lc.rollout.rewarder_address, timeout_s=lc.rollout.reward_timeout_s,
                                     retry_backoff_s=lc.rollout.retry_backoff_s, credentials=credentials,
                                     keepalive_s=lc.rollout.keepalive_s,
                                     keepalive_timeout_s=lc.rollout.keepalive_timeout_s)
        self.control = None
        if lc.trainer.control_port is not None:
            self.control = await start_control_server(self.state, lc.trainer.control_host, lc.trainer.control_port,
                                                      credentials=credentials)

    # ---- the loop ------------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.ctx.is_main:
            await self._start_clients()
        try:
            await self.sync_initial_weights()
            if self.lc.trainer.val_before_train and self.step_num == 0:
                await self.validate()
            while self.step_num < self.total_steps:
                if self._should_stop():
                    break
                await self.step()
                if self._checkpoint_due():
                    self.save_checkpoint()
                if self._validation_due():
                    await self.validate()
            if self.step_num >= self.total_steps and self.lc.checkpoint.export_dir:
                self.state.phase = "exporting"
                out = ckpt.export_hf(self.actor, self.lc.checkpoint.export_dir, dtype=self.cfg.model.dtype)
                log.info("exported the policy as a Hugging Face folder: %s", out)
            self.state.phase = "done"
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
            if self.pipeline is None:  # lockstep: sample this step's batch now, with the current weights
                self._data_before_step = self.train_data.state_dict()
                batch = self.train_data.next_batch()
                scored, rollout_stats = await self.sample_and_score(batch, timer)  # groups, each scored on arrival
                ahead = {}
            else:  # asynchronous: sampled while earlier steps trained, by weights at most max_staleness behind
                scored, rollout_stats, ahead = await self.take_ahead(timer)
            sequences, metrics = self.to_sequences(scored)  # group-normalized advantages
            metrics["rollout/trained_groups"] = float(len(scored))
            metrics.update(rollout_stats.as_metrics())
            metrics.update(ahead)
            metrics.update(self._filter_metrics.pop(self.step_num + 1, {}))
        sequences = broadcast_object(sequences, self.ctx)  # every rank trains on its share of the same batch
        metrics.update(await self.train(sequences, timer))
        self.step_num += 1
        self.version += 1
        self.state.phase = "publishing"
        with timer.phase("weight_sync"):
            metrics["weights/publish_s"] = self.publish()  # samplers load it before the next rollout
        if self.pipeline is not None:  # the new version lets the next batch start at once
            self.pipeline.fill(self.step_num + 1, self.version, self.total_steps)
        self.log_step(timer, metrics, sequences)

    # ---- the pieces of a step -------------------------------------------------------------------------

    async def train(self, sequences: list[Sequence], timer: StepTimer) -> dict[str, float]:
        """The actor update, in a worker thread so the control service keeps answering."""
        self.state.phase = "training"
        with timer.phase("train"):
            metrics = await asyncio.to_thread(self.actor.update, sequences, self.lc.rollout.n)
        # The actor times its no-grad logprob forwards inside update(): report them as their own phase.
        logprob_s = metrics.get("timing/logprob_s", 0.0)
        timer.add("train", -logprob_s)
        timer.add("logprob", logprob_s)
        return metrics

    def log_step(self, timer: StepTimer, metrics: dict[str, float], sequences: list[Sequence]) -> None:
        if self.ctx.is_main:
            times, bottleneck = timer.metrics()
            metrics.update(times)
            metrics.update({
                "perf/tokens_per_s": sum(len(s) for s in sequences) / times["time/step_s"],
                "perf/generated_tokens_per_s": metrics["response/tokens"] / max(times.get("time/generate_s", 0), 1e-9),
                "weights/version": float(self.version),
                "data/epoch": float(self.train_data.epoch),
            })
            self.metrics.log(self.step_num, self.total_steps, metrics, bottleneck)
            self.state.metrics = metrics
        self.state.step, self.state.weight_version, self.state.epoch = self.step_num, self.version, self.train_data.epoch

    async def take_ahead(self, timer: StepTimer) -> tuple[list[ScoredGroup], RolloutStats, dict[str, float]]:
        """This step's batch from the pipeline (started up to max_staleness steps ago), and its metrics."""
        self.state.phase = "sampling"
        step = self.step_num + 1
        self.pipeline.fill(step, self.version, self.total_steps)
        with timer.phase("generate"):  # only the wait: what sampling ahead did not hide
            taken = await self.pipeline.take(step, self.version)
        self._data_before_step, self._reward_busy = taken.data_before, taken.reward_busy_s
        return taken.scored, taken.stats, {
            **staleness_metrics(taken.scored, self.version),
            "staleness/dropped_groups": float(taken.dropped_groups),
            "rollout/batch_latency_s": taken.latency_s,
            "rollout/batches_ahead": float(len(self.pipeline.in_flight)),
        }

    async def _sample_ahead(self, batch: list[PromptRecord], step: int, min_version: int):
        """The pipeline's sampler: step `step`'s batch at >= `min_version`, scored; no phase or timer of its own."""
        scored, stats, busy, _ = await self._sample_and_score(
            batch, self.sampling_params(step=step), prefix=f"s{step}-", min_version=min_version, step=step)
        return scored, stats, busy

    def sampling_params(self, *, greedy: bool = False, step: int | None = None) -> sampler_pb2.SamplingParams:
        r = self.lc.rollout
        params = sampler_pb2.SamplingParams(
            n=1 if greedy else r.n, temperature=0.0 if greedy else r.temperature, max_tokens=r.max_response_length,
            stop=r.stop,
        )
        if not greedy:
            params.top_p, params.top_k, params.min_p = r.top_p, r.top_k, r.min_p
            if r.seed is not None:  # each step samples differently, resumes reproducibly
                params.seed = r.seed + (self.step_num if step is None else step - 1)
        return params

    async def sample_and_score(
        self, batch: list[PromptRecord], timer: StepTimer, *, greedy: bool = False, tag: str = "s"
    ) -> tuple[list[ScoredGroup], RolloutStats]:
        """Stream the batch's groups from the samplers at the current version; score each group the moment it
        arrives."""
        self.state.phase = "sampling" if tag == "s" else "validating"
        scored, stats, self._reward_busy, (t_generate, t_reward) = await self._sample_and_score(
            batch, self.sampling_params(greedy=greedy), prefix=f"{tag}{self.step_num + 1}-", min_version=self.version,
            step=self.step_num + 1 if tag == "s" else None)
        timer.add("generate", t_generate)
        timer.add("reward", t_reward)  # only the tail: scoring overlapped generation until the last group
        return scored, stats

    async def _sample_and_score(
        self, batch: list[PromptRecord], params: sampler_pb2.SamplingParams, *, prefix: str, min_version: int,
        step: int | None = None,
    ) -> tuple[list[ScoredGroup], RolloutStats, float, tuple[float, float]]:
        """Groups in batch order, the rollout's stats, the rewarder's busy seconds, (generate, reward tail)
        seconds. A training batch (`step` set) with filter_groups on holds only informative groups, each dropped
        group replaced by a new prompt from the data stream (DAPO's dynamic sampling, learner/dapo.py)."""
        fg = self.lc.algorithm.filter_groups
        if step is None or not fg.enable:
            return await self._sample_wave(batch, params, prefix=prefix, min_version=min_version)
        keep = lambda sg: dapo.informative(dapo.group_metric(sg.reward, fg.metric))
        unit = fg.gen_batch_size or self.lc.data.train_batch_size
        def wave_params(wave: int) -> sampler_pb2.SamplingParams:
            """A seeded run gives each wave of replacements its own seed: with the first wave's, a replacement
            could repeat the very samples that made the group it replaces flat."""
            if not wave or not params.HasField("seed"):
                return params
            out = sampler_pb2.SamplingParams()
            out.CopyFrom(params)
            out.seed = params.seed + 1_000_003 * wave
            return out

        scored, stats, busy, fstats, times = await dapo.fill_informative(
            batch, self.train_data.next_batch,
            lambda recs, wave, on_scored: self._sample_wave(recs, wave_params(wave), prefix=f"{prefix}w{wave}-",
                                                            min_version=min_version, on_scored=on_scored),
            keep, fg.max_num_gen_batches * unit or None)
        new = fstats.as_metrics(len(batch), unit)
        old = self._filter_metrics.setdefault(step, {})
        for key, value in new.items():  # a stale group sampled again (pipeline.take) adds to its step's counts
            old[key] = old.get(key, 0.0) + value if key != "filter_groups/kept_frac" else value
        return scored, stats, busy, times

    async def _sample_wave(
        self, batch: list[PromptRecord], params: sampler_pb2.SamplingParams, *, prefix: str, min_version: int,
        on_scored=None,
    ) -> tuple[list[ScoredGroup], RolloutStats, float, tuple[float, float]]:
        """One Generate fan-out: every group of `batch` scored on arrival (and shaped by the overlong penalty);
        `on_scored(i, ScoredGroup)` is told of each as it is scored."""
        prompts = [make_prompt(f"{prefix}{i}", rec.token_ids) for i, rec in enumerate(batch)]
        stats = RolloutStats()
        scoring: dict[int, asyncio.Task] = {}
        groups: dict[int, sampler_pb2.Group] = {}
        busy = [0.0]

        async def score(i: int, group: sampler_pb2.Group) -> GroupReward:
            t0 = time.perf_counter()
            rec = batch[i]
            multi_turn = any(c.messages for c in group.completions)
            result = await self.rewarder.score(score_group(
                group.prompt_id, rec.prompt, [c.text for c in group.completions], rec.extra,
                [c.token_ids for c in group.completions],
                [c.messages for c in group.completions] if multi_turn else None), self._trainer_state())
            busy[0] += time.perf_counter() - t0
            dapo.apply_overlong(result, [len(c.token_ids) for c in group.completions],
                                self.lc.algorithm.overlong_buffer, self.lc.rollout.max_response_length)
            if on_scored is not None:
                on_scored(i, ScoredGroup(rec, group, result))
            return result

        t0 = time.perf_counter()
        try:
            async for group in self.rollout.generate(prompts, params, min_weight_version=min_version, stats=stats):
                i = int(group.prompt_id.removeprefix(prefix))
                groups[i] = group
                scoring[i] = asyncio.create_task(score(i, group))
            t1 = time.perf_counter()
            rewards = dict(zip(scoring, await asyncio.gather(*scoring.values())))
        finally:  # on a failure, no scoring call outlives the step
            for task in scoring.values():
                task.cancel()
        t2 = time.perf_counter()
        # Batch order, not arrival order: the update must not depend on which replica was faster.
        scored = [ScoredGroup(batch[i], groups[i], rewards[i]) for i in range(len(batch))]
        return scored, stats, busy[0], (t1 - t0, t2 - t1)

    def to_sequences(self, scored: list[ScoredGroup]) -> tuple[list[Sequence], dict[str, float]]:
        """Group-normalized advantages, and the Sequences the actor trains on (groups contiguous)."""
        algo, n = self.lc.algorithm, self.lc.rollout.n
        rewards = torch.tensor([r for sg in scored for r in sg.reward.rewards], dtype=torch.float32)  # [B*G]
        valid = torch.tensor([ok for sg in scored for ok in sg.reward.valid], dtype=torch.bool)  # [B*G]
        # Completions without a reward (ERROR, or every function returned None) stay out of the baselines.
        advantages = grpo.group_advantages(rewards, n, algo.adv_scale, algo.adv_eps, valid=valid)  # [B*G]
        sequences: list[Sequence] = []
        completions = [(sg, c, ok) for sg in scored for c, ok in zip(sg.group.completions, sg.reward.valid)]
        eos = self.tokenizer.eos_token_id or 0
        for (sg, c, ok), adv in zip(completions, advantages.tolist()):
            ids, logprobs = list(c.token_ids), list(c.logprobs)
            if not ids:  # an aborted completion: keep the group's shape, train on nothing
                ids, logprobs, ok = [eos], [0.0], False
            sequences.append(Sequence(
                prompt_ids=list(sg.group.prompt_token_ids) or list(sg.record.token_ids),
                completion_ids=ids,
                # A completion the rewarder could not score has no valid reward: out of the loss entirely.
                advantage=adv if ok else 0.0,
                sampler_logprobs=logprobs if len(logprobs) == len(ids) else None,
                truncated=c.finish_reason == LENGTH,
                in_loss=ok,
                tool_mask=list(c.mask) if len(c.mask) == len(ids) else None,  # multi-turn: tool tokens are 0
            ))
        return sequences, self._rollout_metrics(scored, rewards)

    def _rollout_metrics(self, scored: list[ScoredGroup], rewards: torch.Tensor) -> dict[str, float]:
        lengths = torch.tensor([len(c.token_ids) for sg in scored for c in sg.group.completions], dtype=torch.float32)
        finished = [c for sg in scored for c in sg.group.completions]
        stale = sum(c.weight_version < self.version for c in finished)
        m = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "reward/max": rewards.max().item(),
            "reward/min": rewards.min().item(),
            "reward/frac_zero_std": grpo.zero_std_fraction(rewards, self.lc.rollout.n),
            "reward/errors": float(sum(len(sg.reward.errors) for sg in scored)),
            "reward/no_reward": float(sum(sum(sg.reward.no_reward) for sg in scored)),
            "reward/retries": float(sum(sg.reward.retries for sg in scored)),
            "reward/busy_s": self._reward_busy,
            # Which reward scored this step (a hot swap shows as a step up); min and max differ mid-swap.
            "reward/spec_version_min": float(min(sg.reward.spec_version for sg in scored)),
            "reward/spec_version_max": float(max(sg.reward.spec_version for sg in scored)),
            "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/clip_frac": sum(c.finish_reason == LENGTH for c in finished) / len(finished),
            "response/tokens": lengths.sum().item(),
            "prompt/length_mean": sum(len(sg.record.token_ids) for sg in scored) / len(scored),
            "rollout/stale_completions": float(stale),
        }
        m.update(_breakdown_means(scored, "reward"))
        m.update(_logged_metrics(scored))
        m.update(multi_turn_metrics(finished))
        specs = {sg.reward.spec for sg in scored}
        if specs != self._reward_specs:  # a hot-swapped reward function shows up here, named and hashed
            log.info("rewards of step %d come from %s (before: %s)", self.step_num + 1, ", ".join(sorted(specs)),
                     ", ".join(sorted(self._reward_specs)) or "none")
            self._reward_specs = specs
        return m

    def _trainer_state(self) -> rewarder_pb2.RewardTrainerState:
        """TRL's trainer_state for the reward functions: steps completed now, of how many, and the data epoch."""
        return rewarder_pb2.RewardTrainerState(global_step=self.step_num, max_steps=self.total_steps,
                                               epoch=float(self.train_data.epoch))

    async def sync_initial_weights(self) -> None:
        """Make the samplers serve this run's weights before the first rollout.

        Replicas start from the initial checkpoint as version 0, and a fresh run's policy is that checkpoint: no
        publish needed. But a resumed run's policy is its checkpoint's, and replicas that outlived an earlier
        learner hold that learner's last version, which they would keep (they only load newer versions). Either
        way this run publishes its weights as a version above every replica's, and continues counting from there.
        """
        versions = [0]
        if self.ctx.is_main:
            for address in await self.rollout.replicas():
                try:
                    info = await self.rollout.info(address)
                except grpc.aio.AioRpcError as e:  # an unreachable replica catches up when it is back
                    log.warning("sampler %s did not answer Info (%s); it will catch up when it is back", address, e)
                    continue
                versions.append(info.weight_version)
                self._check_context(address, info.max_model_len)
        newest = broadcast_object(max(versions), self.ctx)
        if self.step_num == 0 and newest == 0:
            return
        self.version = newest + 1
        publish_s = self.publish()
        log.info("published this run's %s weights as version %d (replicas were at <= %d) in %.2fs",
                 "resumed" if self.step_num else "initial", self.version, newest, publish_s)
        self.state.weight_version = self.version

    def _check_context(self, address: str, max_model_len: int) -> None:
        """A replica must hold the longest prompt plus max_response_length: it refuses a request whose max_tokens
        the context cannot hold (sampler/engine.py, check_room), so find out now rather than mid-run."""
        need = self.lc.data.max_prompt_length + self.lc.rollout.max_response_length
        if max_model_len and need > max_model_len:
            raise ConfigError(
                f"sampler {address} has max_model_len={max_model_len}, but learner.data.max_prompt_length="
                f"{self.lc.data.max_prompt_length} + learner.rollout.max_response_length="
                f"{self.lc.rollout.max_response_length} = {need}: raise that replica's sampler.max_model_len")

    def publish(self) -> float:
        """Every rank joins the gather of full weights; rank 0 writes and announces them as `self.version`."""
        t0 = time.perf_counter()
        # Seeded by run seed and version, so a rerun publishes the same bits.
        gather_dtype, cast = publish_cast(getattr(torch, self.cfg.model.dtype), self.cfg.weights.rounding,
                                          seed=self.lc.trainer.seed * 1_000_003 + self.version)
        bucket_bytes = self.cfg.weights.gather_bucket_mb << 20
        named = ((name, cast(t)) for name, t in self.actor.named_weights(gather_dtype, bucket_bytes))
        if self.ctx.is_main:
            # The layout up front lets samplers load each tensor as it is written (weights.stream).
            self.publisher.publish(named, self.version, layout=weight_layout(self.actor.policy))
        else:
            for _ in named:
                pass
        return time.perf_counter() - t0

    async def validate(self) -> None:
        """Greedy completions of the validation prompts, mean reward (rank 0; other ranks idle)."""
        if not self.ctx.is_main or not self.val_records:
            return
        self.state.phase = "validating"
        timer = StepTimer()
        scored, _ = await self.sample_and_score(self.val_records, timer, greedy=True, tag="v")
        rewards = [r for sg in scored for r in sg.reward.rewards]
        metrics = {"val/reward_mean": sum(rewards) / len(rewards), "val/prompts": float(len(scored)),
                   "val/time_s": timer.metrics()[0]["time/step_s"]}
        metrics.update(_breakdown_means(scored, "val"))
        log.info("validation at step %d: mean reward %.4f over %d prompts (%.1fs)", self.step_num,
                 metrics["val/reward_mean"], len(scored), metrics["val/time_s"])
        self.metrics.log(self.step_num, self.total_steps, metrics)
        self.state.metrics = {**self.state.metrics, **metrics}

    def save_checkpoint(self) -> None:
        self.state.phase = "checkpointing"
        # Where a resume continues: after the last trained batch (batches sampled ahead are sampled again).
        data = self.pipeline.data_position() if self.pipeline is not None else None
        extra = {"data": data or self.train_data.state_dict(), "step": self.step_num, "weight_version": self.version}
        path = ckpt.save_checkpoint(self.actor, self.lc.checkpoint, self.step_num, extra)
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

    # ---- helpers ---------------------------------------------------------------------------------------

    def _should_stop(self) -> bool:
        """Rank 0's stop flag (Stop RPC or a signal), agreed by every rank; a checkpoint is written first."""
        stop = broadcast_object(self.state.stop_requested, self.ctx)
        if stop:
            self.state.phase = "stopping"
            if self.step_num > 0 and not self._checkpoint_due():  # (when due, it was written after the step)
                self.save_checkpoint()
        return stop

    def _checkpoint_due(self) -> bool:
        freq = self.lc.checkpoint.save_freq
        return self.step_num == self.total_steps or (freq > 0 and self.step_num % freq == 0)

    def _validation_due(self) -> bool:
        freq = self.lc.trainer.test_freq
        return bool(self.val_records) and freq > 0 and (self.step_num % freq == 0 or self.step_num == self.total_steps)

    async def close(self) -> None:
        if not self.ctx.is_main:
            return
        if getattr(self, "rollout", None) is not None and getattr(self, "publisher", None) is not None:
            await self._let_replicas_finish_loading()
        for name in ("rollout", "rewarder"):
            client = getattr(self, name, None)
            if client is not None:
                await client.close()
        if getattr(self, "control", None) is not None:
            await self.control.stop(1.0)
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()


    async def _let_replicas_finish_loading(self, timeout_s: float = 15.0) -> None:
        """The weight slots go with this process. A replica still loading the last version when they vanish holds
        a mix of two versions and shuts itself down (weights/subscriber.py): give the replicas that answer a few
        seconds to report that version first."""
        if self.version == 0:
            return
        deadline = time.monotonic() + timeout_s
        try:
            pending = set(await asyncio.wait_for(self.rollout.replicas(), timeout_s))
        except Exception:  # noqa: BLE001 (no replica to wait for: nothing to do)
            return
        while pending and time.monotonic() < deadline:
            for address in sorted(pending):
                try:
                    if (await self.rollout.info(address, timeout=2.0)).weight_version >= self.version:
                        pending.discard(address)
                except grpc.aio.AioRpcError:
                    pending.discard(address)  # unreachable or not serving: nothing of ours to finish
            if pending:
                await asyncio.sleep(0.2)
        if pending:
            log.warning("replicas %s had not loaded version %d after %.0fs; exiting anyway", ", ".join(sorted(pending)),
                        self.version, timeout_s)


def _logged_metrics(scored: list[ScoredGroup]) -> dict[str, float]:
    """What reward functions logged with TRL's `log_metric`, averaged over the step's groups: reward/metric/<name>."""
    values: dict[str, list[float]] = {}
    for sg in scored:
        for name, value in sg.reward.metrics.items():
            values.setdefault(name, []).append(value)
    return {f"reward/metric/{k}": sum(v) / len(v) for k, v in values.items()}


def _breakdown_means(scored: list[ScoredGroup], prefix: str) -> dict[str, float]:
    """Mean of each reward function over the completions it scored; `accuracy` from a 0/1 correctness check."""
    sums: dict[str, list[float]] = {}
    for sg in scored:
        for b in sg.reward.breakdown:
            for name, value in b.items():
                if math.isfinite(value):
                    sums.setdefault(name, []).append(value)
    out = {f"{prefix}/fn/{k}": sum(v) / len(v) for k, v in sums.items()}
    for name in ACCURACY_FUNCTIONS:
        if name in sums:
            out[f"{prefix}/accuracy"] = sum(v > 0.5 for v in sums[name]) / len(sums[name])
            break
    return out
