"""The loop's publish phase: the policy's weights as a new version for the samplers, and the start and end of a run.

Every rank joins the gather of full weights (or, with LoRA, of the adapter); rank 0 writes and announces them
(weights/publisher.py). At start, replicas may hold weights other than this run's (a resumed run, or replicas that
outlived an earlier learner): `sync_initial_weights` publishes this run's as a version above every replica's. At the
end, `let_replicas_finish_loading` gives the replicas a few seconds to load the last version before the weight slots
go away with this process.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from dgrpo.common import tracing
from dgrpo.common.config import ConfigError
from dgrpo.learner.config import LearnerRunConfig
from dgrpo.learner.rollout.client import RolloutClient
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.distributed import DistContext, broadcast_object
from dgrpo.weights.rounding import publish_cast

log = logging.getLogger("dgrpo.learner")


class WeightSync:
    """Publishes `actor`'s weights as versions; `publisher` is rank 0's (None on the other ranks)."""

    def __init__(self, cfg: LearnerRunConfig, actor: Actor, ctx: DistContext, publisher=None):
        self.cfg, self.actor, self.ctx, self.publisher = cfg, actor, ctx, publisher
        self._announced: tuple[list, str | None] | None = None  # (layout, adapter_config): fixed for the run

    def publish(self, version: int) -> tuple[float, int]:
        """Every rank joins the gather of full weights; rank 0 writes and announces them as `version`. Returns the
        seconds it took and the bytes published (rank 0; 0 elsewhere): an adapter's few MB with learner.lora."""
        t0 = time.perf_counter()
        # Seeded by run seed and version, so a rerun publishes the same bits.
        gather_dtype, cast = publish_cast(getattr(torch, self.cfg.model.dtype), self.cfg.weights.rounding,
                                          seed=self.cfg.learner.trainer.seed * 1_000_003 + version)
        if self.actor.compute is not None:  # bf16_weights=published: the copy's bits, rounded once already
            gather_dtype, cast = torch.bfloat16, lambda t: t
        bucket_bytes = self.cfg.weights.gather_bucket_mb << 20
        # Full weights, or with LoRA the adapter (or, merge_on_sync, the merged weights).
        named = ((name, cast(t)) for name, t in self.actor.named_weights(gather_dtype, bucket_bytes))
        nbytes = 0
        if self.ctx.is_main:
            # The layout up front lets samplers load each tensor as it is written (weights.stream); the span's
            # context rides in the announcement, so each replica's load joins it.
            if self._announced is None:
                self._announced = (self.actor.weight_layout(), self.actor.adapter_config())
            layout, adapter_config = self._announced
            with tracing.span("publish", weight_version=version):
                stats = self.publisher.publish(named, version, layout=layout, adapter_config=adapter_config)
            nbytes = stats.nbytes
        else:
            for _ in named:
                pass
        return time.perf_counter() - t0, nbytes

    async def sync_initial_weights(self, rollout: RolloutClient | None, step: int) -> int | None:
        """Make the samplers serve this run's weights before the first rollout; returns the version published, or
        None when none was needed.

        Replicas start from the initial checkpoint as version 0, and a fresh run's policy is that checkpoint: no
        publish needed. But a resumed run's policy is its checkpoint's, and replicas that outlived an earlier
        learner hold that learner's last version, which they would keep (they only load newer versions). Either
        way this run publishes its weights as a version above every replica's, and continues counting from there.
        """
        versions = [0]
        if self.ctx.is_main:
            for address in await rollout.replicas():
                try:
                    info = await rollout.info(address)
                except grpc.aio.AioRpcError as e:  # an unreachable replica catches up when it is back
                    log.warning("sampler %s did not answer Info (%s); it will catch up when it is back", address, e)
                    continue
                versions.append(info.weight_version)
                self._check_context(address, info.max_model_len)
                mismatch = dtype_mismatch(address, info.dtype, self.cfg.model.dtype)
                if mismatch:
                    log.warning(mismatch)
        newest = broadcast_object(max(versions), self.ctx)
        if step == 0 and newest == 0:
            return None
        version = newest + 1
        publish_s, _ = self.publish(version)
        log.info("published this run's %s weights as version %d (replicas were at <= %d) in %.2fs",
                 "resumed" if step else "initial", version, newest, publish_s)
        return version

    def _check_context(self, address: str, max_model_len: int) -> None:
        """A replica must hold the longest prompt plus max_response_length: it refuses a request whose max_tokens
        the context cannot hold (sampler/requests.py, check_room), so find out now rather than mid-run."""
        data, rollout = self.cfg.learner.data, self.cfg.learner.rollout
        need = data.max_prompt_length + rollout.max_response_length
        if max_model_len and need > max_model_len:
            raise ConfigError(
                f"sampler {address} has max_model_len={max_model_len}, but learner.data.max_prompt_length="
                f"{data.max_prompt_length} + learner.rollout.max_response_length="
                f"{rollout.max_response_length} = {need}: raise that replica's sampler.max_model_len")


def dtype_mismatch(address: str, served: str, published: str) -> str | None:
    """Why publishing `published` weights to a replica whose engine runs `served` ones is worth a warning, or None.
    `model.dtype: auto` is decided on each service's own host, so a learner and a sampler on different kinds of CPU
    can disagree. vLLM's weight loader casts what it gets into its parameters, so the run goes on, but fp32 sent to
    a bf16 engine costs twice the bytes and is rounded to nearest there (weights.rounding no longer applies), and
    bf16 sent to an fp32 engine makes the fp32 engine no more exact than a bf16 one."""
    if not served or served == published:
        return None
    return (f"sampler {address} runs {served} weights but this learner publishes {published} (with model.dtype auto "
            f"each host decides for itself): vLLM casts them as it loads them, so training goes on, but name "
            f"model.dtype in the config every host loads to make them agree")


async def let_replicas_finish_loading(rollout: RolloutClient, version: int, timeout_s: float = 15.0) -> None:
    """The weight slots go with this process. A replica still loading the last version when they vanish holds
    a mix of two versions and shuts itself down (weights/subscriber.py): give the replicas that answer a few
    seconds to report that version first."""
    if version == 0:
        return
    deadline = time.monotonic() + timeout_s
    try:
        pending = set(await asyncio.wait_for(rollout.replicas(), timeout_s))
    except Exception:  # noqa: BLE001 (no replica to wait for: nothing to do)
        return
    while pending and time.monotonic() < deadline:
        for address in sorted(pending):
            try:
                if (await rollout.info(address, timeout=2.0)).weight_version >= version:
                    pending.discard(address)
            except grpc.aio.AioRpcError:
                pending.discard(address)  # unreachable or not serving: nothing of ours to finish
        if pending:
            await asyncio.sleep(0.2)
    if pending:
        log.warning("replicas %s had not loaded version %d after %.0fs; exiting anyway", ", ".join(sorted(pending)),
                    version, timeout_s)
