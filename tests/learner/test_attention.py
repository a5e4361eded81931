"""Block attention (learner/update/attention.py): a PROMPT_BLOCKS model is an sdpa model unless given blocks, and with
blocks it computes what the row's dense [N, N] mask would."""

import pytest
import torch

from dgrpo.learner.update.actor import load_causal_lm
from dgrpo.learner.update.attention import PROMPT_BLOCKS, block_forward_kwargs
from dgrpo.learner.update.batch import Sequence, collate_shared_prompts


@pytest.fixture(scope="module")
def models(tiny_model):
    cpu = torch.device("cpu")
    return load_causal_lm(tiny_model, cpu).eval(), load_causal_lm(tiny_model, cpu, attention=PROMPT_BLOCKS).eval()


def test_without_blocks_it_is_sdpa(models):
    sdpa, blocks = models
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(blocks(input_ids=ids, attention_mask=mask).logits,
                                   sdpa(input_ids=ids, attention_mask=mask).logits)


def test_blocks_equal_the_dense_mask(models):
    """Two groups sharing their prompts: per-block attention gives the logits of sdpa with the full [N, N] mask."""
    sdpa, blocks = models
    seqs = [Sequence([1, 2, 3], [4, 5], 1.0), Sequence([1, 2, 3], [6, 7, 8], -1.0), Sequence([9, 10], [11], 0.5)]
    mb = collate_shared_prompts(seqs, [0, 1, 2])
    n = mb.input_ids.shape[1]
    dense = torch.zeros(n, n, dtype=torch.bool)  # [query, key]
    for b in mb.attention_blocks:
        dense[b.start : b.end, b.start : b.end] = b.mask
    with torch.no_grad():
        want = sdpa(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=dense[None, None]).logits
        got = blocks(input_ids=mb.input_ids, position_ids=mb.position_ids,
                     **block_forward_kwargs(mb.attention_blocks)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A block of the second group must not see the first group: changing group 1's tokens leaves it unchanged.
    other = mb.input_ids.clone()
    other[0, :3] = torch.tensor([20, 21, 22])
    with torch.no_grad():
        moved = blocks(input_ids=other, position_ids=mb.position_ids,
                       **block_forward_kwargs(mb.attention_blocks)).logits
    last = mb.attention_blocks[-1]
    torch.testing.assert_close(moved[0, last.start :], got[0, last.start :])
    assert not torch.allclose(moved[0, : last.start], got[0, : last.start])


def test_blocks_that_do_not_cover_the_row_are_refused(models):
    _, blocks = models
    mb = collate_shared_prompts([Sequence([1, 2], [3], 1.0)], [0])
    with pytest.raises(ValueError, match="attention blocks cover 3 tokens"):
        blocks(input_ids=torch.tensor([[1, 2, 3, 4]]), **block_forward_kwargs(mb.attention_blocks))


def test_under_bf16_autocast_cpu_block_attention_runs_in_fp32(models):
    """CPU's bf16 flash-attention backward is slower than its fp32 one (common/devices.fp32_attention_backward), so
    the blocks upcast q/k/v; autocast must not cast them back to bf16 (sdpa is on its lower-precision list). The
    kernel's own inputs are what counts, seen below autocast by a dispatch mode, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AttentionDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, torch.dtype]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                self.seen.append((func.__name__, args[0].dtype))
            return func(*args, **(kwargs or {}))

    _, blocks = models
    mb = collate_shared_prompts([Sequence([1, 2, 3], [4, 5], 1.0), Sequence([1, 2, 3], [6], -1.0)], [0, 1])
    blocks.train()
    try:
        with AttentionDtypes() as mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = blocks(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                **block_forward_kwargs(mb.attention_blocks)).logits
            logits.float().sum().backward()
    finally:
        blocks.zero_grad(set_to_none=True)
        blocks.eval()
    assert logits.dtype == torch.bfloat16  # the rest of the model did run in bf16
    assert any("backward" in name for name, _ in mode.seen), mode.seen
    assert {dtype for _, dtype in mode.seen} == {torch.float32}, mode.seen
