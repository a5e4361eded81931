"""The contract between a subscriber (weights/subscriber.py) and the engine it loads versions into: where a
version is read (`SlotRef`), what a target does with it (`WeightTarget`), and the two ways a load fails that
the target raises and the subscriber acts on (`TornLoad`, `WeightChannelBroken`). The sampler's vLLM adapter
(sampler/weight_target.py) and its workers (sampler/vllm_transfer.py) import this, not the subscriber."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from dgrpo.weights.slot import WeightIntegrityError


@dataclass(frozen=True)
class SlotRef:
    """Where a target reads one version: msgpack-able fields only (they cross into vLLM's workers). An odd `seq`
    means streamed: the write is still going on, each tensor is read once it is complete."""

    path: str
    version: int
    seq: int
    manifest_xxh3: int
    verify: bool
    stall_timeout_s: float

    @property
    def streamed(self) -> bool:
        return self.seq % 2 == 1


class WeightTarget(Protocol):
    """What a subscriber loads versions into. Implementations: the sampler's vLLM adapter
    (dgrpo.sampler.weight_target) and the torch-module target of the channel's tests."""

    @property
    def weight_version(self) -> int: ...

    async def stage(self, ref: SlotRef) -> None:
        """Open and verify `ref` without touching the model (generation may run); raise WeightIntegrityError.
        Never called for a streamed ref: its tensors are verified one by one as `apply` reads them."""

    def paused(self) -> AbstractAsyncContextManager[float]:
        """Generation paused inside the block; yields the seconds pausing took. A block that raises
        WeightChannelBroken must leave generation paused (the model may hold a mix of versions)."""

    async def apply(self, ref: SlotRef) -> None:
        """Load the staged (or streamed) `ref` inside `paused()`. Raises WeightIntegrityError once the model may
        hold a mix of versions: TornLoad when a write overlapped the load; for a streamed ref also a bad checksum,
        an abandoned or a stalled write."""

    def set_version(self, version: int) -> None:
        """Record the version now served (inside `paused()`, after a successful apply)."""


class TornLoad(WeightIntegrityError):
    """A write overlapped a load: the model holds a mix of two versions and must not serve until reloaded."""


class WeightChannelBroken(RuntimeError):
    """The replica cannot reach an untorn version: it must not serve (its supervisor restarts it)."""
