"""What one weight transport decides: how the learner's slots are held and sent, how a sampler receives a version,
whether a host needs a relay, what `dgrpo doctor` and `dgrpo up` look after. One subclass a transport
(weights/transports/); the traits are class attributes so an announcement's transport can be read without a config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from dgrpo.weights.config import WeightSyncConfig


class WeightTransport:
    """The base: no traits, learner slots in process memory, nothing to send or relay. Subclasses override what
    differs."""

    name: ClassVar[str] = ""
    """The `weights.transport` value."""
    wire: ClassVar[int] = 0
    """`WeightAnnouncement.transport` (weights.proto's WeightTransport enum)."""
    streams: ClassVar[bool] = False
    """Samplers read the learner's slots in place, so a version may be announced as its write begins and loaded
    tensor by tensor (`weights.stream`)."""
    fetches: ClassVar[bool] = False
    """A sampler copies each complete version's bytes from the learner's control socket into a staging segment."""
    relayed: ClassVar[bool] = False
    """One replica per sampler host (the relay) receives each version; every replica there follows its index."""
    slots_in_shm_dir: ClassVar[bool] = False
    """The learner's two slots are files in `weights.shm_dir`: `dgrpo doctor` checks their room there, `dgrpo up`
    reclaims dead owners' segments from it."""

    def __init__(self, cfg: WeightSyncConfig):
        self.cfg = cfg

    # --- the learner's side ---

    def learner_segments(self, run_id: str) -> list:
        """The learner's two slot segments (reclaiming what dead learners left first, where that applies)."""
        from dgrpo.weights.shm import MemorySegment

        return [MemorySegment(), MemorySegment()]

    def slots_place(self) -> str:
        """Where the learner's slots are, for its log."""
        return f"learner memory, served over {self.name}"

    def sender(self, slots, device):
        """What pushes each published version to the samplers beyond the announcement (None: they pull)."""

    def shm_copies(self) -> tuple[str, int, str]:
        """(what, how many copies of the weights, where) this transport keeps in shared memory, for `dgrpo plan`
        (docs/weight_sync.md, weight slots); none by default."""
        return "", 0, ""

    # --- a sampler's side ---

    @classmethod
    def check_announcement(cls, ann) -> None:
        """Raise ProtocolError when a decoded announcement (weights/protocol.py checked its fields) is not one this
        transport sends: streamed versions are read in place, so only transports that stream may announce them."""
        from dgrpo.weights.protocol import ProtocolError

        if ann.streaming and not cls.streams:
            raise ProtocolError(f"announcement of version {ann.version}: weights.transport={cls.name} streams no "
                                "version")

    def host_relay(self, token: bytes | None):
        """(relay, index) when versions reach this host through a relay (`relayed`), else None."""

    # --- checks before a launch ---

    def check_device(self, device: str) -> None:
        """Raise ValueError when this transport cannot run on `device` (model.device, not auto)."""
