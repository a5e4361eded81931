"""The tool sandbox with real processes: built-ins, a user tool, and hostile tools that must be contained.

Each hostile case also checks the effect from outside (the file is absent, the server saw no connection, no process
of the call is left), so a sandbox that silently let the tool through fails the test, not only one that errs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dgrpo.tools import ToolCall, ToolLimits, ToolRunner, load_tool_config
from dgrpo.tools.spec import builtin_toolset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools" / "tool_config.yaml"
REPO = Path(__file__).resolve().parents[2]

HOSTILE = '''
import os, socket, subprocess, sys, time

def sleep_forever(marker: str) -> str:
    # a child in a new session (escapes the process group), then hang
    subprocess.Popen(["/bin/sh", "-c", f"sleep 1000; echo {marker}"], start_new_session=True)  # marker in cmdline
    time.sleep(1e9)

def spin() -> str:
    while True:
        pass

def allocate(gb: int) -> str:
    x = bytearray(gb << 30)
    return str(len(x))

def connect(port: int) -> str:
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.sendall(b"escaped")
    return "connected"

def write(path: str) -> str:
    with open(path, "w") as f:
        f.write("escaped")
    return "written"

def write_scratch() -> str:
    with open("note.txt", "w") as f:
        f.write("ok")
    return open("note.txt").read() + " " + os.getcwd()

def huge() -> str:
    return "x" * 5_000_000

def flood() -> str:
    os.write(1, b"y" * 10_000_000)  # straight to fd 1: must not reach or break the result
    return "done"

def boom() -> str:
    raise RuntimeError("tool failed on purpose")
'''


def _schema(name: str, **props: str) -> str:
    p = ", ".join(f"{k}: {{type: {t}}}" for k, t in props.items())
    return (f"  - class_name: file:hostile.py:{name}\n    tool_schema: {{type: function, function: {{name: {name}, "
            f"parameters: {{type: object, properties: {{{p}}}}}}}}}\n")


@pytest.fixture(scope="module")
def hostile_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    (d / "hostile.py").write_text(textwrap.dedent(HOSTILE))
    cfg = "tools:\n" + "".join([
        _schema("sleep_forever", marker="string"), _schema("spin"), _schema("allocate", gb="integer"),
        _schema("connect", port="integer"), _schema("write", path="string"), _schema("write_scratch"),
        _schema("huge"), _schema("flood"), _schema("boom")])
    (d / "tools.yaml").write_text(cfg)
    return load_tool_config(d / "tools.yaml")


@pytest.fixture(scope="module")
def runner(child_processes, hostile_set, tmp_path_factory):
    specs = {**hostile_set.specs, **builtin_toolset("calculator", "python").specs}
    r = ToolRunner(type(hostile_set)(specs), ToolLimits(timeout_s=2, memory_mb=512, max_output_chars=2000),
                   tmp_path_factory.mktemp("scratch"))
    yield r
    r.close()


def call(r: ToolRunner, name: str, **args):
    return r.run(ToolCall(name, args, ""))


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_isolation_is_strict_here(runner):
    assert runner.isolation.startswith("strict: "), runner.isolation
    assert "net" in runner.isolation and "read-only filesystem" in runner.isolation


def test_builtins_run_in_the_sandbox(runner):
    r = call(runner, "calculator", expression="987654321 * 123456789")
    assert (r.ok, r.error, r.text) == (True, None, "121932631112635269")
    assert 0 < r.seconds < 10
    r = call(runner, "calculator", expression="9**9**9")
    assert not r.ok and r.error == "error" and "exponent" in r.text
    r = call(runner, "python", code="import os\nprint(sum(range(10)), os.getuid() != 0, os.getpid())")
    assert r.ok and r.text == "45 True 1\n"  # pid 1: its own pid namespace


def test_user_tool_from_the_example_config(child_processes, tmp_path):
    r = ToolRunner(load_tool_config(EXAMPLE), ToolLimits(timeout_s=5), tmp_path / "s")
    res = r.run(ToolCall("unit_convert", {"value": 1, "from_unit": "mi", "to_unit": "km"}, ""))
    assert (res.ok, res.text) == (True, "1.60934 km")
    res = r.run(ToolCall("code_interpreter", {"code": "print(2**10)"}, ""))
    assert (res.ok, res.text) == (True, "1024\n")
    res = r.run(ToolCall("unit_convert", {"value": 1, "from_unit": "mi", "to_unit": "parsec"}, ""))
    assert (res.ok, res.error) == (False, "bad_arguments") and "parsec" in res.text


def test_unknown_tool_and_bad_arguments(runner):
    r = call(runner, "nope")
    assert (r.ok, r.error) == (False, "unknown_tool") and "calculator" in r.text
    assert call(runner, "calculator").error == "bad_arguments"
    assert call(runner, "calculator", expression=12).error == "bad_arguments"
    assert call(runner, "calculator", expression="1", extra=1).error == "bad_arguments"
    r = call(runner, "boom")
    assert (r.ok, r.error) == (False, "error") and "tool failed on purpose" in r.text


def test_sleep_forever_times_out_and_leaves_no_process(runner):
    marker = f"dgrpo-hostile-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    r = call(runner, "sleep_forever", marker=marker)
    assert (r.ok, r.error) == (False, "timeout")
    assert time.monotonic() - t0 < 2 + 5
    assert r.seconds >= 2  # the shell started (a failed spawn would end the call early with an error)
    deadline = time.monotonic() + 3
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []  # the setsid'd grandchild died with the pid namespace


def test_busy_loop_times_out(runner):
    r = call(runner, "spin")
    assert (r.ok, r.error) == (False, "timeout") and r.seconds < 2 + 5


def test_ten_gigabytes_is_a_memory_error(runner):
    r = call(runner, "allocate", gb=10)
    assert (r.ok, r.error) == (False, "memory"), r
    assert call(runner, "allocate", gb=0).ok  # the tool itself works


def test_no_network_to_a_listening_loopback_server(runner):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    got: list[bytes] = []

    def accept():
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            got.append(conn.recv(100))
            conn.close()

    t = threading.Thread(target=accept)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as probe:  # the server is reachable from outside
            probe.sendall(b"probe")
        r = call(runner, "connect", port=port)
    finally:
        t.join()
        server.close()
    assert (r.ok, r.error) == (False, "error") and "connected" not in r.text
    assert got == [b"probe"]  # only our own probe got through


@pytest.mark.parametrize("where", ["/etc", str(REPO), "/tmp"])
def test_writes_outside_scratch_fail(runner, where):
    target = Path(where) / f"dgrpo-hostile-{uuid.uuid4().hex[:8]}"
    r = call(runner, "write", path=str(target))
    assert (r.ok, r.error) == (False, "error") and "written" not in r.text
    assert not target.exists()


def test_scratch_is_writable_and_private_to_the_call(runner):
    r = call(runner, "write_scratch")
    assert r.ok and r.text.startswith("ok ") and str(runner.scratch_root) in r.text
    assert not Path(r.text.split(" ", 1)[1]).exists()  # removed after the call


def test_huge_output_is_truncated(runner):
    r = call(runner, "huge")
    assert (r.ok, r.error) == (True, "output_truncated")
    assert len(r.text) <= 2000 and "characters cut" in r.text
    r = call(runner, "flood")
    assert (r.ok, r.text) == (True, "done")
    r = call(runner, "python", code="print('z' * 10**6)")
    assert r.ok and len(r.text) <= 2000


def test_eight_concurrent_calls(runner):
    exprs = [f"{i} * 1000003" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda e: call(runner, "calculator", expression=e), exprs))
    assert [r.text for r in results] == [str(i * 1000003) for i in range(8)]
    assert all(r.ok for r in results)


def test_process_level_says_it_is_unconfined(child_processes, tmp_path):
    r = ToolRunner(builtin_toolset("calculator"), ToolLimits(timeout_s=2), tmp_path / "s", sandbox="process")
    assert r.isolation.startswith("process: ") and "NOT confined" in r.isolation
    assert r.run(ToolCall("calculator", {"expression": "6*7"}, "")).text == "42"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_strict_refuses_to_start_without_cap_sys_admin(child_processes, tmp_path):
    """Root without CAP_SYS_ADMIN (docker's default) cannot build the namespaces: strict refuses, process runs."""
    script = ("from dgrpo.tools import ToolRunner, ToolLimits, SandboxUnavailable\n"
              "from dgrpo.tools.spec import builtin_toolset\n"
              "import sys\n"
              "try:\n"
              f"    ToolRunner(builtin_toolset('calculator'), ToolLimits(), {str(tmp_path / 'a')!r})\n"
              "    print('STARTED')\n"
              "except SandboxUnavailable as e:\n"
              "    print('REFUSED', e)\n"
              f"r = ToolRunner(builtin_toolset('calculator'), ToolLimits(), {str(tmp_path / 'b')!r}, "
              "sandbox='process')\n"
              "print(r.isolation)\n")
    out = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", sys.executable, "-c",
                          script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first.startswith("REFUSED strict tool sandbox unavailable here") and "sandbox=process" in first
    assert second.startswith("process: ")


def test_scratch_behind_private_folders_below_the_tools_folder(child_processes, tmp_path):
    """The tool's own folder is a path the sandbox shows; the scratch sits below it behind two more private (0700)
    folders, as a checkout under /tmp holds pytest's 0700 /tmp/pytest-of-<user>: each private level is uncovered,
    and the call writes its scratch."""
    shared = tmp_path / "checkout"
    shared.mkdir()
    (shared / "mine.py").write_text("import os\n\ndef here():\n    open('f', 'w').write('x')\n    return os.getcwd()\n")
    (shared / "tools.yaml").write_text(_schema("here").replace("hostile.py", "mine.py").join(["tools:\n", ""]))
    private = shared / "private" / "deeper"
    private.mkdir(parents=True)
    for folder in (shared / "private", private):
        folder.chmod(0o700)
    r = ToolRunner(load_tool_config(shared / "tools.yaml"), ToolLimits(timeout_s=5), private / "scratch")
    try:
        res = r.run(ToolCall("here", {}, ""))
        assert res.ok and res.text.startswith(str(private / "scratch")), res
    finally:
        r.close()


def test_a_private_tool_folder_is_entered(child_processes, tmp_path):
    """The tool file's folder (like a checkout made by `mktemp -d`, the package root then) is 0700 itself: the
    sandbox shows its entries, and the call imports the user's file from it."""
    shared = tmp_path / "checkout"
    shared.mkdir()
    (shared / "mine.py").write_text("import helper\n\ndef here():\n    return helper.WORD\n")
    (shared / "helper.py").write_text("WORD = 'found'\n")
    (shared / "tools.yaml").write_text(_schema("here").replace("hostile.py", "mine.py").join(["tools:\n", ""]))
    shared.chmod(0o700)
    r = ToolRunner(load_tool_config(shared / "tools.yaml"), ToolLimits(timeout_s=5), tmp_path / "scratch")
    try:
        res = r.run(ToolCall("here", {}, ""))
        assert res.ok and res.text == "found", res
    finally:
        r.close()
