"""How a host's weight group (weights/collective_group.py) moves bytes on each device: the one place in weights/ that
knows gloo, nccl and hccl. Everything above it (the learner's links, the relay, the slots) reads the same on every
device: it hands host tensors to `broadcast` / `allreduce` and gets host tensors back.

- gloo (CPU, and any host that prefers TCP): torch's `ProcessGroupGloo` moves the host buffers themselves.
- nccl (CUDA) and hccl (Ascend): the communicators vLLM's own weight-transfer engines are built on, over the same
  rendezvous they use (`StatelessProcessGroup` on a TCPStore): vLLM's `PyNcclCommunicator`
  (vllm/distributed/device_communicators/pynccl.py, used by its `nccl` engine and trainer side) and vllm-ascend's
  `PyHcclCommunicator` (vllm_ascend/distributed/device_communicators/pyhccl.py, used by its `hccl` engine). Each
  chunk is staged through a device buffer: the learner copies it from its slot to the device and broadcasts; the
  relay receives on its device and copies it into the host's shared-memory slot, where it is verified as on gloo.

Both communicators switch themselves off silently when their library cannot be loaded (libnccl / libhccl missing),
when `VLLM_DISABLE_PYNCCL` is set, or in a group of one: every collective then returns at once without moving a byte,
so an update "succeeds" while the receiver keeps what it had. Here each side checks its own communicator before the
group forms, both sides tell each other the result through the rendezvous store, and a group with a switched-off
end is refused on both ends with the reason and the setting to change. Independently of that check, a version is
only served after its checksums verified in the relay host's memory (weights/relay.py), so bytes that never moved
are rejected, not loaded.

Every device call is bounded like gloo's: the communicator is built in a helper thread joined with the group's
timeout, and each collective is followed by an event on the group's own stream that is polled until the deadline. A
group that times out is aborted (vLLM's `destroy` calls `ncclCommAbort`) and its stream and staging buffer are
abandoned with it, never reused.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("gloo", "nccl", "hccl")
POLL_S = 0.0005


class CollectiveError(RuntimeError):
    """A group call failed or timed out: the peer is gone, stopped answering, or the link is down."""


class CollectiveRefused(CollectiveError):
    """The group cannot move bytes with this configuration (a switched-off communicator, a backend the device does
    not have, ends that disagree): retrying does not help until a setting changes."""


@dataclass(frozen=True)
class DeviceBackend:
    """What a device backend needs: its torch device module, its communicator and the check for a switched-off one."""

    name: str
    device_type: str
    library: str
    communicator: Callable[[], type]
    """The communicator class: built as `cls(StatelessProcessGroup, device=torch.device)`."""
    preflight: Callable[[], str | None]
    """Why this process's communicator would be switched off (None: it would work)."""

    def module(self):
        """torch.cuda or torch.npu (torch_npu registers the latter)."""
        if self.device_type == "npu":
            import torch_npu  # noqa: F401

        return getattr(torch, self.device_type)


def _pynccl():
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator


def _nccl_preflight() -> str | None:
    from vllm import envs

    if envs.VLLM_DISABLE_PYNCCL:
        return "VLLM_DISABLE_PYNCCL is set"
    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        NCCLLibrary()
    except Exception as e:  # noqa: BLE001 - vLLM catches the same and switches the communicator off
        return f"libnccl could not be loaded ({type(e).__name__}: {str(e)[:200]})"
    return None


def _pyhccl():
    from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator

    return PyHcclCommunicator


def _hccl_preflight() -> str | None:
    try:
        from vllm_ascend.distributed.device_communicators.pyhccl_wrapper import HCCLLibrary

        HCCLLibrary()
    except Exception as e:  # noqa: BLE001 - vllm-ascend catches the same and switches the communicator off
        return f"libhccl could not be loaded ({type(e).__name__}: {str(e)[:200]})"
    return None


DEVICE_BACKENDS: dict[str, DeviceBackend] = {
    "nccl": DeviceBackend("nccl", "cuda", "libnccl (vLLM's PyNcclCommunicator)", _pynccl, _nccl_preflight),
    "hccl": DeviceBackend("hccl", "npu", "libhccl (vllm-ascend's PyHcclCommunicator)", _pyhccl, _hccl_preflight),
}


def refusal(backend: str, reason: str, side: str) -> CollectiveRefused:
    lib = DEVICE_BACKENDS[backend].library if backend in DEVICE_BACKENDS else backend
    return CollectiveRefused(
        f"weights.transport=collective over {backend} refused on the {side}: {reason}. With it, {lib} skips every "
        f"collective without an error, so a version would seem sent while the samplers keep their old weights. Make "
        f"{backend} work on both ends, or set weights.collective_backend=gloo on the learner and the samplers "
        f"(host memory over TCP)")


def local_device(backend: str) -> torch.device:
    """The device a relay in a sampler's API process receives on: the first one the replica may use (its
    CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), where its tensor-parallel rank 0 worker lives."""
    spec = DEVICE_BACKENDS[backend]
    try:
        available = spec.module().is_available()
    except ImportError:
        available = False
    if not available:
        raise refusal(backend, f"this sampler sees no {spec.device_type} device", "sampler's relay")
    return torch.device(spec.device_type, 0)


