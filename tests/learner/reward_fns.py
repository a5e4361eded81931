"""Reward functions for the learner's loop tests (TRL signature): cheap, and varied even for a random model."""


def char_diversity(prompts, completions, answer, **kwargs):
    """Distinct characters per character of the completion: differs between samples of one group."""
    return [len(set(c)) / max(len(c), 1) for c in completions]
