"""weights.transport=collective: each version crosses to every other host once, over a torch.distributed group with
that host's relay replica (weights/collective.py on the learner, weights/relay.py on the host), which writes it into
the host's shared-memory slots for every replica there."""

from __future__ import annotations

from dgrpo.v1 import weights_pb2 as pb
from dgrpo.weights.transports.base import WeightTransport


class CollectiveTransport(WeightTransport):
    name = "collective"
    wire = pb.WEIGHT_TRANSPORT_COLLECTIVE
    relayed = True

    def sender(self, slots, device):
        """The learner's links to every host's relay; weights.collective_backend=auto follows the learner's device,
        and nccl / hccl stage each chunk there."""
        import torch

        from dgrpo.common.devices import weight_collective_backend
        from dgrpo.weights.collective import CollectiveSender

        device = torch.device(device)
        backend = weight_collective_backend(self.cfg.collective_backend, device.type)
        return CollectiveSender(self.cfg, slots, backend, device)

    def shm_copies(self) -> tuple[str, int, str]:
        return "2 slots", 2, f"in {self.cfg.shm_dir} of each sampler host (its relay's)"

    def host_relay(self, token: bytes | None):
        from dgrpo.weights.relay import HostIndex, HostRelay

        relay = HostRelay(self.cfg, token)
        return relay, HostIndex(relay.index_path)

    def check_device(self, device: str) -> None:
        from dgrpo.common.devices import weight_collective_backend

        weight_collective_backend(self.cfg.collective_backend, device)
