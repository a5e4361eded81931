"""The `dgrpo` command: one thin entrypoint per service, config parsed before torch or vLLM is imported."""
