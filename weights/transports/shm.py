"""weights.transport=shm: the learner writes two POSIX shared-memory slots in `shm_dir`, and the samplers on its host
map them and load in place (streamed while the learner writes, with `weights.stream`)."""

from __future__ import annotations

from dgrpo.v1 import weights_pb2 as pb
from dgrpo.weights.transports.base import WeightTransport


class ShmTransport(WeightTransport):
    name = "shm"
    wire = pb.WEIGHT_TRANSPORT_SHM
    streams = True
    slots_in_shm_dir = True

    def learner_segments(self, run_id: str) -> list:
        from dgrpo.weights.shm import ShmSegment, reclaim_stale, segment_path

        reclaim_stale(self.cfg.shm_dir)
        return [ShmSegment(segment_path(self.cfg.shm_dir, run_id, s)) for s in (0, 1)]

    def shm_copies(self) -> tuple[str, int, str]:
        return "2 slots", 2, f"in {self.cfg.shm_dir}"

    @classmethod
    def check_announcement(cls, ann) -> None:
        """Samplers open the announced slot in /dev/shm: a version without one cannot be loaded."""
        from dgrpo.weights.protocol import ProtocolError, segment_error

        super().check_announcement(ann)
        if ann.version and not ann.segment:
            raise ProtocolError(segment_error(ann))

    def slots_place(self) -> str:
        return self.cfg.shm_dir
