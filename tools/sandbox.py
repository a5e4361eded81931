"""ToolRunner: runs each tool call in a fresh, isolated child process and turns every failure into a ToolResult.

A call never raises and never takes the sampler down: an unknown tool, bad arguments, a crash, a hang (killed at
the wall-clock limit with everything it started), a memory blow-up (RLIMIT_AS) or a flood of output all come back as
a ToolResult whose text the model reads as the tool message. What the child does is in child.py; the isolation level
is checked once, at start, by running a probe call through the real sandbox — `strict` refuses to start where it
cannot be had instead of silently running tools unconfined.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dgrpo.tools.child import landlock_abi
from dgrpo.tools.parser import ToolCall
from dgrpo.tools.spec import ToolSet, ToolSpec

ErrorKind = Literal["timeout", "memory", "error", "unknown_tool", "bad_arguments", "output_truncated"]
_KEEPER_GRACE_S = 10.0  # interpreter start + namespace setup, on top of the tool's own limit
_UID_BASE = 1_500_000_000  # uids no account uses; each runner takes a window of 4096 from its pid
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had here; the message says what is missing and what to do."""


@dataclass(frozen=True)
class ToolLimits:
    """Per-call limits (MultiTurnConfig.limits() builds them from the config)."""

    timeout_s: float = 10
    memory_mb: int = 512
    max_output_chars: int = 4096
    truncate_side: Literal["left", "middle", "right"] = "middle"


@dataclass(frozen=True)
class ToolResult:
    """What one call produced. ok: the tool returned (error may still be "output_truncated": its text was cut)."""

    text: str
    ok: bool
    error: ErrorKind | None
    seconds: float


def check_arguments(spec: ToolSpec, args: dict) -> str | None:
    """Arguments against the tool's schema (required, declared, top-level types); None when they fit."""
    props = spec.parameters.get("properties", {})
    missing = [k for k in spec.parameters.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {', '.join(missing)} for {spec.name}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} for {spec.name} (it takes {', '.join(props) or 'none'})"
    for k, v in args.items():
        want = props[k].get("type")
        types = want if isinstance(want, list) else [want] if want else []
        if types and not any(t in _JSON_TYPES and isinstance(v, _JSON_TYPES[t]) and not (
                t in ("integer", "number") and isinstance(v, bool)) for t in types):
            return f"argument {k} of {spec.name} must be {' or '.join(types)}, got {type(v).__name__}"
        if "enum" in props[k] and v not in props[k]["enum"]:
            return f"argument {k} of {spec.name} must be one of {props[k]['enum']}, got {v!r}"
    return None


