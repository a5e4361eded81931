"""What the actor trains on: scored sequences, and their layout as padded or packed micro-batches.

The loop turns each sampled completion into a `Sequence` (prompt and completion token ids, the sampler's
logprobs, the GRPO advantage). The actor splits a step's sequences into mini-batches (one optimizer update
each) and micro-batches (one forward/backward each), laid out either

- padded: one row per sequence, right-padded to the longest, with an attention mask; or
- packed: every sequence of the micro-batch concatenated into ONE row, position ids restarting at 0 per
  sequence, no padding at all. transformers turns restarting position ids into a block-diagonal causal mask
  (sdpa/eager: `masking_utils.find_packed_sequence_indices`; flash-attention: varlen kernels), so each
  sequence attends only to itself and the logits equal the padded ones.

- packed with shared prompts: the completions of one prompt (a GRPO group) follow a single copy of the prompt,
  each attending to the prompt and to itself (the layout of prefix-sharing trainers). With groups of n, a prompt
  is computed once instead of n times; logits and gradients equal the other layouts'. Attention runs per block
  (a prompt copy and its completions, learner/update/attention.py), each with its own small mask.

Every layout gives `MicroBatch.token_index` (where completion token t of sequence b sits in the flattened
[rows * length] layout) and `logit_index` (the position whose logits predict it), so the loss code sees the same
[batch, tokens] tensors in all of them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from dgrpo.learner.update.attention import AttentionBlock


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
    in_loss: bool = True
    """False for a completion without a reward (a reward error, every function returned None, or an aborted
    completion): it keeps its group's shape but adds nothing to the loss, its denominator or the KL."""
    tool_mask: list[int] | None = None
    """Multi-turn trajectories: 1 per token the model sampled, 0 per tool-result or chat-template token between its
    turns (Completion.mask). Mask-0 tokens stay in the sequence (the model reads them) but leave the loss, the KL,
    the entropy and the importance weights: they are ANDed into MicroBatch.mask. None: every token is the model's."""

    def __post_init__(self) -> None:
        if not self.completion_ids:
            raise ValueError("a Sequence needs at least one completion token")
        if not self.prompt_ids:  # the first completion token's logprob comes from the last prompt position
            raise ValueError("a Sequence needs at least one prompt token")
        if self.sampler_logprobs is not None and len(self.sampler_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"sampler_logprobs has {len(self.sampler_logprobs)} values for {len(self.completion_ids)} tokens"
            )
        if self.tool_mask is not None:
            if len(self.tool_mask) != len(self.completion_ids):
                raise ValueError(f"tool_mask has {len(self.tool_mask)} values for {len(self.completion_ids)} tokens")
            if any(m not in (0, 1) for m in self.tool_mask):
                raise ValueError("tool_mask holds values other than 0 and 1")

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: the ones the loss counts (all of them without a tool mask)."""
        return len(self.completion_ids) if self.tool_mask is None else sum(self.tool_mask)

    def completion_mask(self) -> torch.Tensor:
        """[c] float: 1 where the loss sees the token."""
        if self.tool_mask is None:
            return torch.ones(len(self.completion_ids))
        return torch.tensor(self.tool_mask, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """B sequences laid out for one forward pass, plus the [B, T] tensors of their completion tokens."""

    input_ids: torch.Tensor  # [R, L] R = B rows (padded) or 1 row (packed)
    position_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor | None  # [R, L] padded; None packed
    token_index: torch.Tensor  # [B, T] flat index into [R*L] of completion token t of sequence b (0 where pad)
    logit_index: torch.Tensor  # [B, T] flat index of the position predicting it (the first entry where pad)
    mask: torch.Tensor  # [B, T] float, 1 on real completion tokens the model sampled (0: padding, tool tokens)
    advantages: torch.Tensor  # [B]
    sampler_logp: torch.Tensor | None  # [B, T] or None when any sequence lacks sampler logprobs
    truncated: torch.Tensor  # [B] bool
    in_loss: torch.Tensor  # [B] bool (Sequence.in_loss)
    indices: list[int]  # position of each sequence in the list it was cut from
    padded_tokens: int  # R*L: tokens the forward computes
    real_tokens: int  # of those, tokens that are not padding
    sequence_tokens: int  # sum of sequence lengths (above real_tokens when prompts are shared)
    attention_blocks: list[AttentionBlock] | None = None  # shared prompts: the row's blocks, in order

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    def to(self, device: torch.device) -> MicroBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return MicroBatch(
            move(self.input_ids), move(self.position_ids), move(self.attention_mask), move(self.token_index),
            move(self.logit_index), move(self.mask), move(self.advantages), move(self.sampler_logp),
            move(self.truncated), move(self.in_loss), self.indices, self.padded_tokens, self.real_tokens,
            self.sequence_tokens,
            None if self.attention_blocks is None else [b.to(device) for b in self.attention_blocks],
        )

    def with_indices(self, indices: list[int]) -> MicroBatch:
        """The same micro-batch with `indices` naming positions in another list."""
        return replace(self, indices=list(indices))


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
        mask[i, :c] = s.completion_mask()
        if sampler_logp is not None:
            sampler_logp[i, :c] = torch.tensor(s.sampler_logprobs)
        offset += n
    return _micro_batch(seqs, indices, input_ids, position_ids, attention_mask, token_index, token_index - 1, mask,
                        sampler_logp, real_tokens=sum(len(s) for s in seqs))


def collate_shared_prompts(seqs: Seq[Sequence], indices: Seq[int]) -> MicroBatch:
    """One packed row in which consecutive sequences with the same prompt share one copy of it.

    Row: [P1, C1a, C1b, ..., P2, C2a, ...]. Completion Cxi keeps the positions it would have after its prompt
    (|Px|, |Px|+1, ...) and attends to Px and causally to itself; its first token is predicted by Px's last
    position, later ones by its own previous token. A block (a prompt copy and the completions after it) gets
    the [u, u] mask of who attends to whom within it, for learner/update/attention.py.
    """
    if not seqs:
        raise ValueError("cannot collate an empty micro-batch")
    b = len(seqs)
    t_max = max(len(s.completion_ids) for s in seqs)
    token_index = torch.zeros(b, t_max, dtype=torch.long)  # [B, T]
    logit_index = torch.zeros(b, t_max, dtype=torch.long)  # [B, T]
    mask = torch.zeros(b, t_max)  # [B, T]
    have_sampler = all(s.sampler_logprobs is not None for s in seqs)
    sampler_logp = torch.zeros(b, t_max) if have_sampler else None  # [B, T]
    ids: list[int] = []
    positions: list[int] = []
    block: list[int] = []  # per token: its block (a prompt copy or one completion)
    visible: list[int] = []  # per token: the other block it attends to (its prompt; itself for prompt tokens)
    prompt_block, prompt_end, last_prompt = -1, 0, None
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if s.prompt_ids != last_prompt:  # a new prompt copy
            prompt_block, last_prompt = len(block), s.prompt_ids
            ids += s.prompt_ids
            positions += range(p)
            block += [prompt_block] * p
            visible += [prompt_block] * p
            prompt_end = len(ids)
        start, own = len(ids), len(block)
        ids += s.completion_ids
        positions += range(p, p + c)
        block += [own] * c
        visible += [prompt_block] * c
        token_index[i, :c] = start + torch.arange(c)
        logit_index[i, 0] = prompt_end - 1
        logit_index[i, 1:c] = start + torch.arange(c - 1)
        mask[i, :c] = s.completion_mask()
        if sampler_logp is not None:
            sampler_logp[i, :c] = torch.tensor(s.sampler_logprobs)
    blk, vis = torch.tensor(block), torch.tensor(visible)  # [N]
    n = len(ids)
    starts = [i for i, v in enumerate(visible) if v == i]  # a prompt copy's first token sees its own block
    blocks = []
    for start, end in zip(starts, [*starts[1:], n], strict=True):
        b, v = blk[start:end], vis[start:end]  # [u]
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()  # [u(query), u(key)]
        blocks.append(AttentionBlock(start, end, causal & ((b[None, :] == b[:, None]) | (b[None, :] == v[:, None]))))
    return _micro_batch(seqs, indices, torch.tensor([ids]), torch.tensor([positions]), None, token_index,
                        logit_index, mask, sampler_logp, real_tokens=n, attention_blocks=blocks)


def _micro_batch(seqs, indices, input_ids, position_ids, attention_mask, token_index, logit_index, mask,
                 sampler_logp, *, real_tokens: int, attention_blocks: list[AttentionBlock] | None = None) -> MicroBatch:
    # Padding entries of logit_index point at their row's first prediction: no new position for the LM head.
    logit_index = torch.where(mask.bool(), logit_index, logit_index[:, :1])
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        token_index=token_index,
        logit_index=logit_index,
        mask=mask,
        advantages=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
        sampler_logp=sampler_logp,
        truncated=torch.tensor([s.truncated for s in seqs], dtype=torch.bool),
        in_loss=torch.tensor([s.in_loss for s in seqs], dtype=torch.bool),
        indices=list(indices),
        padded_tokens=input_ids.numel(),
        real_tokens=real_tokens,
        sequence_tokens=sum(len(s) for s in seqs),
        attention_blocks=attention_blocks,
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


def split_groups_by_tokens(seqs: Seq[Sequence], budget: int) -> list[list[int]]:
    """Index lists for shared-prompt packing: runs of consecutive sequences with one prompt stay together (cut
    into pieces when a run with its one prompt copy exceeds `budget`), then first-fit decreasing over the runs."""
    units: list[list[int]] = []
    cost: list[int] = []
    for i, s in enumerate(seqs):
        extra = len(s.completion_ids)
        if units and seqs[units[-1][0]].prompt_ids == s.prompt_ids and cost[-1] + extra <= budget:
            units[-1].append(i)
            cost[-1] += extra
        else:
            units.append([i])
            cost.append(len(s))
    return [sorted(i for u in b for i in units[u]) for b in split_by_tokens(cost, budget)]


def micro_batches(
    seqs: Seq[Sequence], *, packed: bool, micro_batch_size: int, max_tokens: int, pad_id: int = 0,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Cut `seqs` into micro-batches: packed by token budget (sharing prompts if asked), or padded by count."""
    if packed and share_prompts:
        return [collate_shared_prompts([seqs[i] for i in g], g) for g in split_groups_by_tokens(seqs, max_tokens)]
    lengths = [len(s) for s in seqs]
    groups = split_by_tokens(lengths, max_tokens) if packed else split_by_count(lengths, micro_batch_size)
    return [collate([seqs[i] for i in g], g, packed=packed, pad_id=pad_id) for g in groups]
