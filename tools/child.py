"""One tool call in a fresh process: `python -m dgrpo.tools.child`, the call as JSON on stdin, the result
as JSON on stdout. Run by ToolRunner (sandbox.py), never by hand.

Two processes, so that the code that enforces the limits never shares a process with the tool:
- the *keeper* (this process, started by the runner as a new session) builds the isolation, forks the tool, reads
  its result from a pipe (capped), and kills it when the wall-clock limit passes;
- the *tool* process drops every privilege, sets its rlimits and runs the tool, then writes one JSON result.

Levels (docs/tools.md):
- strict, as root: new pid, network, mount, ipc and uts namespaces (the keeper unshares, so the tool is pid 1 of its
  own pid namespace and the kernel kills every process it started when it ends or is killed — no escape by setsid
  or double fork); every mount remounted read-only except a bind of the per-call scratch folder; a private /proc;
  an unprivileged uid of its own (no signals to other calls, no writes through file permissions either);
  no_new_privs; Landlock on top where the kernel has it.
- strict, not root: a user namespace (needs unprivileged user namespaces) for the same pid/network namespaces, and
  Landlock (needed: it is what keeps writes inside the scratch folder without a mount namespace we could lock).
- process: only the separate process, its own process group, and the rlimits.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import json
import os
import resource
import select
import signal
import socket
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


def _mount(src: str | None, target: str, fstype: str | None, flags: int) -> None:
    _check(_libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       None), f"mount {target}")


# --- Landlock (kernel >= 5.13; ABI 4 adds TCP, ABI 6 scopes abstract unix sockets and signals) ---
_SYS_CREATE, _SYS_ADD, _SYS_RESTRICT = 444, 445, 446  # same numbers on x86_64 and aarch64


def landlock_abi() -> int:
    rc = _libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(0, rc)


def apply_landlock(writable: str) -> str:
    """Forbid writes everywhere but under `writable`, TCP bind/connect, abstract unix sockets and signals out of the
    domain (as far as the kernel's ABI goes); returns what was applied."""
    abi = landlock_abi()
    if abi == 0:
        return ""
    write = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))  # write file, remove, make *
    if abi >= 2:
        write |= 1 << 13  # REFER (rename/link across folders)
    if abi >= 3:
        write |= 1 << 14  # TRUNCATE
    net = 0b11 if abi >= 4 else 0
    scoped = 0b11 if abi >= 6 else 0
    attr = (ctypes.c_uint64 * 3)(write, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    fd = _check(_libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
                "landlock_create_ruleset")
    try:
        dfd = os.open(writable, os.O_PATH | os.O_DIRECTORY)
        rule = (ctypes.c_char * 12).from_buffer_copy(write.to_bytes(8, "little") + dfd.to_bytes(4, "little"))
        _check(_libc.syscall(_SYS_ADD, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule")
        os.close(dfd)
        nfd = os.open(os.devnull, os.O_PATH)  # writes to /dev/null stay harmless and common (subprocess.DEVNULL)
        rule = (ctypes.c_char * 12).from_buffer_copy((1 << 1).to_bytes(8, "little") + nfd.to_bytes(4, "little"))
        _check(_libc.syscall(_SYS_ADD, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)), "landlock_add_rule")
        os.close(nfd)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(_libc.syscall(_SYS_RESTRICT, fd, ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(fd)
    parts = ["fs writes"] + (["tcp"] if net else []) + (["abstract unix", "signals"] if scoped else [])
    return f"landlock abi {abi} ({', '.join(parts)})"


# --- keeper: namespaces and mounts ---
def _mounts() -> list[tuple[str, int]]:
    """(mount point, per-mount flags) of this mount namespace, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 for a space, etc.
            flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
            out.append((point, flags))
    return out


def _blocking_ancestor(path: str, itself: bool = False) -> str | None:
    """The highest folder on the way to `path` that an unrelated uid cannot traverse (e.g. /root, mode 700); with
    `itself`, a folder `path` that it cannot enter counts too (a checkout made by `mktemp -d` is 0700)."""
    parts = path.strip("/").split("/")
    for i in range(len(parts) + (1 if itself and os.path.isdir(path) else 0)):
        folder = "/" + "/".join(parts[:i])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _expose(paths: list[str], entered: frozenset[str] = frozenset()) -> list[str]:
    """Make `paths` reachable for the tool's uid although a parent (often /root, home of pyenv; pytest's 0700
    /tmp/pytest-of-<user>) is private: cover that parent with an empty tmpfs and bind back only these paths. Nothing
    else under it stays visible. A bound folder can hold a private folder deeper on the way to another path (the
    scratch below the checkout): each round uncovers one more level, until every path is reachable. A folder in
    `entered` must also be entered by the tool (our package's root, the tool file's folder): when it is private
    itself, it is covered in turn and each of its entries bound back."""
    shown: list[str] = []
    wanted = sorted({p for p in paths if os.path.exists(p)})  # sorted: a folder comes before what is inside it
    for _ in range(16):
        by_parent: dict[str, list[str]] = {}
        for p in wanted:
            parent = _blocking_ancestor(p, itself=p in entered)
            if parent is None:
                continue  # reachable as it is
            inner = by_parent.setdefault(parent, [])
            if parent == p:  # the folder itself is private: its entries go back, not the folder
                entries = (os.path.join(p, e) for e in sorted(os.listdir(p)))
                inner.extend(q for q in entries if os.path.exists(q) and q not in inner)  # not dangling links
                continue
            if not any(p == q or p.startswith(q + "/") for q in inner):  # bound with a folder above it
                inner.append(p)
        if not by_parent:
            return shown
        for parent, inner in by_parent.items():
            fds = {p: os.open(p, os.O_PATH) for p in inner}
            _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV)
            os.chmod(parent, 0o755)
            for p, fd in fds.items():
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.makedirs(p, exist_ok=True)
                else:
                    _touch(p)
                _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
                os.close(fd)
                shown.append(p)
    raise OSError(errno.EACCES, f"private folders nested too deep on the way to {wanted}")


def _touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "a").close()


def _readonly_except(scratch: str, needed: list[str]) -> list[str]:
    """Remount every mount read-only except a bind of `scratch` onto itself (the only writable place); returns
    the paths re-exposed behind a private parent."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates back to the host
    _mount(scratch, scratch, None, MS_BIND)
    shown = _expose([*needed, scratch], entered=frozenset(needed))
    failed = []
    for point, flags in _mounts():
        if point == scratch:
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EACCES):  # shadowed points we cannot reach, gone or hidden
                failed.append(f"{point}: {e.strerror}")
    if failed:
        raise OSError(errno.EPERM, "cannot make read-only: " + "; ".join(failed[:5]))
    return shown


def _needed_paths(req: dict) -> list[str]:
    """What the tool process reads: the interpreter, its libraries, our package, the user's tool file's folder."""
    import site

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # <root>/tools/child.py -> <root>
    paths = [sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable)), here,
             *site.getsitepackages(), *(p for p in sys.path if p and os.path.isdir(p))]
    if req["target"]["kind"] == "file":
        paths.append(os.path.dirname(req["target"]["target"].rsplit(":", 1)[0]))
    return [os.path.realpath(p) for p in paths]


