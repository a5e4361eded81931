"""The tier plugin (tests/tiers.py) on its own: the tier read from a fixture closure, what a command line starts,
and the guard's verdict for a test that starts what its tier may not."""

from __future__ import annotations

import sys

import pytest
import tiers


@pytest.mark.parametrize(("fixtures", "tier"), [
    (("tmp_path",), "unit"),
    (("tmp_path", "child_processes"), "integration"),
    (("child_processes", "launcher", "docker_ready"), "e2e"),
])
def test_the_tier_follows_the_fixture_closure(fixtures, tier):
    assert tiers.tier_of(fixtures) == tier


@pytest.mark.parametrize(("argv", "kind"), [
    ([sys.executable, "-m", "dgrpo.cli", "up", "--samplers", "2"], "stacks"),
    (["bash", "/repo/scripts/run.sh"], "stacks"),
    ([sys.executable, "-m", "dgrpo.cli", "sampler", "sampler.port=5"], "engines"),
    (["/venv/bin/dgrpo", "rewarder"], "services"),
    (["bash", "/repo/deploy/build.sh", "cpu"], "images"),
    (["docker", "compose", "-p", "x", "up", "-d"], "containers"),
    (["docker", "run", "--rm", "dgrpo:cpu"], "containers"),
    ("ip netns add dgrpo-h1", "netns"),
    (["slurmctld", "-D"], "schedulers"),
    # Whole words only: a path holding /run/ or /up/ is no subcommand.
    (["cat", "/var/run/up/dgrpo/token"], None),
    (["docker", "logs", "abc"], None),
])
def test_what_a_command_starts_is_read_from_whole_words(argv, kind):
    assert tiers.what_starts(argv) == kind


@pytest.mark.parametrize(("argv", "probe"), [
    (["uname", "-p"], True),
    (["/usr/bin/file", "-b", sys.executable], True),
    (["true"], False),
    ([sys.executable, "-c", "pass"], False),
])
def test_the_platform_modules_probes_are_not_a_tests_processes(argv, probe):
    assert tiers._is_platform_probe(argv) is probe


class _Item:
    def __init__(self, tier: str):
        self.nodeid, self.stash = f"tests/test_x.py::test_{tier}", {tiers._TIER: tier}


@pytest.mark.parametrize(("tier", "argv", "names"), [
    ("unit", ["true"], "request `child_processes`"),
    ("integration", ["docker", "compose", "up", "-d"], "request `launcher`"),
    ("integration", [sys.executable, "-m", "dgrpo.cli", "sampler"], None),
    ("e2e", [sys.executable, "-m", "dgrpo.cli", "up"], None),
])
def test_the_guard_names_the_fixture_a_test_must_request(monkeypatch, tier, argv, names):
    """What the guard records for a test of `tier` starting `argv` (reported as the test's failure); checked on a
    stand-in for the running test so that this test itself starts nothing."""
    running = {"item": _Item(tier), "violations": []}
    monkeypatch.setattr(tiers, "_running", running)
    tiers._check_unit(f"a process ({' '.join(argv)})")
    tiers._check_integration(argv, tiers.what_starts(argv))
    if names is None:
        assert running["violations"] == []
    else:
        assert len(running["violations"]) == 1 and names in running["violations"][0], running["violations"]
