"""Reward service: scores groups of completions with reward functions and reward models, hot-swappable."""
