"""What the actor trains on: scored sequences, and their layout as padded or packed micro-batches.

The loop turns each sampled completion into a `Sequence` (prompt and completion token ids, the sampler's
logprobs, the GRPO advantage). The actor splits a step's sequences into mini-batches (one optimizer update
each) and micro-batches (one forward/backward each), laid out either

- padded: one row per sequence, right-padded to the longest, with an attention mask; or
- packed: every sequence of the micro-batch concatenated into ONE row, position ids restarting at 0 per
  sequence, no padding at all. transformers turns restarting position ids into a block-diagonal causal mask
  (sdpa/eager: `masking_utils.find_packed_sequence_indices`; flash-attention: varlen kernels), so each
  sequence attends only to itself and the logits equal the padded ones.

Either way `MicroBatch.token_index` maps completion token t of sequence b to its position in the flattened
[rows * length] layout, so the loss code sees the same [batch, tokens] tensors in both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    """One sampled completion with everything the update needs."""

    prompt_ids: list[int]
    """Prompt token ids as the sampler saw them (chat template applied)."""
    completion_ids: list[int]
    """Sampled token ids (at least one)."""
    advantage: float
    """GRPO advantage of the completion (grpo.group_advantages)."""
    sampler_logprobs: list[float] | None = None
    """Sampler's logprob of each completion token (temperature-scaled), one per completion id; needed for
    algorithm.old_logprobs=sampler and for truncated importance sampling."""
    truncated: bool = False
    """The completion hit max_tokens (finish_reason length)."""

    def __post_init__(self) -> None:
        if not self.completion_ids:
            raise ValueError("a Sequence needs at least one completion token")
        if not self.prompt_ids:  # the first completion token's logprob comes from the last prompt position
            raise ValueError("a Sequence needs at least one prompt token")
        if self.sampler_logprobs is not None and len(self.sampler_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"sampler_logprobs has {len(self.sampler_logprobs)} values for {len(self.completion_ids)} tokens"
            )

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """B sequences laid out for one forward pass, plus the [B, T] tensors of their completion tokens."""

    input_ids: torch.Tensor  # [R, L] R = B rows (padded) or 1 row (packed)
    position_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L] padded only; packed relies on position_ids
    token_index: torch.Tensor  # [B, T] flat index into [R*L] of completion token t of sequence b (0 where pad)
    mask: torch.Tensor  # [B, T] float, 1 on real completion tokens
    advantages: torch.Tensor  # [B]
    sampler_logp: torch.Tensor | None  # [B, T] or None when any sequence lacks sampler logprobs
    truncated: torch.Tensor  # [B] bool
    indices: list[int]  # position of each sequence in the list it was cut from
    padded_tokens: int  # R*L: tokens the forward computes
    real_tokens: int  # sum of sequence lengths

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return MicroBatch(
            move(self.input_ids), move(self.position_ids), move(self.attention_mask), move(self.token_index),
            move(self.mask), move(self.advantages), move(self.sampler_logp), move(self.truncated),
            self.indices, self.padded_tokens, self.real_tokens,
        )


def collate(seqs: Seq[Sequence], indices: Seq[int], *, packed: bool, pad_id: int = 0) -> MicroBatch:
    """Lay out `seqs` (their positions in the caller's list: `indices`) as one padded or packed micro-batch."""
    if not seqs:
        raise ValueError("cannot collate an empty micro-batch")
    b = len(seqs)
    t_max = max(len(s.completion_ids) for s in seqs)
    token_index = torch.zeros(b, t_max, dtype=torch.long)  # [B, T]
    mask = torch.zeros(b, t_max)  # [B, T]
    have_sampler = all(s.sampler_logprobs is not None for s in seqs)
    sampler_logp = torch.zeros(b, t_max) if have_sampler else None  # [B, T]
    if packed:
        total = sum(len(s) for s in seqs)
        input_ids = torch.empty(1, total, dtype=torch.long)  # [1, N]
        position_ids = torch.empty(1, total, dtype=torch.long)  # [1, N]
        attention_mask = None
    else:
        length = max(len(s) for s in seqs)
        input_ids = torch.full((b, length), pad_id, dtype=torch.long)  # [B, L]
        position_ids = torch.zeros(b, length, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros(b, length, dtype=torch.long)  # [B, L]
    offset = 0
    for i, s in enumerate(seqs):
        n, p, c = len(s), len(s.prompt_ids), len(s.completion_ids)
        ids = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        row, start = (0, offset) if packed else (i, 0)
        input_ids[row, start : start + n] = ids
        position_ids[row, start : start + n] = torch.arange(n)
        if attention_mask is not None:
            attention_mask[row, :n] = 1
        row_len = input_ids.shape[1]
        token_index[i, :c] = row * row_len + start + p + torch.arange(c)
        mask[i, :c] = 1.0
        if sampler_logp is not None:
            sampler_logp[i, :c] = torch.tensor(s.sampler_logprobs)
        offset += n
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        token_index=token_index,
        mask=mask,
        advantages=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
        sampler_logp=sampler_logp,
        truncated=torch.tensor([s.truncated for s in seqs], dtype=torch.bool),
        indices=list(indices),
        padded_tokens=input_ids.numel(),
        real_tokens=sum(len(s) for s in seqs),
    )


def split_by_count(lengths: Seq[int], size: int) -> list[list[int]]:
    """Consecutive index lists of at most `size` sequences."""
    return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]


def split_by_tokens(lengths: Seq[int], budget: int) -> list[list[int]]:
    """Index lists whose total length stays within `budget` (a longer sequence gets its own list).

    First-fit decreasing bin packing: sequences sorted longest first, each put into the first micro-batch
    with room. Fewer, fuller micro-batches than taking sequences in order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for j, free in enumerate(room):
            if lengths[i] <= free:
                bins[j].append(i)
                room[j] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def micro_batches(
    seqs: Seq[Sequence], *, packed: bool, micro_batch_size: int, max_tokens: int, pad_id: int = 0
) -> list[MicroBatch]:
    """Cut `seqs` into micro-batches: packed by token budget, or padded by sequence count."""
    lengths = [len(s) for s in seqs]
    groups = split_by_tokens(lengths, max_tokens) if packed else split_by_count(lengths, micro_batch_size)
    return [collate([seqs[i] for i in g], g, packed=packed, pad_id=pad_id) for g in groups]