class GlooChannel:
    """Host buffers over torch's gloo process group."""

    def __init__(self, store, rank: int, timeout: datetime.timedelta, address: str, wildcards: tuple[str, ...]):
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        device = (ProcessGroupGloo.create_default_device() if address in wildcards
                  else ProcessGroupGloo.create_device(hostname=address))
        opts._devices = [device]
        self._pg = ProcessGroupGloo(store, rank, 2, opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        from torch.distributed.distributed_c10d import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._pg.broadcast([tensor], opts).wait()

    def allreduce(self, tensor: torch.Tensor) -> None:
        self._pg.allreduce([tensor]).wait()

    def abort(self) -> None:
        self._pg.abort()


class DeviceChannel:
    """Host tensors through a device communicator (vLLM's PyNccl / vllm-ascend's PyHccl), staged in device memory."""

    def __init__(self, spec: DeviceBackend, store, rank: int, timeout_s: float, device: torch.device, side: str):
        from vllm.distributed.utils import StatelessProcessGroup

        self.spec, self.rank, self.timeout_s, self.device = spec, rank, timeout_s, device
        self._mod = spec.module()
        self._check_both_ends(store, rank, side)
        built: list = []

        def build() -> None:  # ncclCommInitRank waits for the peer without a bound: bounded by the join below
            try:
                built.append(spec.communicator()(StatelessProcessGroup(rank=rank, world_size=2, store=store),
                                                 device=device))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                built.append(e)

        thread = threading.Thread(target=build, name="dgrpo-comm-init", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not built:
            raise CollectiveError(f"the {spec.name} communicator did not form within {timeout_s:.0f}s")
        if isinstance(built[0], BaseException):
            raise CollectiveError(f"the {spec.name} communicator failed to form: {built[0]}") from None
        self._comm = built[0]
        if getattr(self._comm, "disabled", False) or not getattr(self._comm, "available", True):
            self.abort()
            raise refusal(spec.name, f"the {spec.name} communicator came up switched off", side)
        self._stream = self._mod.Stream(device=device)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def _check_both_ends(self, store, rank: int, side: str) -> None:
        """Each end publishes why its communicator would be off ("" if it would work) and reads the other's, so
        both refuse with the reason instead of one waiting for a peer that never joins."""
        mine = self.spec.preflight() or ""
        if not mine and not self._mod.is_available():
            mine = f"no {self.spec.device_type} device is visible"
        store.set(f"preflight/{rank}", mine)
        try:
            theirs = store.get(f"preflight/{1 - rank}").decode()
        except (RuntimeError, TimeoutError) as e:
            raise CollectiveError(f"the peer never reached the {self.spec.name} check: {e}") from None
        store.set(f"preflight-read/{rank}", "1")
        if rank == 0 and (mine or theirs):
            try:  # the relay reads this end's reason from the store it serves: keep it up until then
                store.wait([f"preflight-read/{1 - rank}"])
            except (RuntimeError, TimeoutError):
                pass
        if mine:
            raise refusal(self.spec.name, mine, side)
        if theirs:
            other = "sampler's relay" if rank == 0 else "learner"
            raise refusal(self.spec.name, theirs, other)

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:  # grows to one chunk, then stays (one per group)
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    def broadcast(self, tensor: torch.Tensor) -> None:
        host = tensor.view(-1).view(torch.uint8)
        buf = self._staging(host.numel())
        with self._mod.stream(self._stream):
            if self.rank == 0:
                buf.copy_(host)  # host -> device (the learner's slot)
            self._comm.broadcast(buf, src=0, stream=self._stream)
        self._wait("broadcast")
        if self.rank == 1:
            host.copy_(buf)  # device -> host (the relay host's slot); bounded: the broadcast is complete

    def allreduce(self, tensor: torch.Tensor) -> None:
        with self._mod.stream(self._stream):
            out = self._comm.all_reduce(tensor.to(self.device), stream=self._stream)
        if out is None:  # a communicator that switched off after forming: nothing was summed
            raise refusal(self.spec.name, f"the {self.spec.name} communicator switched off", "this end")
        self._wait("allreduce")
        tensor.copy_(out)

    def _wait(self, what: str) -> None:
        event = self._mod.Event()
        event.record(self._stream)
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name} {what} did not complete within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)

    def abort(self) -> None:
        """Abort the communicator in a helper thread (vLLM's `destroy` is ncclCommAbort; vllm-ascend's is `close`):
        a kernel stuck on a dead peer must not hold the caller."""
        comm = getattr(self, "_comm", None)
        close = getattr(comm, "destroy", None) or getattr(comm, "close", None)
        if close is not None:
            threading.Thread(target=close, name="dgrpo-comm-abort", daemon=True).start()


def open_channel(backend: str, store, rank: int, timeout_s: float, address: str, wildcards: tuple[str, ...],
                 device: torch.device | None, side: str):
    """The channel of one end of a host's group."""
    if backend == "gloo":
        return GlooChannel(store, rank, datetime.timedelta(seconds=timeout_s), address, wildcards)
    return DeviceChannel(DEVICE_BACKENDS[backend], store, rank, timeout_s, device, side)


def check_device(backend: str, device: torch.device | None, side: str) -> None:
    """Before any rendezvous: the backend exists and this end has a device of its kind."""
    if backend not in BACKENDS:
        raise ValueError(f"weight collective backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend != "gloo" and (device is None or device.type != DEVICE_BACKENDS[backend].device_type):
        raise refusal(backend, f"this end's device is {device}", side)
