"""A two-rank torch.distributed group between the learner (rank 0) and one host's relay (rank 1), outside the global
process group, with a bound on every call.

The learner may run its own `torch.distributed` world (FSDP2 ranks), and the relays come and go while it trains, so
each host gets a group of its own that never touches the global state: a `TCPStore` for the rendezvous plus the
backend's process group built on it, as vLLM's `stateless_init_torch_distributed_process_group`
(vllm/distributed/utils.py) does. Unlike that helper, the store listens on a socket the learner bound itself (on
`weights.bind_host`, so nothing listens beyond loopback unless configured) and gloo's pairs bind the address each side
names, not whatever the machine's hostname resolves to (which, in a network namespace or a container, may not exist).

Every call waits at most the group's timeout; a call that fails or times out leaves the group unusable, and the
caller aborts it and forms a new one. How the bytes move is the backend's (weights/collective_backends.py: gloo moves
host buffers; nccl and hccl stage them through device memory with vLLM's / vllm-ascend's communicators); the caller
always hands host tensors in and gets host tensors back.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch

from dgrpo.weights.collective_backends import (  # noqa: F401 (CollectiveRefused: re-exported)
    CollectiveError,
    CollectiveRefused,
    check_device,
    open_channel,
)

log = logging.getLogger(__name__)

WILDCARDS = ("", "*", "0.0.0.0", "::")


def listen_socket(bind_host: str) -> socket.socket:
    """A bound, listening TCP socket on an ephemeral port for a group's rendezvous store."""
    host = "" if bind_host in WILDCARDS else bind_host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(8)
    return sock


def local_address_towards(host: str, port: int) -> str:
    """The local address the kernel routes to `host` from (no packet is sent: a UDP connect only picks a route)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class PairGroup:
    """Rank 0 (the learner) or rank 1 (a relay) of a two-rank group; `broadcast` from rank 0, `allreduce` (sum)."""

    def __init__(self, rank: int, store_host: str, port: int, timeout_s: float, address: str,
                 backend: str = "gloo", listen: socket.socket | None = None, device: torch.device | None = None):
        """Blocks until both ranks joined (at most `timeout_s`). Rank 0 passes the `listen` socket its store serves
        on; rank 1 connects to `store_host:port`. `address`: the local address gloo binds (a wildcard: gloo's own
        choice, the hostname's address or GLOO_SOCKET_IFNAME). `device`: where nccl / hccl stage the bytes."""
        from torch.distributed import PrefixStore, TCPStore

        self.rank, self.timeout_s, self.backend = rank, timeout_s, backend
        side = "learner" if rank == 0 else "sampler's relay"
        check_device(backend, device, side)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if rank == 0:
                store = TCPStore(store_host, port, 2, True, timeout, master_listen_fd=listen.detach())
            else:
                store = TCPStore(store_host, port, 2, False, timeout)
            self._pg = open_channel(backend, PrefixStore("dgrpo-weights", store), rank, timeout_s, address, WILDCARDS,
                                    device, side)
        except CollectiveError:
            raise
        except (RuntimeError, TimeoutError, OSError) as e:  # torch's Dist*Error are RuntimeErrors
            raise CollectiveError(f"forming the weight group failed: {type(e).__name__}: {_first_line(e)}") from None
        self._store = store  # the pairs are connected; the store stays for the group's lifetime

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into rank 1's (same size and dtype; contiguous, on the host)."""
        self._call(lambda: self._pg.broadcast(tensor), "broadcast")

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum of both ranks' `tensor`, in place on both: the relay's acknowledgement reaches the learner."""
        self._call(lambda: self._pg.allreduce(tensor), "allreduce")

    def _call(self, fn, what: str) -> None:
        try:
            fn()
        except CollectiveError:
            raise
        except (RuntimeError, TimeoutError, OSError) as e:
            raise CollectiveError(f"{what} failed: {_first_line(e)}") from None

    def abort(self) -> None:
        """Close the pairs at once (a call still blocked in another thread fails instead of waiting its timeout)."""
        try:
            self._pg.abort()
        except RuntimeError as e:  # already broken: nothing left to close
            log.debug("aborting a weight group: %s", e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
