"""A stand-in for a CUDA GPU / Ascend NPU and its communicator, for the device paths of weights.transport=collective
(weights/collective_backends.py) on a machine without one. Only the device is fake: its memory is host memory, a stream
is the list of collectives enqueued on it and an event completes when they have, and its communicator is vLLM's
PyNcclCommunicator surface (`broadcast(tensor, src, stream)`, out-of-place `all_reduce`, `disabled` / `available`,
`destroy`) moving the bytes over a real gloo group built on the same rendezvous store, between real sockets. Variants
reproduce what vLLM 0.32's communicator does without libnccl (vllm/distributed/device_communicators/pynccl.py:
`disabled`, every collective returns at once).
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field

import torch
from torch.distributed import PrefixStore
from torch.distributed.distributed_c10d import BroadcastOptions, ProcessGroupGloo

from dgrpo.weights.collective_backends import DeviceBackend


class FakeStream:
    """A device stream: the collectives enqueued on it, completed when their gloo work is."""

    def __init__(self):
        self.pending: list = []


class FakeEvent:
    def __init__(self):
        self._works: list = []

    def record(self, stream: FakeStream) -> None:
        self._works = list(stream.pending)

    def query(self) -> bool:
        return all(work.is_completed() for work in self._works)


class FakeDeviceModule:
    """What weights/collective_backends.py uses of torch.cuda / torch.npu."""

    def __init__(self):
        self.available = True

    def is_available(self) -> bool:
        return self.available

    def Stream(self, device=None):
        return FakeStream()

    def stream(self, stream):
        return contextlib.nullcontext()

    def Event(self):
        return FakeEvent()


@dataclass
class Log:
    """What the fake communicators did, across every instance (both ends live in the test's process)."""

    built: list[tuple[int, str]] = field(default_factory=list)
    broadcast_bytes: list[int] = field(default_factory=list)
    destroyed: int = 0


class FakeCommunicator:
    """vLLM's PyNcclCommunicator as its callers see it, over gloo."""

    log = Log()

    def __init__(self, group, device):
        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.available, self.disabled = True, False
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=3)
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._pg = ProcessGroupGloo(PrefixStore("fake-comm", group.store), self.rank, self.world_size, opts)
        self.log.built.append((self.rank, str(device)))

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.disabled:
            return
        self.log.broadcast_bytes.append(tensor.numel() * tensor.element_size())
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        stream.pending.append(self._pg.broadcast([tensor], opts))  # enqueued: NCCL returns before the bytes move

    def all_reduce(self, in_tensor: torch.Tensor, out_tensor: torch.Tensor | None = None, op=None, stream=None):
        if self.disabled:
            return None
        out = in_tensor.clone() if out_tensor is None else out_tensor.copy_(in_tensor)
        stream.pending.append(self._pg.allreduce([out]))
        return out

    def destroy(self) -> None:
        self.log.destroyed += 1
        self._pg.abort()


class SwitchedOffCommunicator(FakeCommunicator):
    """vLLM's communicator when NCCLLibrary() fails: `available = disabled = ...`, then every call returns at once."""

    def __init__(self, group, device):
        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.available, self.disabled = False, True
        self.log.built.append((self.rank, str(device)))

    def destroy(self) -> None:  # vLLM's: only a working communicator has anything to abort
        pass


class BodylessCommunicator(FakeCommunicator):
    """Claims to work but moves nothing bigger than a slot header: a switched-off communicator that a check did not
    catch, as far as the version's bytes go."""

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if tensor.numel() * tensor.element_size() > 4096:
            self.log.broadcast_bytes.append(0)
            return
        super().broadcast(tensor, src, stream)


@dataclass(frozen=True)
class FakeBackend(DeviceBackend):
    """The nccl backend with the fake device: device_type "cpu" (the fake's memory is host memory)."""

    fake_module: FakeDeviceModule = field(default_factory=FakeDeviceModule)

    def module(self):
        return self.fake_module


def fake_backend(communicator: type = FakeCommunicator, preflight=lambda: None) -> FakeBackend:
    return FakeBackend("nccl", "cpu", "libnccl (fake)", lambda: communicator, preflight)
