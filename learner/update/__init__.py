"""The update: the actor (policy, reference, optimizer), the GRPO math, micro-batch layout, LoRA, FSDP and the published
compute copy."""
