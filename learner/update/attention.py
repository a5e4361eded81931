"""Attention for the shared-prompt layout, one prompt block at a time instead of one [N, N] mask.

In a packed row with shared prompts (learner/update/batch.py collate_shared_prompts) a token only ever attends within
its block: a prompt copy and the completions that follow it. A dense [N, N] mask over the whole row makes sdpa
compute every query against every key, ~N^2, although a block of u tokens needs only u^2: with 8 groups in a
1024-token row that is 4-5x the attention work, and on CPU the masked attention cost as much as a third of the
update. Here each block runs its own sdpa call with its own small [u, u] mask; the linear layers still see the
whole row, unpadded.

The implementation is registered in transformers' AttentionInterface under `PROMPT_BLOCKS`. A model loaded with
`attn_implementation=PROMPT_BLOCKS` is an sdpa model, except for forwards given `block_forward_kwargs(blocks)`:
transformers hands the `attention_blocks` keyword to every attention layer, and returns the 4-D placeholder mask
as is instead of building an [N, N] one.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dgrpo.common.devices import fp32_attention_backward

PROMPT_BLOCKS = "dgrpo_prompt_blocks"


@dataclass(frozen=True)
class AttentionBlock:
    """Tokens [start, end) of a packed row that attend only among themselves, as `mask` allows."""

    start: int
    end: int
    mask: torch.Tensor  # [u, u] bool, query x key, u = end - start

    def to(self, device: torch.device) -> AttentionBlock:
        return AttentionBlock(self.start, self.end, self.mask.to(device, non_blocking=True))


def prompt_block_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, N, head_dim]
    key: torch.Tensor,  # [1, kv_heads, N, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    attention_blocks: list[AttentionBlock] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """sdpa per block (plain sdpa without blocks); returns [rows, N, heads, head_dim] like transformers' own."""
    if attention_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_blocks[-1].end != query.shape[2]:
        raise ValueError(f"attention blocks cover {attention_blocks[-1].end} tokens of one row; the forward has "
                         f"{query.shape[0]} rows of {query.shape[2]}")
    device = query.device.type
    # Under autocast q/k/v often arrive as fp32 already (RoPE's fp32 cos/sin promote them), and autocast would cast
    # them to bf16 for sdpa, which is on its lower-precision list: so the test is the dtype sdpa would run in.
    autocast = torch.is_autocast_enabled(device)
    upcast = (query.dtype != torch.float32 or autocast) and fp32_attention_backward(device)
    dtype = torch.get_autocast_dtype(device) if autocast else query.dtype
    if upcast:
        query, key, value = query.float(), key.float(), value.float()
    with torch.autocast(device, enabled=False) if upcast else nullcontext():
        parts = [
            sdpa_attention_forward(
                module, query[:, :, b.start : b.end], key[:, :, b.start : b.end], value[:, :, b.start : b.end],
                b.mask[None, None], dropout=dropout, scaling=scaling, is_causal=False,
            )[0]
            for b in attention_blocks
        ]
    return torch.cat(parts, dim=1).to(dtype), None


def block_forward_kwargs(blocks: list[AttentionBlock]) -> dict:
    """Keywords of a model forward over one packed row attending by `blocks`. transformers returns a 4-D
    attention_mask unchanged (masking_utils: "already prepared, or custom"), so a [1, 1, 1, 1] placeholder keeps
    it from building the row's [N, N] mask, which the blocks make unneeded."""
    return {"attention_blocks": blocks, "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool)}


AttentionInterface.register(PROMPT_BLOCKS, prompt_block_attention)
AttentionMaskInterface.register(PROMPT_BLOCKS, sdpa_mask)
