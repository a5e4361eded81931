"""Sampler service: vLLM's async engine behind gRPC, streaming one group of completions per prompt."""
