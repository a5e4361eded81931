"""weights.transport=tcp: the learner keeps its slots in its own memory and serves each version's bytes on its
control socket; every replica fetches its own copy into a local staging segment (samplers that share no memory with
the learner and need no collective group: one copy per replica over pyzmq)."""

from __future__ import annotations

from dgrpo.v1 import weights_pb2 as pb
from dgrpo.weights.transports.base import WeightTransport


class TcpTransport(WeightTransport):
    name = "tcp"
    wire = pb.WEIGHT_TRANSPORT_TCP
    fetches = True

    def shm_copies(self) -> tuple[str, int, str]:
        return "1 staging copy", 1, f"in {self.cfg.shm_dir} of each replica"
