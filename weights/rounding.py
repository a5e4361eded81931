"""How fp32 master weights become the bf16 weights a sampler runs: stochastic rounding.

Round-to-nearest loses every change smaller than half a bf16 step. RL fine-tuning moves weights by about the
learning rate per update (AdamW), 1e-5 or less, while half a bf16 step is ~1e-4 for a weight of 0.05: a
bf16 sampler then keeps running the weights it started from while the fp32 learner moves on. Measured on the
CPU demo task (30 steps, lr 1e-5, fp32 learner, bf16 sampler): the learner-sampler logprob gap grew from 0.03
to 0.36 nats per token and the reward rose 0.41 -> 0.56, against 0.47 -> 0.93 with an fp32 sampler.
Stochastic rounding rounds up with probability equal to the remainder's share of the step, so each published
weight equals the master weight in expectation and small updates reach the sampler on average (the rounding
used for low-precision training, e.g. Gupta et al. 2015, "Deep learning with limited numerical precision").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_POOL = 1 << 20
"""Random draws per publish, shared by all tensors (each starts at its own random offset, and tensors longer than
the pool reuse it cyclically). Each element still gets a uniform draw, so every weight stays unbiased; one draw
per element would cost ~1 s per 135M parameters on 2 cores."""


def draw_pool(generator: torch.Generator) -> torch.Tensor:
    """Uniform 16-bit draws, twice over, so that any window of _POOL of them is one slice."""
    pool = torch.randint(0, 1 << 16, (_POOL,), dtype=torch.int32, generator=generator)
    return torch.cat([pool, pool])


def stochastic_bf16(t: torch.Tensor, generator: torch.Generator, pool: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 copy of the fp32 tensor `t`, each element rounded to one of its two neighbours, up with probability
    (distance to the lower one) / (their spacing): E[result] = t. `pool`: draw_pool's output, reused across the
    tensors of one publish (drawn here when not given)."""
    if t.dtype != torch.float32:
        raise ValueError(f"stochastic rounding to bf16 takes fp32 tensors, got {t.dtype}")
    pool = draw_pool(generator) if pool is None else pool
    bits = t.detach().reshape(-1).view(torch.int32)  # sign | exponent | 23 mantissa bits; bf16 keeps the top 16
    n, size = bits.numel(), pool.numel() // 2
    offset = int(torch.randint(0, size, (1,), generator=generator))
    window = pool[offset : offset + min(n, size)]
    out = torch.empty_like(bits)
    whole = n - n % window.numel()  # the window broadcast over rows of its length, then the remainder
    torch.add(bits[:whole].view(-1, window.numel()), window, out=out[:whole].view(-1, window.numel()))
    torch.add(bits[whole:], window[: n - whole], out=out[whole:])
    # Adding a uniform 16-bit draw to the magnitude carries into the kept bits with exactly that probability
    # (for negative numbers too: the magnitude grows away from zero); the shift keeps sign, exponent, 7 bits.
    return out.bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16).reshape(t.shape)


def publish_cast(dtype: torch.dtype, rounding: str,
                 seed: int) -> tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]:
    """How one publish turns master weights into the published `dtype`: (the dtype to gather them in, the cast).
    Stochastic for bf16 when asked (gathered as fp32, one pool of draws for all tensors); otherwise the gather
    itself casts to nearest and the cast is the identity."""
    if dtype != torch.bfloat16 or rounding == "nearest":
        return dtype, lambda t: t
    generator = torch.Generator().manual_seed(seed)
    pool = draw_pool(generator)
    return torch.float32, lambda t: stochastic_bf16(t, generator, pool) if t.dtype == torch.float32 else t.to(dtype)