class ToolRunner:
    """Runs calls of one ToolSet under limits; thread-safe (every call is its own process and scratch folder)."""

    def __init__(self, toolset: ToolSet, limits: ToolLimits, scratch_root: str | Path,
                 sandbox: Literal["strict", "process"] = "strict"):
        self.toolset, self.limits, self.level = toolset, limits, sandbox
        self.scratch_root = Path(scratch_root).resolve()
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.scratch_root, 0o711)  # per-call folders inside are private to their call's uid
        self._lock = threading.Lock()
        self._root = os.geteuid() == 0 and sandbox == "strict"
        base = _UID_BASE + (os.getpid() % 100_000) * 4096
        self._free_uids = list(range(base + 4095, base - 1, -1)) if self._root else []
        self._seq = 0
        self.isolation = self._probe()

    # --- isolation check ---
    def _probe(self) -> str:
        probe = ToolSpec("_probe", "", {"type": "object"}, "builtin", "_probe")
        res, raw = self._execute(probe, {}, ToolLimits(timeout_s=15, memory_mb=512, max_output_chars=4096))
        layers = ", ".join(raw.get("layers", []))
        if self.level == "process":
            return f"process: separate process and group, {layers or 'rlimits'}; network and filesystem NOT confined"
        if not res.ok:
            raise SandboxUnavailable(
                f"strict tool sandbox unavailable here: {res.text}. It needs root (CAP_SYS_ADMIN) or unprivileged "
                "user namespaces plus Landlock (kernel >= 5.13, landlock in the LSM list); inside docker run with "
                "--cap-add SYS_ADMIN (or a seccomp profile that allows unshare). Or set "
                "learner.rollout.multi_turn.sandbox=process to run tools unconfined (trusted tools only).")
        seen = json.loads(res.text)
        if seen.get("write_root") == "allowed" or seen.get("connect") == "allowed":
            raise SandboxUnavailable(f"strict tool sandbox incomplete: the probe could {seen} — refusing to start")
        return f"strict: {layers}"

    # --- one call ---
    def run(self, call: ToolCall) -> ToolResult:
        t0 = time.monotonic()
        spec = self.toolset.specs.get(call.name)
        if spec is None:
            names = ", ".join(self.toolset.specs) or "none"
            return ToolResult(f"unknown tool {call.name!r} (available: {names})", False, "unknown_tool",
                              time.monotonic() - t0)
        problem = check_arguments(spec, call.arguments)
        if problem:
            return ToolResult(problem, False, "bad_arguments", time.monotonic() - t0)
        res, _ = self._execute(spec, call.arguments, self.limits)
        return res

    def _execute(self, spec: ToolSpec, arguments: dict, limits: ToolLimits) -> tuple[ToolResult, dict]:
        t0 = time.monotonic()
        uid = self._take_uid()
        scratch = self._make_scratch(uid)
        req = {"target": {"kind": spec.kind, "target": spec.target}, "arguments": arguments, "limits": asdict(limits),
               "scratch": str(scratch), "level": self.level, "uid": uid}
        try:
            raw = self._spawn(req, limits, uid)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self._give_uid(uid)
        err = raw.get("error")
        res = ToolResult(text=str(raw.get("text", "")), ok=bool(raw.get("ok")),
                         error=err if err in ErrorKind.__args__ else ("error" if not raw.get("ok") else None),
                         seconds=time.monotonic() - t0)
        return res, raw

    def _spawn(self, req: dict, limits: ToolLimits, uid: int | None) -> dict:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-m", "dgrpo.tools.child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env,
                                cwd="/")
        try:
            out, err = proc.communicate(json.dumps(req).encode(), timeout=limits.timeout_s + _KEEPER_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill(proc, uid)
            return {"ok": False, "text": f"timed out after {limits.timeout_s:g} s (killed)", "error": "timeout"}
        if proc.returncode != 0 or not out:
            self._kill(proc, uid)
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            return {"ok": False, "text": f"tool sandbox failed (exit {proc.returncode}): {' | '.join(tail)}",
                    "error": "error"}
        try:
            return json.loads(out)
        except ValueError:
            return {"ok": False, "text": "tool sandbox returned an unreadable result", "error": "error"}

    def _kill(self, proc: subprocess.Popen, uid: int | None) -> None:
        """Last resort when the keeper itself misbehaved: its group, then every process of the call's uid."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if uid is not None:
            for pid in _pids_of_uid(uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # --- per-call resources ---
    def _take_uid(self) -> int | None:
        if not self._root:
            return None
        with self._lock:
            if not self._free_uids:
                raise RuntimeError("more than 4096 concurrent tool calls")
            return self._free_uids.pop()

    def _give_uid(self, uid: int | None) -> None:
        if uid is not None:
            with self._lock:
                self._free_uids.append(uid)

    def _make_scratch(self, uid: int | None) -> Path:
        with self._lock:
            self._seq += 1
            seq = self._seq
        path = Path(tempfile.mkdtemp(prefix=f"call{seq}-", dir=self.scratch_root))
        if uid is not None:
            os.chown(path, uid, uid)
        return path

    def close(self) -> None:
        """Drop the scratch root if no call is using it (each call removes its own folder when it ends)."""
        try:
            self.scratch_root.rmdir()
        except OSError:
            pass


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


__all__ = ["SandboxUnavailable", "ToolLimits", "ToolResult", "ToolRunner", "check_arguments", "landlock_abi"]
