"""The sampler's engine adapter for the weight channel: what dgrpo.weights.subscriber loads versions into.

It drives vLLM's weight-transfer contract with our `dgrpo_shm` engine (sampler/vllm_transfer.py):

    start_weight_update -> update_weights(stage)        generation running: open + verify in place
    pause the scheduler (weights.pause_mode)          vLLM's pause_generation less its fixed 20 ms sleep
      update_weights(apply)                            reload from the slot + overlap check
                                                       (streamed: no stage; each tensor checked as it is read)
      finish_weight_update(version)                    vLLM records the version too
      reset_prefix_cache                               KV blocks of the old weights are never reused
      engine.set_weight_version                        requests fenced on the version go
    resume_generation
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from dgrpo.sampler.engine import SamplerEngine
from dgrpo.sampler.vllm_transfer import INTEGRITY_MARK, TORN_MARK
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.protocol import PROTOCOL
from dgrpo.weights.slot import WeightIntegrityError
from dgrpo.weights.target import SlotRef, TornLoad, WeightChannelBroken


def transfer_engine_init_info(reload: str = "auto") -> dict:
    """`init_weight_transfer_engine`'s payload for `dgrpo_shm`."""
    return {"protocol": PROTOCOL, "reload": reload}


@asynccontextmanager
async def paused_generation(llm, pause_mode: str) -> AsyncIterator[float]:
    """The engine's scheduler paused for a weight load (`weights.pause_mode`); yields the seconds pausing took."""
    t0 = time.perf_counter()
    # pause_generation less its fixed 20 ms sleep (vLLM: "not required for correctness"): the engine sends
    # in-flight requests' last outputs before this reply, and their completions read their version long before
    # the load's replies and set_version come back. clear_cache=False: the prefix cache is reset once, after
    # the load (set_version).
    await llm.engine_core.pause_scheduler_async(mode=pause_mode, clear_cache=False)
    try:
        yield time.perf_counter() - t0
    except WeightChannelBroken:
        raise  # stay paused: the weights may be a mix of versions; the server shuts the replica down
    except BaseException:
        await llm.resume_generation()
        raise
    await llm.resume_generation()


class EngineWeightTarget:
    """Loads weight versions into one SamplerEngine's vLLM workers."""

    def __init__(self, engine: SamplerEngine, cfg: WeightSyncConfig):
        self.engine, self.pause_mode, self.reload = engine, cfg.pause_mode, cfg.reload
        self._session = False

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def start(self) -> None:
        """Hand each worker's engine the protocol revision and the reload method (before the first version)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.llm.init_weight_transfer_engine(
            WeightTransferInitRequest(transfer_engine_init_info(self.reload)))

    async def stage(self, ref: SlotRef) -> None:
        await self._open_session()
        try:
            await self._update("stage", ref)
        except BaseException:
            self._session = False  # vLLM ends the session when update_weights raises
            raise

    def paused(self) -> AbstractAsyncContextManager[float]:
        return paused_generation(self.engine.llm, self.pause_mode)

    async def apply(self, ref: SlotRef) -> None:
        if ref.streamed:
            await self._open_session()
        try:
            await self._update("apply", ref)
        except BaseException:
            self._session = False
            raise
        self._session = False
        await self.engine.llm.finish_weight_update(weight_version=str(ref.version))
        # KV blocks computed by the old weights must not be reused for new prompts.
        await self.engine.llm.reset_prefix_cache()

    def set_version(self, version: int) -> None:
        self.engine.set_weight_version(version)

    async def _update(self, phase: str, ref: SlotRef) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            await self.engine.llm.update_weights(
                WeightTransferUpdateRequest({"phase": phase, **dataclasses.asdict(ref)}))
        except Exception as e:
            # The worker's error arrives as its message; its mark says which kind the subscriber must handle.
            message = str(e)
            for mark, kind in ((TORN_MARK, TornLoad), (INTEGRITY_MARK, WeightIntegrityError)):
                if mark in message:
                    raise kind(message.split(mark, 1)[1]) from None
            raise

    async def _open_session(self) -> None:
        if self._session:  # a staged version that was never applied (superseded)
            self._session = False
            await self.engine.llm.finish_weight_update()
        await self.engine.llm.start_weight_update()
        self._session = True
