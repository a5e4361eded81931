"""Reward functions for the learner's loop tests (TRL signature): cheap, and varied even for a random model."""


def char_diversity(prompts, completions, answer, **kwargs):
    """Distinct characters per character of the completion: differs between samples of one group."""
    return [len(set(c)) / max(len(c), 1) for c in completions]


def char_parity(prompts, completions, answer, **kwargs):
    """1.0 for an even number of characters: two samples of a group agree half the time (dynamic sampling tests)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # text, or TRL's chat messages
    return [float(len(t) % 2 == 0) for t in texts]
