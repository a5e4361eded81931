"""Two simulated hosts on this machine for tests: network namespaces joined by a veth pair, each with a private
/dev/shm, and processes that report JSON events.

    with TwoHosts("t1") as hosts:            # namespaces, link and tmpfs are removed on exit, whatever happened
        hosts.a.address, hosts.b.address     # 10.213.x.1 (host a), 10.213.x.2 (host b)
        proc = EventProcess(hosts.b.command([sys.executable, "peer.py", ...]), log_path)
        hosts.link(up=False)                 # the link goes down (host a's end), as a cable pulled
        hosts.drop_packets(on=True)          # host b drops every packet silently, the link up (a partition)
        hosts.cap_mbit(200)                  # tc htb on both ends of the veth

Traffic stays inside the namespaces the test created (the veth pair has no end in the machine's own namespace), and
each host's processes see only their host's /dev/shm (a tmpfs bind-mounted over /dev/shm in a private mount namespace
of each process, `unshare --mount`), so weight bytes can cross between the hosts only over the veth. Needs root, `ip`,
`tc` and `unshare`; `available()` says why not where they are missing.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_COUNTER = itertools.count()


def available() -> str | None:
    """None when two hosts can be simulated here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    netns: str
    veth: str
    address: str
    shm: Path

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host: its network namespace, a private mount namespace with its /dev/shm."""
        script = f'mount --bind {self.shm} /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]

    def tx_bytes(self) -> int:
        """Bytes sent by this host's end of the link so far."""
        out = _sh("ip", "netns", "exec", self.netns, "cat", f"/sys/class/net/{self.veth}/statistics/tx_bytes")
        return int(out.stdout)


class TwoHosts:
    """Hosts a and b (see the module docstring); a context manager that removes everything it made."""

    def __init__(self, tag: str, shm_mb: int = 1024):
        n = next(_COUNTER)
        base = f"dg{os.getpid() % 100000}{n}"
        subnet = f"10.213.{(os.getpid() + n) % 250}"
        self._dir = Path(tempfile.mkdtemp(prefix=f"dgrpo-hosts-{tag}-"))
        self.a = Host(f"{base}a", f"{base}va", f"{subnet}.1", self._dir / "shm-a")
        self.b = Host(f"{base}b", f"{base}vb", f"{subnet}.2", self._dir / "shm-b")
        self._shm_mb = shm_mb
        self._made: list[tuple[str, ...]] = []

    def __enter__(self) -> TwoHosts:  # noqa: PYI034  (py3.10: no typing.Self)
        try:
            for host in (self.a, self.b):
                host.shm.mkdir()
                _sh("mount", "-t", "tmpfs", "-o", f"size={self._shm_mb}m,mode=1777", "tmpfs", str(host.shm))
                self._made.append(("umount", str(host.shm)))
                _sh("ip", "netns", "add", host.netns)
                self._made.append(("ip", "netns", "del", host.netns))
            _sh("ip", "link", "add", self.a.veth, "type", "veth", "peer", "name", self.b.veth)
            for host in (self.a, self.b):
                _sh("ip", "link", "set", host.veth, "netns", host.netns)
                ns = ("ip", "netns", "exec", host.netns)
                _sh(*ns, "ip", "addr", "add", f"{host.address}/24", "dev", host.veth)
                _sh(*ns, "ip", "link", "set", host.veth, "up")
                _sh(*ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def link(self, up: bool) -> None:
        """Take host a's end of the link down (no packet crosses either way) or bring it back."""
        _sh("ip", "netns", "exec", self.a.netns, "ip", "link", "set", self.a.veth, "up" if up else "down")

    def drop_packets(self, on: bool) -> None:
        """Host b silently drops every packet on its end of the link, both ways, or stops dropping (iptables in b's
        namespace): a partition as a dead switch port or a firewall makes it, with no reset and no error, the link
        itself up. Needs `iptables`."""
        ns = ("ip", "netns", "exec", self.b.netns, "iptables")
        for chain, direction in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _sh(*ns, "-I" if on else "-D", chain, direction, self.b.veth, "-j", "DROP")

    def cap_mbit(self, mbit: int) -> None:
        """A tc htb bandwidth cap of `mbit` Mbit/s on both ends of the link."""
        for host in (self.a, self.b):
            ns = ("ip", "netns", "exec", host.netns, "tc")
            _sh(*ns, "qdisc", "replace", "dev", host.veth, "root", "handle", "1:", "htb", "default", "10")
            _sh(*ns, "class", "replace", "dev", host.veth, "parent", "1:", "classid", "1:10", "htb",
                "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")

    def __exit__(self, *exc) -> None:
        # Namespaces go with their processes' exit; a process still inside keeps its namespace alive but not its
        # name, and the tests stop theirs first. The veth pair goes with its namespaces.
        for step in reversed(self._made):
            _sh(*step, check=False)
        self._made.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


class EventProcess:
    """A process that prints one JSON event per line on stdout; `wait_for` reads them (all stay in `events`).
    `send(obj)` writes one JSON line to its stdin; closing stdin (`stop`) asks it to end."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None, events: bool = True):
        """`events=False`: a service that prints no events; its stdout goes to the log with its stderr."""
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE if events else log,
                                         stderr=log if events else subprocess.STDOUT, text=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                         start_new_session=True)
        self.events: list[dict] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._returned: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _pull(self, timeout: float) -> bool:
        try:
            line = self._lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if line is None:
            self._lines.put(None)
            return False
        self.events.append(json.loads(line))
        return True

    def wait_for(self, event: str, timeout: float = 60, **fields) -> dict:
        """The first event named `event` (with `fields`) that no earlier call returned."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if i not in self._returned and e["event"] == event and all(e.get(k) == v for k, v in fields.items()):
                    self._returned.add(i)
                    return e
            if not self._pull(deadline - time.monotonic()):
                raise AssertionError(f"no {event} {fields} from {self.log_path.name} (exit status {self.proc.poll()})"
                                     f"; events {self.events[-20:]}\nlog:\n{self.logs()[-4000:]}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        while self._pull(0.5):
            pass
        return self.proc.returncode

    def terminate(self) -> None:
        """SIGTERM (a service that does not read stdin); `stop` then waits for it."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)
