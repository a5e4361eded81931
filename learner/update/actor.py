"""The actor: the policy being trained, its frozen reference, logprob forwards and the GRPO update.

One `update(sequences, group_size)` is one training step (verl's update_policy):
ppo_epochs x mini-batches (ppo_mini_batch_size groups, one AdamW update each) x micro-batches (one
forward/backward each, gradients accumulated). Micro-batches are padded (a sequence count) or packed (a
token budget, no padding: learner/update/batch.py). Every rank receives the same global list of sequences and
trains on its share of each mini-batch (learner/update/distributed.py balance_batch); each micro-batch's loss is
weighted by its share of the mini-batch's denominator, so the update equals the single-process update on
the same global batch whatever the split (tested with 2 gloo processes).

Why one module of ~500 lines: it is one object. The forwards, the update loop and the weight export all
read the same policy, its sharding, its bf16 compute copy and its LoRA wrapping, which `__init__` decides
together; split across files, each would re-derive that state. What stands alone is a module already: the
loss (grpo.py), the micro-batch layout (batch.py, attention.py), LoRA (lora.py), FSDP (distributed.py), the
compute copy (compute_copy.py), the step's sums (step_sums.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dgrpo.common.devices import fused_adamw
from dgrpo.learner.update import grpo
from dgrpo.learner.update import lora as peft_lora
from dgrpo.learner.update.attention import PROMPT_BLOCKS, block_forward_kwargs
from dgrpo.learner.update.batch import MicroBatch, Sequence, micro_batches
from dgrpo.learner.update.compute_copy import ComputeCopy
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig
from dgrpo.learner.update.distributed import (
    DistContext,
    all_reduce_max,
    balance_batch,
    contiguous_split,
    shard_model,
)
from dgrpo.learner.update.step_sums import StepSums
from dgrpo.weights.config import LoraConfig
from dgrpo.weights.gather import DEFAULT_BUCKET_BYTES, full_tensors
from dgrpo.weights.gather import layout as full_layout

log = logging.getLogger("dgrpo.learner")

def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr at training step `step` (0-based): linear warmup, then constant/cosine/linear."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * decay


def load_causal_lm(
    path: str | Path, device: torch.device, trust_remote_code: bool = False, attention: str = "sdpa"
) -> torch.nn.Module:
    """A Hugging Face causal LM in fp32 (master weights; autocast computes in bf16).

    sdpa (and flash-attention where installed) honour packed rows: position ids restarting at 0 become a
    block-diagonal mask when no attention_mask is given. The shared-prompt layout uses PROMPT_BLOCKS
    (learner/update/attention.py), sdpa per prompt block.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention, trust_remote_code=trust_remote_code
    )
    return model.to(device)