def _setup_keeper(req: dict) -> list[str]:
    """Build the namespaces for a strict call; returns the layers in effect."""
    scratch = req["scratch"]
    if os.geteuid() == 0:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        shown = _readonly_except(scratch, _needed_paths(req))
        layers = ["namespaces pid,net,mount,ipc,uts", "read-only filesystem except scratch"]
        return layers + ([f"private parents hidden (re-exposed: {len(shown)} interpreter paths)"] if shown else [])
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare(user)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    return ["namespaces user,pid,net,ipc,uts"]


# --- tool process ---
def _load(target: dict):
    """The tool function; a user file's source is read now (before privileges go) and run later."""
    if target["kind"] == "builtin":
        from dgrpo.tools import builtins

        fn = {"calculator": builtins.calculator, "python": builtins.python, "_probe": _probe}[target["target"]]
        return lambda: fn
    path, func = target["target"].rsplit(":", 1)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")

    def resolve():
        sys.path.insert(0, os.path.dirname(path))
        scope = {"__name__": "dgrpo_user_tool", "__file__": path}
        exec(code, scope)  # noqa: S102 - the user's tool module, run inside the sandbox
        if not callable(scope.get(func)):
            raise TypeError(f"{path} defines no function {func!r}")
        return scope[func]

    return resolve


def _probe() -> str:
    """What the sandbox actually prevents, checked from inside (ToolRunner runs it once at start)."""
    found = {"uid": os.getuid()}
    try:
        with open("/dgrpo-sandbox-probe", "w"):
            found["write_root"] = "allowed"
        os.unlink("/dgrpo-sandbox-probe")
    except OSError as e:
        found["write_root"] = e.strerror
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect(("127.0.0.1", 9))
        found["connect"] = "allowed"
    except OSError as e:
        found["connect"] = e.strerror or type(e).__name__
    finally:
        s.close()
    found["pid"] = os.getpid()
    return json.dumps(found)


def _truncate(text: str, limit: int, side: str) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    marker = f"[... {len(text) - limit} characters cut ...]"
    keep = max(0, limit - len(marker))
    if side == "left":
        return marker + text[len(text) - keep:], True
    if side == "right":
        return text[:keep] + marker, True
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):], True


