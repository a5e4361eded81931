"""bf16 compute on the very weights the samplers run: one stochastically rounded bf16 copy of the fp32 masters.

Autocast (learner.actor.dtype=bfloat16, bf16_weights=autocast) casts each fp32 master weight to bf16 inside every
op that uses it, in every micro-batch's forward and backward, rounded to nearest. Two costs on a CPU learner: the
casts themselves (0.44 s of a 3.7 s update of the demo model, torch.profiler), and a forward that lags its own
masters by up to half a bf16 step while the samplers run stochastically rounded weights (weights/rounding.py): the
learner-sampler logprob gap grew every step (docs/bench_vs_trl.md). Here the masters are rounded once per
optimizer step, stochastically, into a bf16 copy of the model; forwards and backwards run on the copy, its
gradients are added to the fp32 masters' after every micro-batch (accumulated in fp32), AdamW steps the masters,
and the next publish sends the copy's own bits, so learner and samplers compute with the same weights. This is
mixed precision with fp32 master weights (Micikevicius et al. 2018, "Mixed Precision Training"), with the bf16
copy rounded stochastically instead of to nearest.
"""

from __future__ import annotations

import copy

import torch

from dgrpo.weights.rounding import draw_pool, stochastic_bf16


class ComputeCopy:
    """The bf16 model that forwards and backwards run on; `master` (fp32) holds the weights AdamW updates."""

    def __init__(self, master: torch.nn.Module, seed: int):
        self.master, self.seed = master, seed
        self.model = copy.deepcopy(master)  # tied parameters stay tied: deepcopy keeps shared tensors shared
        # Parameters only: buffers (rotary inv_freq) stay fp32, as transformers computes positions in fp32.
        for p in self.model.parameters():
            p.data = p.data.to(torch.bfloat16)
        self.pairs = list(zip(master.parameters(), self.model.parameters(), strict=True))
        self._rounded_for: tuple[int, int] | None = None

    def refresh(self, step: int, update: int) -> None:
        """Round the masters into the copy for optimizer update `update` of training step `step` (seeded by both:
        a resumed run rounds as the uninterrupted one did); nothing when the copy already holds them."""
        if self._rounded_for == (step, update):
            return
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + update)
        pool = draw_pool(generator).to(self.pairs[0][0].device)  # rounded where the masters live
        with torch.no_grad():
            for master, low in self.pairs:
                low.copy_(stochastic_bf16(master.detach(), generator, pool))
        self._rounded_for = (step, update)

    def invalidate(self) -> None:
        """The masters changed outside an update (a checkpoint was loaded): the next use rounds them again."""
        self._rounded_for = None

    def move_grads_to_master(self) -> None:
        """Add the copy's bf16 gradients of one micro-batch to the masters' fp32 ones, and free them: summing the
        micro-batches in fp32 keeps what bf16 accumulation would round away."""
        for master, low in self.pairs:
            if low.grad is None:
                continue
            grad = low.grad.to(torch.float32)
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            low.grad = None