class Actor:
    """Policy (trained, fp32 master weights, AdamW) and, when algorithm.beta > 0, a frozen reference.

    With LoRA (`lora.rank > 0`, learner/update/lora.py) the policy is the base model wrapped by PEFT: only the adapter
    trains and sits in AdamW, and the reference is the policy with its adapter switched off (no second model)."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: ActorConfig,
        optim: OptimConfig,
        algorithm: AlgorithmConfig,
        *,
        total_steps: int,
        max_response_length: int,
        temperature: float = 1.0,
        ctx: DistContext | None = None,
        trust_remote_code: bool = False,
        lora: LoraConfig | None = None,
        seed: int = 0,
    ):
        """`total_steps`: training steps of the run (the lr schedule's horizon). `max_response_length`:
        the sampler's max_tokens (Dr. GRPO's normaliser). `temperature`: the sampling temperature, so the
        learner's logprobs are of the same temperature-scaled distribution the sampler drew from. `seed`: the run's, for
        the stochastic rounding of bf16_weights=published."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: logprobs of greedy (0) sampling cannot be trained on")
        self.ctx = ctx or DistContext()
        if cfg.dtype == "auto":
            cfg = cfg.on_device(self.ctx.device.type)
            if self.ctx.rank == 0:
                log.info("learner.actor.dtype auto: %s compute on this %s (common/devices.py computes_bf16)",
                         cfg.dtype, self.ctx.device.type)
        self.cfg, self.optim_cfg, self.algo = cfg, optim, algorithm
        self.total_steps, self.max_response_length, self.temperature = total_steps, max_response_length, temperature
        self.model_path = Path(model_path)
        self.lora = lora.on_device(self.ctx.device.type) if lora is not None and lora.enabled else None
        self.step = 0
        """Training steps done (one per `update`)."""

        attention = PROMPT_BLOCKS if cfg.use_dynamic_bsz and cfg.share_prompts else "sdpa"
        self.policy = load_causal_lm(model_path, self.ctx.device, trust_remote_code, attention)
        if self.lora is not None:
            if (self.lora.merge_on_sync or self.lora.export_merged) and self.ctx.distributed:
                raise ValueError("learner.lora.merge_on_sync (auto: true on CPU) and export_merged merge on one "
                                 "device; under torchrun publish and export the adapter (both false)")
            base_dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16  # frozen: no master copy needed
            self.policy = peft_lora.apply_lora(self.policy, self.lora, base_dtype)
        self.policy.train()  # dropout is 0 in LLM configs; train mode is what gradient checkpointing keys on
        if cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compute = None
        """bf16_weights=published: the bf16 copy forwards and backwards run on (learner/update/compute_copy.py)."""
        self._updates_this_step = 0
        if cfg.dtype == "bfloat16" and cfg.bf16_weights == "published":
            if self.lora is None and not self.ctx.distributed:
                self.compute = ComputeCopy(self.policy, seed)
            else:  # the LoRA base is stored in bf16 already; FSDP shards would each need their own copy
                log.info("learner.actor.bf16_weights=published applies to full fine-tuning on one device: %s "
                         "computes under autocast", "LoRA" if self.lora is not None else "FSDP")
        self.reference = None
        if algorithm.beta > 0 and self.lora is None:  # LoRA: the reference is the policy without its adapter
            self.reference = load_causal_lm(model_path, self.ctx.device, trust_remote_code, attention).eval()
            self.reference.requires_grad_(False)
        if self.ctx.distributed:
            shard_model(self.policy, cfg.fsdp_reshard_after_forward)
            if self.reference is not None:
                shard_model(self.reference, cfg.fsdp_reshard_after_forward)
        self.pad_id = int(self.policy.config.pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=optim.lr, betas=optim.betas, eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=fused_adamw(self.ctx.device.type) or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.optim_cfg, self.total_steps)
        )

    # ---- forwards -------------------------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.dtype == "float32" or self.compute is not None:  # the copy is bf16 already
            return nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

    def _forward(
        self, model: torch.nn.Module, mb: MicroBatch, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob of each completion token [B, T] (temperature-scaled; 0 on padding), and its entropy if asked.

        Only positions that predict a completion token go through the LM head (transformers' `logits_to_keep`),
        and the vocab-wide work (fp32 cast, log-normaliser, its backward) runs once per kept position: on a small
        model the [tokens, vocab] tensors cost as much as the decoder layers.
        """
        pred = mb.logit_index  # [B, T]
        length = mb.input_ids.shape[1]
        keep, column = torch.unique(pred % length, sorted=True, return_inverse=True)  # [K], [B, T]
        if mb.attention_blocks is None:
            attention = {"attention_mask": mb.attention_mask}
        else:
            attention = block_forward_kwargs(mb.attention_blocks)
        with self._autocast():
            logits = model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=keep,
                **attention,
            ).logits  # [R, K, V]
        vocab = logits.shape[-1]
        valid = mb.mask.bool()  # [B, T]
        kept_index = ((pred // length) * keep.numel() + column)[valid]  # [N] flat index into [R*K]
        rows = logits.reshape(-1, vocab)  # [R*K, V]
        if rows.shape[0] > kept_index.numel():  # padded rows: only the positions that predict a token
            used, kept_index = torch.unique(kept_index, return_inverse=True)
            rows = rows[used]
        rows = rows.float()  # [U, V], U <= N positions that predict a completion token
        if self.temperature != 1.0:
            rows = rows / self.temperature
        targets = mb.input_ids.reshape(-1)[mb.token_index[valid]]  # [N]
        # log p(token) = logit - log Z, per kept position: the n completions of a shared prompt are all predicted
        # by its last position, so indexing [U] scalars avoids copying (and scattering back) [N, V] rows.
        log_z = torch.logsumexp(rows, dim=-1)  # [U]
        token_logp = rows[kept_index, targets] - log_z[kept_index]  # [N]
        logp = torch.zeros(valid.shape, dtype=rows.dtype, device=rows.device).masked_scatter(valid, token_logp)
        ent = None
        if entropy:
            with torch.no_grad():  # H = log Z - E_p[logit]
                token_ent = (log_z - (torch.softmax(rows, dim=-1) * rows).sum(-1))[kept_index]  # [N]
                ent = torch.zeros_like(logp).masked_scatter(valid, token_ent)  # [B, T]
        return logp, ent

    def _logprob_batches(self, seqs: list[Sequence]) -> list[MicroBatch]:
        """No-grad forwards keep no activations for backward, so they take twice the training micro-batch."""
        budget = self.cfg.logprob_max_tokens_per_micro_batch or 2 * self.cfg.max_tokens_per_micro_batch
        return micro_batches(
            seqs, packed=self.cfg.use_dynamic_bsz, micro_batch_size=2 * self.cfg.micro_batch_size_per_device,
            max_tokens=budget, pad_id=self.pad_id, share_prompts=self.cfg.share_prompts,
        )

    @torch.no_grad()
    def _local_logprobs(self, model: torch.nn.Module, seqs: list[Sequence]) -> list[torch.Tensor]:
        """No-grad logprobs of this rank's sequences (micro-batch counts equalised over ranks for FSDP)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        mbs = self._logprob_batches(seqs) if seqs else []
        target = all_reduce_max(len(mbs), self.ctx)
        # LoRA dropout acts in the training forward only: these logprobs are the policy's, as the samplers compute.
        training = model.training
        if self.lora is not None and self.lora.dropout > 0:
            model.eval()
        try:
            for k in range(target):
                mb = mbs[min(k, len(mbs) - 1)].to(self.ctx.device)
                logp, _ = self._forward(model, mb)
                if k < len(mbs):
                    for row, i in enumerate(mb.indices):
                        out[i] = logp[row, : len(seqs[i].completion_ids)].float().cpu()
        finally:
            model.train(training)
        return out

    def _trained_model(self) -> torch.nn.Module:
        """The model the policy's forwards run on: the policy, or its bf16 copy rounded for the coming update."""
        if self.compute is None:
            return self.policy
        self.compute.refresh(self.step, self._updates_this_step)
        return self.compute.model

    def masters_loaded(self) -> None:
        """A checkpoint replaced the policy's weights: the bf16 copy is rounded from them again at next use."""
        if self.compute is not None:
            self.compute.invalidate()

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.lora is not None and self.algo.beta > 0)

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        """The frozen reference: its own model, or (LoRA) the policy with the adapter switched off."""
        if self.lora is not None:
            with peft_lora.reference_mode(self.policy) as base:
                yield base
        elif self.reference is None:
            raise ValueError("no reference model: algorithm.beta is 0")
        else:
            yield self.reference

    def compute_logprobs(self, seqs: list[Sequence], reference: bool = False) -> list[torch.Tensor]:
        """Per-sequence completion logprobs under the policy (or the reference), no grad. Single process:
        all of `seqs`; distributed: every rank must call it with its own list."""
        if not reference:
            return self._local_logprobs(self._trained_model(), seqs)
        with self._reference_model() as model:
            return self._local_logprobs(model, seqs)

    # ---- the update ---------------------------------------------------------------------------------

    def _rank_share(self, seqs: list[Sequence], idx: list[int]) -> list[int]:
        """Indices (into `seqs`) of this rank's part of the mini-batch `idx`."""
        if self.cfg.balance_batch and self.ctx.distributed:
            parts = balance_batch([len(seqs[i]) for i in idx], self.ctx.world_size)
        else:
            parts = contiguous_split(len(idx), self.ctx.world_size)
        return [idx[j] for j in parts[self.ctx.rank]]

    def _loss_tokens(self, s: Sequence) -> int:
        return 0 if not s.in_loss or (self.algo.mask_truncated and s.truncated) else s.model_tokens

    def _denominator(self, seqs: list[Sequence]) -> float:
        """What the aggregation divides by, over `seqs`: tokens (token-mean) or live sequences (seq-means)."""
        tokens = [self._loss_tokens(s) for s in seqs]
        return float(sum(tokens)) if self.algo.loss_agg == "token-mean" else float(sum(t > 0 for t in tokens))

    @staticmethod
    def _rows(values: dict[int, torch.Tensor], mb: MicroBatch) -> torch.Tensor:
        out = torch.zeros_like(mb.mask)  # [B, T]
        for row, i in enumerate(mb.indices):
            v = values[i]
            out[row, : v.numel()] = v.to(out.device)
        return out

    def _mini_batches(self, seqs: list[Sequence], group_size: int) -> list[list[int]]:
        """Indices of each mini-batch (ppo_mini_batch_size whole groups), after checking the batch can be trained."""
        cfg, ctx = self.cfg, self.ctx
        mini = cfg.ppo_mini_batch_size * group_size
        if not seqs or len(seqs) % mini:
            raise ValueError(
                f"{len(seqs)} sequences do not split into mini-batches of ppo_mini_batch_size={cfg.ppo_mini_batch_size}"
                f" groups x {group_size}"
            )
        if mini % ctx.world_size:
            raise ValueError(f"a mini-batch of {mini} sequences cannot be split over {ctx.world_size} ranks")
        needs_sampler = self.algo.old_logprobs == "sampler" or self.algo.correction is not None
        if needs_sampler and any(s.sampler_logprobs is None for s in seqs):
            raise ValueError(
                "algorithm.old_logprobs=sampler / off_policy=tis|mask (or tis_cap) need the sampler's logprobs on "
                "every sequence (the behaviour policy)"
            )
        return [list(range(i, i + mini)) for i in range(0, len(seqs), mini)]

    def _frozen_logprobs(
        self, seqs: list[Sequence], local: list[int], updates: int
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Logprobs fixed for the whole step, of this rank's sequences `local`: the reference's (KL) and, when the
        step makes several updates, the policy's before the first (the old policy of the ratio); empty if unused."""
        ref: dict[int, torch.Tensor] = {}
        if self.has_reference:
            with self._reference_model() as model:
                ref = dict(zip(local, self._local_logprobs(model, [seqs[i] for i in local]), strict=True))
        old: dict[int, torch.Tensor] = {}
        if self.algo.old_logprobs == "recompute" and updates > 1:
            old = dict(zip(local, self._local_logprobs(self._trained_model(), [seqs[i] for i in local]),
                           strict=True))
        return ref, old

    def update(self, seqs: list[Sequence], group_size: int) -> dict[str, float]:
        """One training step on the global batch `seqs` (groups of `group_size`, contiguous); returns metrics.

        Every rank passes the same list. Metrics are means over the step (tokens-weighted where per token).
        """
        minis = self._mini_batches(seqs, group_size)
        seqs, trained, contributing = list(seqs), [], 0
        for idx in minis:
            kept, fillers = self._with_gradient(seqs, idx)
            trained.append(kept + list(range(len(seqs), len(seqs) + len(fillers))))
            seqs += fillers
            contributing += len(kept)
        shares = [self._rank_share(seqs, idx) for idx in trained]
        self._updates_this_step = 0
        t0 = time.perf_counter()
        ref, old = self._frozen_logprobs(seqs, sorted(i for s in shares for i in s), self.cfg.ppo_epochs * len(minis))
        t1 = time.perf_counter()
        sums, grad_norms = StepSums(), []
        for _ in range(self.cfg.ppo_epochs):
            for idx, share in zip(minis, shares, strict=True):
                denom = self._denominator([seqs[i] for i in idx])
                grad_norms.append(self._optimizer_update(seqs, share, denom, ref, old, sums))
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step used
        self.scheduler.step()
        self.step += 1
        self._updates_this_step = 0
        t2 = time.perf_counter()
        sums = sums.all_reduced(self.ctx, maxima=self.algo.correction is not None)
        metrics = sums.metrics(seqs, grad_norms, lr, entropy=self.cfg.compute_entropy,
                               dual_clip=self.algo.clip_ratio_c is not None, correction=self.algo.correction)
        metrics.update({"timing/logprob_s": t1 - t0, "timing/update_s": t2 - t1,
                        "actor/skipped_frac": 1.0 - contributing / sum(map(len, minis))})
        return metrics

    def _with_gradient(self, seqs: list[Sequence], idx: list[int]) -> tuple[list[int], list[Sequence]]:
        """The mini-batch `idx` less the sequences whose gradient is exactly zero (actor.skip_zero_advantage):
        those with no loss token, and, with no KL in the loss (beta 0), those with advantage 0, every token's
        PPO-clip term being -A x ratio = 0. The denominator still counts them, so the update is the one computing
        them would give. Returns the kept indices and fillers: copies of skipped sequences taken out of the loss
        (in_loss False: no loss token, no metric), topping the kept up to a multiple of the world size, at least
        one per rank, so every rank has an equal share."""
        if not self.cfg.skip_zero_advantage:
            return idx, []
        zero_advantage_is_zero_gradient = self.algo.beta == 0

        def contributes(s: Sequence) -> bool:
            return self._loss_tokens(s) > 0 and (s.advantage != 0.0 or not zero_advantage_is_zero_gradient)

        kept = [i for i in idx if contributes(seqs[i])]
        world = self.ctx.world_size
        short = max(world, -(-len(kept) // world) * world) - len(kept)
        skipped = sorted(set(idx) - set(kept))
        return kept, [replace(seqs[i], in_loss=False) for i in skipped[:short]]

    def _optimizer_update(
        self,
        seqs: list[Sequence],
        share: list[int],
        denom: float,
        ref: dict[int, torch.Tensor],
        old: dict[int, torch.Tensor],
        sums: StepSums,
    ) -> float:
        """Forward/backward over this rank's micro-batches of one mini-batch (gradients accumulate), then one
        AdamW step; returns the gradient norm before clipping. `denom`: the mini-batch's loss denominator."""
        mbs = self._train_batches([seqs[i] for i in share])
        model = self._trained_model()
        # FSDP runs collectives in every forward/backward: all ranks must make the same number of calls.
        # A rank with fewer packed micro-batches repeats its last one with weight 0.
        for k in range(all_reduce_max(len(mbs), self.ctx)):
            real = k < len(mbs)
            mb = mbs[min(k, len(mbs) - 1)].to(self.ctx.device)
            mb = mb.with_indices([share[j] for j in mb.indices])  # rows -> positions in `seqs`
            weight = self._loss_weight([seqs[i] for i in mb.indices], denom) if real else 0.0
            logp, ent = self._forward(model, mb, entropy=self.cfg.compute_entropy)  # [B, T]
            loss, stats, mask = self._micro_loss(mb, logp, ref, old)
            (loss * weight).backward()
            if self.compute is not None:
                self.compute.move_grads_to_master()
            if real:
                sums.record(mb, mask, logp, ent, loss, stats, weight, self.ctx.world_size)
        norm = self._clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._updates_this_step += 1
        return norm

    def _train_batches(self, local: list[Sequence]) -> list[MicroBatch]:
        cfg = self.cfg
        return micro_batches(
            local, packed=cfg.use_dynamic_bsz, micro_batch_size=cfg.micro_batch_size_per_device,
            max_tokens=cfg.max_tokens_per_micro_batch, pad_id=self.pad_id, share_prompts=cfg.share_prompts,
        )

    def _loss_weight(self, micro: list[Sequence], denom: float) -> float:
        """The micro-batch's share of its mini-batch's denominator, x world_size because FSDP averages gradients
        over ranks: the weighted micro-batch losses of all ranks then sum to the mini-batch's loss."""
        return self._denominator(micro) / denom * self.ctx.world_size if denom > 0 else 0.0

    def _micro_loss(
        self, mb: MicroBatch, logp: torch.Tensor, ref: dict[int, torch.Tensor], old: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """GRPO loss of one micro-batch (rows indexed by position in the step's batch), its statistics, and the
        loss mask [B, T]."""
        algo = self.algo
        mask = grpo.mask_truncated(mb.mask, mb.truncated) if algo.mask_truncated else mb.mask
        mask = mask * mb.in_loss.unsqueeze(1).to(mask.dtype)  # [B, T]: completions without a reward train nothing
        if algo.old_logprobs == "sampler":
            old_logp = mb.sampler_logp
        elif old:
            old_logp = self._rows(old, mb)
        else:
            old_logp = logp.detach()  # one update per step: the policy before it is the policy now
        ref_logp = self._rows(ref, mb) if ref else None
        # Off-policy correction: old_logp (the learner's, recompute) is the proximal policy, the sampler's the
        # behaviour policy (config checks guarantee both).
        is_w, keep = grpo.off_policy_weights(algo.correction, old_logp, mb.sampler_logp, mask)
        loss, stats = grpo.policy_loss(
            logp, old_logp, mb.advantages, mask, ref_logp=ref_logp, beta=algo.beta, clip_low=algo.clip_low,
            clip_high=algo.clip_high, agg=algo.loss_agg,
            max_response_length=algo.loss_scale_factor or self.max_response_length, is_weights=is_w, keep=keep,
            clip_ratio_c=algo.clip_ratio_c, kl_cap=algo.kl_cap,
        )
        return loss, stats, mask

    def _clip_grad_norm(self) -> float:
        """Total gradient norm over all ranks' shards, before clipping to optim.grad_clip (none: only measured)."""
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # ---- weights out ----------------------------------------------------------------------------------

    def named_weights(
        self, dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor on CPU in `dtype`) of every policy parameter, for publishing, lazily.

        Every rank must iterate it: under FSDP2 the full tensors are all-gathered in buckets of about
        `bucket_bytes` (weights.gather_bucket_mb), the all-gathers of a bucket overlapping and each shard cast to
        `dtype` before its gather (dgrpo.weights.gather; benchmarks/bench_gather.py measures it against one
        blocking gather per parameter), so peak extra memory is one bucket. Only rank 0 receives the pairs, the
        others iterate nothing. Tied weights appear once (e.g. lm_head tied to embed_tokens), as in the model's
        safetensors.
        """
        if self.compute is not None and dtype == torch.bfloat16:  # the bits the learner computes with
            named = full_tensors(self._trained_model(), bucket_bytes=bucket_bytes, dtype=dtype)
        elif self.lora is None:
            named = full_tensors(self.policy, bucket_bytes=bucket_bytes, dtype=dtype)
        elif self.lora.merge_on_sync:  # full weights, base + (alpha / r) B A
            named = peft_lora.merged_tensors(self.policy, dtype=dtype)
        else:  # the adapter alone
            named = peft_lora.adapter_tensors(self.policy, dtype=dtype, bucket_bytes=bucket_bytes)
        for name, tensor in named:
            if self.ctx.is_main:
                yield name, tensor.to(device="cpu")

    def weight_layout(self) -> list[tuple[str, list[int]]]:
        """[(name, shape)] of what `named_weights` yields, in its order, known without computing it."""
        if self.lora is None:
            return full_layout(self.policy)
        if self.lora.merge_on_sync:
            return peft_lora.merged_layout(self.policy)
        return peft_lora.adapter_layout(self.policy)

    def adapter_config(self) -> str | None:
        """PEFT's adapter_config.json when `named_weights` yields an adapter; None for full weights."""
        if self.lora is None or self.lora.merge_on_sync:
            return None
        return peft_lora.adapter_config_json(self.policy)