def _drop_and_limit(req: dict, layers: list[str]) -> None:
    lim = req["limits"]
    scratch = req["scratch"]
    strict = req["level"] == "strict"
    if strict and os.geteuid() == 0:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            layers.append("private /proc")
        except OSError:
            pass
        uid = req["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        layers.append(f"uid {uid}")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if strict:
        applied = apply_landlock(scratch)
        if applied:
            layers.append(applied)
        elif os.geteuid() != 0 and req["uid"] is None:
            raise OSError(errno.ENOSYS, "strict isolation without root needs Landlock, which this kernel lacks")
    mem = lim["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max(mem, 16 << 20),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    cpu = int(lim["timeout_s"]) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if req["uid"] is not None:  # NPROC counts per uid: only meaningful for a uid of its own
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    layers.append("rlimits as,fsize,core,nofile,cpu" + (",nproc" if req["uid"] is not None else ""))
    os.chdir(scratch)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch,
                       "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})


def _tool_main(req: dict, out_fd: int, layers: list[str]) -> None:
    """In the forked tool process; never returns."""
    result: dict
    try:
        os.setpgid(0, 0)  # process level: a group of its own, killed as one
        resolve = _load(req["target"])
        null = os.open(os.devnull, os.O_RDWR)
        _drop_and_limit(req, layers)
        for fd in (0, 1, 2):  # the tool's own prints go nowhere; the result travels on out_fd only
            os.dup2(null, fd)
        fn = resolve()
        args = dict(req["arguments"])
        if req["target"] == {"kind": "builtin", "target": "python"}:
            args["_output_limit"] = req["limits"]["max_output_chars"]
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            result = {"ok": False, "text": f"bad arguments: {e}", "error": "bad_arguments"}
        else:
            value = fn(**args)
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
            text, cut = _truncate(text, req["limits"]["max_output_chars"], req["limits"]["truncate_side"])
            result = {"ok": True, "text": text, "error": "output_truncated" if cut else None}
    except MemoryError:
        result = {"ok": False, "text": f"memory limit of {req['limits']['memory_mb']} MB exceeded", "error": "memory"}
    except BaseException as e:  # noqa: BLE001 - any failure of the tool is its answer, for the model to read
        text, _ = _truncate(f"{type(e).__name__}: {e}", req["limits"]["max_output_chars"], "right")
        result = {"ok": False, "text": text, "error": "error"}
    result["layers"] = layers
    data = json.dumps(result, ensure_ascii=False).encode()
    try:
        while data:
            data = data[os.write(out_fd, data):]
    finally:
        os._exit(0)


def _keeper_wait(pid: int, r: int, req: dict) -> dict:
    """Collect the tool's result; kill it at the wall-clock limit or when it writes more than a result can be."""
    lim = req["limits"]
    cap = 6 * lim["max_output_chars"] + 65536  # JSON escaping can grow text up to 6x
    deadline = time.monotonic() + lim["timeout_s"]
    pidfd = os.pidfd_open(pid)
    chunks, size, exited, reason = [], 0, False, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        ready, _, _ = select.select([r, pidfd] if r >= 0 else [pidfd], [], [], left)
        if r in ready:
            data = os.read(r, 65536)
            if not data:
                os.close(r)
                r = -1
            else:
                chunks.append(data)
                size += len(data)
                if size > cap:
                    reason = "oversize"
                    break
        if pidfd in ready:
            exited = True
            break
    if not exited:
        os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace (strict): the kernel kills all it started
    if req["level"] != "strict":
        try:
            os.killpg(pid, signal.SIGKILL)  # what the tool left behind in its group
        except (ProcessLookupError, PermissionError):
            pass
    _, status = os.waitpid(pid, 0)
    if r >= 0 and reason is None:
        os.set_blocking(r, False)
        try:
            while (data := os.read(r, 65536)) and size <= cap:
                chunks.append(data)
                size += len(data)
        except BlockingIOError:
            pass
    if reason == "timeout":
        return {"ok": False, "text": f"timed out after {lim['timeout_s']:g} s (killed)", "error": "timeout"}
    if reason == "oversize":
        return {"ok": False, "text": "the tool wrote more output than a result can hold (killed)",
                "error": "output_truncated"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        sig = -os.waitstatus_to_exitcode(status)
        why = f"killed by {signal.Signals(sig).name}" if sig > 0 else f"exit status {-sig}"
        return {"ok": False, "text": f"the tool process ended without a result ({why})", "error": "error"}


def main() -> None:
    req = json.loads(sys.stdin.buffer.read())
    layers: list[str] = []
    try:
        if req["level"] == "strict":
            layers += _setup_keeper(req)
        r, w = os.pipe()
        pid = os.fork()  # after unshare(CLONE_NEWPID): the child is pid 1 of the new namespace
    except OSError as e:
        result = {"ok": False, "text": f"sandbox setup failed: {e}", "error": "error", "setup_failed": True}
    else:
        if pid == 0:
            os.close(r)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _tool_main(req, w, layers)
        os.close(w)
        result = _keeper_wait(pid, r, req)
    sys.stdout.write(json.dumps(result, ensure_ascii=False))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
