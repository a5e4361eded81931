"""The contracts: generated code is fresh, importable under dgrpo.v1, and every field is documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(child_processes):
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], check=False,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr  # the stale file names, not just the exit code


def test_every_field_and_rpc_has_a_comment():
    for proto in (ROOT / "proto" / "dgrpo" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        assert "package dgrpo.v1;" in lines, proto
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = re.match(r"^(repeated |optional )?[\w.]+ \w+ = \d+;", stripped)
            is_rpc = stripped.startswith("rpc ")
            if (is_field or is_rpc) and not stripped.startswith("//"):
                previous = lines[i - 1].strip()
                assert previous.startswith("//") or "//" in line, f"{proto.name}:{i + 1} undocumented: {stripped}"


def test_service_descriptors_are_in_package_dgrpo_v1():
    from dgrpo.v1 import sampler_pb2

    assert sampler_pb2.DESCRIPTOR.package == "dgrpo.v1"
    assert "Sampler" in sampler_pb2.DESCRIPTOR.services_by_name
