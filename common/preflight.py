"""Checks that run before anything heavy: output folders writable with room for a checkpoint, ports free.

Unchecked, a full disk surfaces at the first checkpoint (with the demo's settings: after the last step) as a torch
"unexpected pos" error, and a taken port after the model has loaded. These plain functions answer in well under a
second and raise ConfigError naming the key, so `dgrpo learner` and `dgrpo up` fail before they load anything.
Services and the launcher share them, hence common/: nothing here imports torch or a service.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
import socket
import struct
import tempfile
from pathlib import Path

from dgrpo.common.config import ConfigError

GB = 1e9
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# What one checkpoint holds per parameter (learner/records/checkpoint.py): fp32 weights in model.pt, AdamW's two fp32
# moments in optimizer.pt. Scheduler, RNG and data-position files are kilobytes.
CHECKPOINT_BYTES_PER_PARAM = {"model": 4, "optimizer": 8, "extra": 0}


def fmt_bytes(n: float) -> str:
    """1.6 GB, 12 MB, 0.3 MB: the figures a full-disk message gives."""
    if n >= GB:
        return f"{n / GB:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


def parameter_count(model_dir: str | Path) -> int | None:
    """Parameters of the model in `model_dir`, from its safetensors headers (no tensor is read); None if unknown."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def checkpoint_bytes(params: int, contents: list[str]) -> int:
    """Disk one checkpoint of a `params`-parameter model takes (learner/records/checkpoint.py's layout)."""
    return params * sum(CHECKPOINT_BYTES_PER_PARAM[c] for c in contents)


def export_bytes(params: int, dtype: str) -> int:
    """Disk of the Hugging Face export: safetensors in `dtype` (config and tokenizer are a few MB)."""
    return params * _DTYPE_BYTES.get(dtype, 4) + 20_000_000


def _existing_ancestor(path: Path) -> Path:
    """The folder the first `mkdir -p path` would write in; a file in the way is reported by name."""
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                raise NotADirectoryError(str(p))
            return p
    return Path("/")


def check_folder(key: str, folder: str | Path, need_bytes: int = 0, what: str = "") -> Path:
    """`folder` (the value of `key`) can be created and written, with `need_bytes` free; returns the folder whose
    filesystem was measured. Writes (and removes) one small file; creates nothing else."""
    path = Path(folder).expanduser().absolute()
    try:
        base = _existing_ancestor(path)
    except NotADirectoryError as e:
        raise ConfigError(f"{key}={str(folder)!r}: cannot be a folder, {e} is a file") from None
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".dgrpo-preflight-"):
            pass
    except OSError as e:
        where = "" if base == path else f" (it would be created in {base})"
        raise ConfigError(f"{key}={str(folder)!r}: not writable{where}: {e.strerror or e}") from None
    if need_bytes:
        free = shutil.disk_usage(base).free
        if free < need_bytes:
            raise ConfigError(f"{key}={str(folder)!r}: not enough free space for {what or 'its output'}: needs "
                              f"~{fmt_bytes(need_bytes)}, {fmt_bytes(free)} free on {base}")
    return base


def check_replaceable(key: str, folder: str | Path, marker: str) -> None:
    """`folder` is new, empty, or holds `marker` (an earlier output of ours): an output that is swapped in whole
    must not delete a folder of someone else's files."""
    path = Path(folder).expanduser()
    if path.is_dir() and any(path.iterdir()) and not (path / marker).exists():
        raise ConfigError(f"{key}={str(folder)!r} holds files that are not an earlier output (no {marker}); it "
                          "would be replaced whole: pick a new or empty folder")


def check_space(needs: list[tuple[str, str | Path, int, str]]) -> None:
    """Folders (key, folder, bytes, what) that must each be writable, and whose needs on one filesystem add up."""
    by_device: dict[int, list[tuple[str, str | Path, int, str, Path]]] = {}
    for key, folder, need, what in needs:
        base = check_folder(key, folder, need, what)
        by_device.setdefault(base.stat().st_dev, []).append((key, folder, need, what, base))
    for entries in by_device.values():
        total = sum(e[2] for e in entries)
        if len(entries) > 1 and total:
            free = shutil.disk_usage(entries[0][4]).free
            if free < total:
                parts = ", ".join(f"{k}={str(f)!r} ~{fmt_bytes(n)} ({w})" for k, f, n, w, _ in entries if n)
                raise ConfigError(f"not enough free space on {entries[0][4]} for {parts}: needs ~{fmt_bytes(total)} "
                                  f"together, {fmt_bytes(free)} free")


