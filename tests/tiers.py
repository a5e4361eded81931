"""The suite's three tiers, decided from what a test uses (docs/testing.md).

- `unit`: no child process. The math, the configs, the parsers, the codecs, in-process servers.
- `integration`: real vLLM engines, gRPC services, shared memory, each in processes of their own. A test (or one of
  its fixtures) requests `child_processes`.
- `e2e`: a launcher as users run it: `dgrpo up`, the shipped compose file and image, the Kubernetes pod specs, hosts
  as network namespaces. A test (or one of its fixtures) requests `launcher`.

The marker is set here from the test's fixture closure, never by hand, and a guard holds each test to its tier: a
unit test that starts a process, or an integration test that runs a launcher's command, fails naming the fixture to
request. Each tier has a per-test time limit (pytest-timeout), so a hung test fails by name instead of eating CI's.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

TIERS = ("unit", "integration", "e2e")
# Seconds a test may take, its fixtures' set-up and tear-down included (a module's first test pays for its engines).
TIME_LIMITS = {"unit": 120, "integration": 300, "e2e": 480}

# What only an e2e test starts (what_starts below): a stack through a launcher, containers or an image build, a
# network namespace (a simulated host), a batch scheduler.
_LAUNCHES = {"stacks", "containers", "images", "netns", "schedulers"}
_TIER = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def child_processes():
    """Requested (directly or through a fixture) by every test that starts a process: it makes the test
    `integration`. Yields nothing; the guard below lets the test's processes start."""
    yield


@pytest.fixture(scope="session")
def launcher(child_processes):
    """Requested by every test that runs a launcher as users do: it makes the test `e2e`."""
    yield


def tier_of(fixturenames: list[str] | tuple[str, ...]) -> str:
    if "launcher" in fixturenames:
        return "e2e"
    if "child_processes" in fixturenames:
        return "integration"
    return "unit"


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: set by tests/tiers.py from the fixtures a test requests")
    _install_guard()


def pytest_collection_modifyitems(config, items):
    for item in items:
        by_hand = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if by_hand:
            raise pytest.UsageError(f"{item.nodeid}: marked {by_hand[0]!r} by hand; tiers follow from the fixtures "
                                    "a test requests (tests/tiers.py)")
        tier = item.stash[_TIER] = tier_of(getattr(item, "fixturenames", ()))
        item.add_marker(getattr(pytest.mark, tier))
        item.user_properties.append(("tier", tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIME_LIMITS[tier]))
    # Cheapest first: a run of several tiers reports a broken unit before it starts an engine.
    items.sort(key=lambda item: TIERS.index(item.stash[_TIER]))


# ---- the guard ----------------------------------------------------------------------------------------------------

_running: dict = {"item": None, "violations": []}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.update(item=item, violations=[])
    try:
        yield
    finally:
        _running.update(item=None, violations=[])


def _running_tier() -> str | None:
    item = _running["item"]
    return item.stash.get(_TIER, None) if item is not None else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that left its tier fails, naming what it started and the fixture to request. Recorded where the
    process started (which may be a thread of the test's), reported here, so the run itself is never disturbed."""
    outcome = yield
    report = outcome.get_result()
    violations = _running["violations"] if _running["item"] is item else []
    if violations and report.when in ("call", "teardown") and report.passed:
        report.outcome = "failed"
        report.longrepr = "\n".join(dict.fromkeys(violations))
        violations.clear()


def _words(argv) -> list[str]:
    """A command line as subprocess takes it (a string or a sequence of str/paths), as words."""
    return argv.split() if isinstance(argv, str) else [os.fspath(a) for a in argv]


def what_starts(argv) -> str | None:
    """The kind of expensive thing a command starts, for the per-module table (scripts/test_report.py) and the guard.
    Read from whole argv words, so a path that merely contains `run` or `up` is not taken for a subcommand."""
    words = _words(argv)
    tool = os.path.basename(words[0]) if words else ""
    after = {words[i + 1] for i, w in enumerate(words[:-1]) if w in ("dgrpo", "dgrpo.cli") or w.endswith("/dgrpo")}
    if "up" in after or any(w.endswith("scripts/run.sh") for w in words):
        return "stacks"
    if "sampler" in after:
        return "engines"
    if after & {"rewarder", "learner"}:
        return "services"
    if any(w.endswith("deploy/build.sh") for w in words) or (tool == "docker" and words[1:2] == ["build"]):
        return "images"
    if tool in ("docker", "docker-compose") and set(words[1:]) & {"up", "run", "start", "create"}:
        return "containers"
    if tool == "ip" and "netns" in words and "add" in words:
        return "netns"
    if tool in ("slurmctld", "slurmd", "sbatch", "srun", "salloc"):
        return "schedulers"
    return None


def _count(kind: str | None) -> None:
    """One more `kind` started by the running test (its fixtures' set-up included): a junit property per kind."""
    item = _running["item"]
    if kind is None or item is None:
        return
    counts = dict(item.user_properties)
    item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != kind]
    item.user_properties.append((kind, int(counts.get(kind, 0)) + 1))


def _check_unit(what: str) -> None:
    if _running_tier() == "unit":
        _running["violations"].append(
            f"{_running['item'].nodeid} is a unit test (it requests neither `child_processes` nor `launcher`) and "
            f"started {what}: request `child_processes` (or a fixture that does) to make it an integration test "
            "(docs/testing.md)")


def _check_integration(argv, kind: str | None) -> None:
    if _running_tier() == "integration" and kind in _LAUNCHES:
        words = _words(argv)
        _running["violations"].append(
            f"{_running['item'].nodeid} is an integration test and ran a launcher's command ({' '.join(words)[:120]}): "
            "request `launcher` (or a fixture that does) to make it e2e (docs/testing.md)")


# Read-only probes the standard library's `platform` module runs when a library asks what machine this is (`uname -p`,
# `file -b <python>`: vLLM's first import does): nothing a test starts, and whether a unit test's import is the first
# depends on which tests ran before it.
_PLATFORM_PROBES = {"uname", "file"}


def _is_platform_probe(args) -> bool:
    words = _words(args)
    return bool(words) and os.path.basename(words[0]) in _PLATFORM_PROBES


def _install_guard() -> None:
    """Wrap every way a process starts in the test process: subprocess (asyncio's too), multiprocessing, fork."""
    if getattr(subprocess.Popen, "_dgrpo_tier_guard", False):
        return
    execute_child = subprocess.Popen._execute_child

    def guarded_execute_child(self, args, *rest, **kwargs):
        if _is_platform_probe(args):
            return execute_child(self, args, *rest, **kwargs)
        _check_unit(f"a process ({args if isinstance(args, str) else ' '.join(map(os.fspath, args))})"[:200])
        kind = what_starts(args)  # read once: the guard and the count both need it
        _check_integration(args, kind)
        _count(kind)
        return execute_child(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = guarded_execute_child
    subprocess.Popen._dgrpo_tier_guard = True

    start = multiprocessing.process.BaseProcess.start

    def guarded_start(self):
        _check_unit(f"a multiprocessing process ({self.name})")
        _count("engines" if str(self.name).startswith("EngineCore") else None)
        return start(self)

    multiprocessing.process.BaseProcess.start = guarded_start

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        original = getattr(os, name, None)
        if original is None:
            continue

        def guarded(*args, _original=original, _name=name, **kwargs):
            _check_unit(f"os.{_name}")
            return _original(*args, **kwargs)

        setattr(os, name, guarded)
