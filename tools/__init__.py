"""Tools for multi-turn rollouts: tool config (verl's format), Hermes tool-call parsing, sandboxed execution.

Nothing here imports vLLM or torch: the sampler's multi-turn loop uses these pieces, and each tool call runs in a
fresh, isolated child process (`python -m dgrpo.tools.child`), so a hostile or broken tool yields an error
message, never a crashed sampler. docs/tools.md describes the formats and the isolation.

Names are resolved lazily: the child process imports this package too, and should not pay for pydantic or yaml.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "MultiTurnConfig": "config",
    "ParsedCalls": "parser",
    "ToolCall": "parser",
    "parse_tool_calls": "parser",
    "ToolLimits": "sandbox",
    "ToolResult": "sandbox",
    "ToolRunner": "sandbox",
    "SandboxUnavailable": "sandbox",
    "ToolSet": "spec",
    "ToolSpec": "spec",
    "load_tool_config": "spec",
}
__all__ = [
    "MultiTurnConfig", "ParsedCalls", "SandboxUnavailable", "ToolCall", "ToolLimits", "ToolResult", "ToolRunner",
    "ToolSet", "ToolSpec", "load_tool_config", "parse_tool_calls",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
