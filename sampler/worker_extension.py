"""vLLM worker extension: the only dgrpo code that runs inside vLLM's worker processes.

Loaded by name through `worker_extension_cls`; reached only via `collective_rpc("dgrpo_...")` with
msgpack-able arguments (names, paths, versions), never callables.
"""

from __future__ import annotations


class DgrpoWorkerExtension:
    """Mixed into vLLM's worker class; methods carry the `dgrpo_` prefix to avoid clashes."""

    def dgrpo_ping(self) -> str:
        return "ok"
