"""Rollout orchestration: prompts out to the sampler replicas, scored groups back, sampled at most `max_staleness`
versions ahead of the update."""
