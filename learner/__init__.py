"""GRPO learner: the trainer, and the driver of the sample -> score -> update -> publish loop."""
