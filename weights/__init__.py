"""Weight sync: the learner publishes each new version, every sampler replica loads it (shared memory or TCP)."""
