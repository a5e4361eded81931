"""Data parallelism for the learner: process group, FSDP2 sharding, balanced batches, broadcasts.

The same script runs alone (`dgrpo learner ...`) or under `torchrun --nproc-per-node N` (one process per
device): the collective backend comes from dgrpo.common.devices (hccl on Ascend, nccl on CUDA, gloo on CPU).
Every rank runs the loop; rank 0 talks to samplers and rewarder and broadcasts each step's sequences, so
every rank sees the same global batch and `balance_batch` deals it out deterministically.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dgrpo.common.devices import DeviceKind, dist_backend, torch_device


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank among world_size, its device, and the collective backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: DeviceKind, timeout_s: float = 1800) -> DistContext:
    """Join torchrun's process group when RANK/WORLD_SIZE are set; a single process needs none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = dist_backend(device)
    dev = torch_device(device, local_rank)
    if device != "cpu":
        getattr(torch, device).set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local_rank, dev, backend)


def shutdown_distributed(settle_s: float = 0.2) -> None:
    """Leave the process group, then release the GIL for `settle_s`. Gloo's worker threads drop each finished
    collective after its waiter has moved on, and dropping its tensors takes the GIL: a process that reaches
    interpreter finalization first aborts (SIGABRT, "terminate called without an active exception" in
    ProcessGroupGloo::runLoop, seen in a core dump of a torchrun rank), so torchrun reports a rank that had saved
    everything as failed. destroy_process_group does not join those threads (pytorch/pytorch#179291)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(settle_s)


def shard_model(model: torch.nn.Module, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2 (`fully_shard`): each decoder layer is its own unit (gathered just in time), then the root.

    Parameters become DTensors sharded over the default process group; gradients are reduce-scattered and
    averaged over ranks. Layers are found as the model's `_no_split_modules` classes (HF's own marking of
    the block that must not be split, e.g. LlamaDecoderLayer).
    """
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules; cannot find its layers to shard")
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def balance_batch(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal sequence indices to ranks so token totals are even and every rank gets the same count.

    Greedy longest-first (verl's balance_batch solves the same partition with Karmarkar-Karp): each sequence
    goes to the rank with the fewest tokens among those not yet full. Equal counts keep the number of padded
    micro-batches equal on every rank (FSDP needs the same number of forward/backward calls everywhere).
    """
    n = len(lengths)
    if n % world_size:
        raise ValueError(f"{n} sequences cannot be split evenly over {world_size} ranks")
    per_rank = n // world_size
    heap = [(0, r) for r in range(world_size)]  # (tokens, rank)
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        full = []
        while True:
            tokens, r = heapq.heappop(heap)
            if len(parts[r]) < per_rank:
                break
            full.append((tokens, r))
        parts[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]


def contiguous_split(n: int, world_size: int) -> list[list[int]]:
    """Rank r takes the r-th contiguous slice (the split without balancing)."""
    if n % world_size:
        raise ValueError(f"{n} sequences cannot be split evenly over {world_size} ranks")
    k = n // world_size
    return [list(range(r * k, (r + 1) * k)) for r in range(world_size)]


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (pickled; for step batches and small control data)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_max(value: int, ctx: DistContext) -> int:
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=ctx.device if ctx.backend != "gloo" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a small tensor of metrics over ranks, in place. nccl / hccl reduce device tensors only: a host tensor
    goes through the device and back (two small copies, as all_reduce_max)."""
    if not ctx.distributed:
        return values
    on_device = values if ctx.backend == "gloo" else values.to(ctx.device)
    dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
    if on_device is not values:
        values.copy_(on_device)
    return values