def disk_full(err: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC / EDQUOT, or torch.save's wrapped form ("unexpected pos",
    "file write failed") or safetensors' ("No space left on device (os error 28)"), which carry no errno."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(err)
    return any(m in text for m in ("unexpected pos", "write failed", "No space left", "os error 28"))


Binding = tuple[str, str, int]
"""(config key, host, port) of a socket a service will bind."""


def learner_bindings(trainer, weights) -> list[Binding]:
    """The sockets the learner binds (rank 0), from its `learner.trainer` and `weights` sections: its control
    service (unless control_port is null), its metrics endpoint (when metrics_port is set) and the weight
    publisher's two."""
    out = [("weights.announce_port", weights.bind_host, weights.announce_port),
           ("weights.control_port", weights.bind_host, weights.control_port)]
    if trainer.control_port is not None:
        out.insert(0, ("learner.trainer.control_port", trainer.control_host, trainer.control_port))
    if trainer.metrics_port:
        out.append(("learner.trainer.metrics_port", trainer.metrics_host, trainer.metrics_port))
    return out


def _probe(host: str, port: int, *, hold: bool = False) -> socket.socket:
    """Bind (host, port) as gRPC and ZMQ do (SO_REUSEADDR: a port in TIME_WAIT counts as free); the caller closes.
    `hold`: bind strictly and listen, so nobody else can take the port while it is held."""
    host = "0.0.0.0" if host in ("*", "") else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if not hold:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host.strip("[]"), port))
        if hold:
            s.listen()
    except BaseException:
        s.close()
        raise
    return s


def check_ports(bindings: list[Binding]) -> None:
    """Every (key, host, port) distinct and free to bind; port 0 (any free port) is skipped. Names the keys."""
    seen: dict[int, str] = {}
    for key, _, port in bindings:
        if not port:
            continue
        if port in seen:
            raise ConfigError(f"{key}={port} is also {seen[port]}: two services cannot bind one port")
        seen[port] = key
    for key, host, port in bindings:
        if not port:
            continue
        try:
            _probe(host, port).close()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{key}={port}: port {port} is already in use on {host} (another process listens "
                                  "there; pick another port or stop it)") from None
            if e.errno == errno.EACCES:
                raise ConfigError(f"{key}={port}: binding port {port} on {host} is not permitted (ports below 1024 "
                                  "need privileges)") from None
            raise ConfigError(f"{key}={port}: cannot bind {host}:{port}: {e.strerror or e}") from None


_HANDED_OUT: set[int] = set()
"""Ports this process picked before: a second call never returns one again (its service may not have bound yet)."""


def pick_free_ports(n: int, exclude: set[int] = frozenset(), host: str = "0.0.0.0") -> list[int]:
    """`n` distinct free ports, each held open until all are chosen, and never one in `exclude` or one handed out
    earlier in this process.

    Below the kernel's ephemeral range: the ports are chosen before the services start, and vLLM and ZMQ take
    ephemeral ports (bind to port 0) for their own sockets meanwhile, so a port from that range could be taken by
    the time its service binds it (seen as "Address already in use" for weights.announce_port).
    """
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    held: list[socket.socket] = []
    chosen: list[int] = []
    avoid = set(exclude) | _HANDED_OUT
    try:
        for _ in range(200 * n):
            if len(chosen) == n:
                break
            port = random.randrange(max(1024, low // 2), low)
            if port in avoid:
                continue
            avoid.add(port)
            try:
                held.append(_probe(host, port, hold=True))
            except OSError:
                continue
            chosen.append(port)
        while len(chosen) < n:  # a crowded range: fall back to what the kernel gives
            s = _probe("127.0.0.1", 0, hold=True)
            held.append(s)
            if s.getsockname()[1] not in avoid:
                chosen.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    _HANDED_OUT.update(chosen)
    return chosen
