"""Reward models: a Hugging Face AutoModelForSequenceClassification folder as a TRL-signature reward function.

Sequences (prompt + completion, chat-templated when the prompt is a conversation and the tokenizer has a
template) are truncated to `max_length`, sorted by length and packed into forward passes under a token budget
(padded length x rows <= max_tokens_per_batch, verl's forward_max_token_len_per_gpu), so one long completion
does not force tiny batches on everything else. Padding is on the right: with causal attention the real
tokens never see the pads, so a batched score equals the unbatched one.
"""

from __future__ import annotations

from dgrpo.common.devices import detect_device, torch_device
from dgrpo.rewarder.builtins import completion_text
from dgrpo.rewarder.config import ModelFunction


def pack_by_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into batches, shortest first, each with max(length) x rows <= budget (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so lengths[i] is the padded length if i joins the batch.
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class RewardModel:
    """Callable like a TRL reward function: `rm(prompts, completions, **kwargs) -> list[float]`."""

    def __init__(self, cfg: ModelFunction):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        kind = detect_device(cfg.device)
        self.device = torch_device(kind)
        if cfg.dtype == "auto":
            dtype = torch.float32 if kind == "cpu" else torch.bfloat16
        else:
            dtype = getattr(torch, cfg.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.tokenizer.truncation_side = cfg.truncation_side
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=dtype).to(self.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if cfg.label_index >= self.model.config.num_labels:
            raise ValueError(f"label_index={cfg.label_index} but the model has {self.model.config.num_labels} labels")

    def _text(self, prompt, completion) -> str:
        text = completion_text(completion)
        if isinstance(prompt, list) and self.tokenizer.chat_template:
            messages = [*prompt, {"role": "assistant", "content": text}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        if isinstance(prompt, list):
            prompt = "\n".join(str(m.get("content", "")) for m in prompt)
        return f"{prompt}{text}"

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        import torch

        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        ids = self.tokenizer(texts, truncation=True, max_length=self.cfg.max_length, add_special_tokens=True)[
            "input_ids"
        ]
        scores = [0.0] * len(ids)
        for batch in pack_by_budget([len(x) for x in ids], self.cfg.max_tokens_per_batch):
            padded = self.tokenizer.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
            with torch.inference_mode():
                logits = self.model(
                    input_ids=padded["input_ids"].to(self.device),  # [B, T]
                    attention_mask=padded["attention_mask"].to(self.device),
                ).logits  # [B, num_labels]
            values = logits[:, self.cfg.label_index].float().cpu().tolist()
            for i, v in zip(batch, values, strict=True):
                scores[i] = v
        return scores
