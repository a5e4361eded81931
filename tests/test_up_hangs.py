"""`dgrpo up --samplers 2` on the tiny model, with services that hang instead of dying (their whole process group
SIGSTOPped: what a stuck host, a GC-paused node or a half-dead container looks like from the outside: no error, no
closed connection). Training goes on through each, with the shipped keepalive, progress and --hung-restart-s
defaults:

1. a sampler frozen for a bounded time shorter than --hung-restart-s: steps keep training on the other replica
   while it is frozen; resumed, it is used again, and never restarted;
2. a sampler that stays frozen: `up` kills and restarts it after --hung-restart-s, training goes on meanwhile;
3. the rewarder frozen: its calls fail on keepalive and wait, `up` restarts it, training goes on;
4. the learner frozen: the samplers and the rewarder keep answering SERVING, and training goes on once it resumes.

Every freeze is undone in `finally` (SIGCONT), and `up` is stopped with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from support import wait_serving
from up_support import listener_pid, stop_up, up_command, wait_for

from dgrpo.cli import procs

pytestmark = pytest.mark.slow

HUNG_RESTART_S = 60  # `dgrpo up --hung-restart-s`'s default, which this run keeps
LEARNER_FREEZE_S = 30  # the learner's freeze: half of HUNG_RESTART_S, so `up` leaves it alone


def _records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    # Only whole lines: the learner may be writing the last one while this reads (CI once caught one half-written).
    complete = metrics.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip() and "reward/mean" in line]


def _group(port: int) -> list[int]:
    pid = listener_pid(port)
    assert pid is not None, f"nothing listens on {port}"
    return procs.group_pids(os.getpgid(pid))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_frozen_samplers_and_rewarder_never_stall_training(launcher, tiny_model, tmp_path):
    run_dir = tmp_path / "runs" / "hang"
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            up_command(tiny_model, tmp_path, "hang", 1000, "--samplers", "2"),
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = run_dir / "metrics.jsonl"
    frozen: list[int] = []
    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (run_dir / "stack.yaml").read_text()), 60, "no stack.yaml", proc, log_path)
        ports = [int(a.rsplit(":", 1)[1]) for a in stack["sampler"]["addresses"]]
        wait_for(lambda: _records(metrics), 400, "no training step finished", proc, log_path)

        # 1. sampler-1 frozen, then resumed before --hung-restart-s.
        frozen = _group(ports[1])
        _signal(frozen, signal.SIGSTOP)
        frozen_at = _records(metrics)[-1]["step"]
        started = time.monotonic()
        wait_for(lambda: _records(metrics)[-1]["step"] >= frozen_at + 2, HUNG_RESTART_S - 10,
                 "training stalled behind the frozen sampler", proc, log_path)
        assert time.monotonic() - started < HUNG_RESTART_S
        assert all(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for pid in frozen)
        _signal(frozen, signal.SIGCONT)
        frozen, resumed_at = [], _records(metrics)[-1]["step"]
        wait_for(lambda: any(r.get("rollout/groups_by_replica/sampler-1", 0) > 0
                             for r in _records(metrics)[resumed_at:]), 120, "the resumed sampler is not used", proc,
                 log_path)

        # 2. sampler-0 frozen for good: restarted by `up`, training goes on meanwhile.
        frozen = _group(ports[0])
        _signal(frozen, signal.SIGSTOP)
        frozen_at = _records(metrics)[-1]["step"]
        wait_for(lambda: "sampler-0 has not answered its health check" in log_path.read_text(), HUNG_RESTART_S + 30,
                 "the frozen sampler-0 was not killed", proc, log_path)
        assert _records(metrics)[-1]["step"] >= frozen_at + 3, "training waited for the frozen sampler-0"
        killed_sampler, frozen = frozen, []

        # 3. The rewarder frozen for good while sampler-0 starts again (its start-up takes minutes on 2 cores shared
        # with a training learner; the two hangs overlap as they would on a bad day): its calls wait, `up` restarts
        # it, training goes on.
        frozen = _group(stack["rewarder"]["port"])
        _signal(frozen, signal.SIGSTOP)
        frozen_at = _records(metrics)[-1]["step"]
        wait_for(lambda: "rewarder is back" in log_path.read_text(), HUNG_RESTART_S + 120,
                 "the frozen rewarder was not restarted", proc, log_path)
        frozen = []
        wait_for(lambda: "sampler-0 is back" in log_path.read_text(), 900, "sampler-0 was not restarted", proc,
                 log_path)
        assert not [p for p in killed_sampler if Path(f"/proc/{p}").exists()], "the frozen group was not reaped"
        wait_for(lambda: _records(metrics)[-1]["step"] >= frozen_at + 2, 300, "no steps after the rewarder restart",
                 proc, log_path)

        # 4. The learner frozen (shorter than --hung-restart-s): the samplers and the rewarder stay SERVING
        # throughout, and serve it again once it resumes.
        frozen = _group(stack["weights"]["announce_port"])
        _signal(frozen, signal.SIGSTOP)
        frozen_at = _records(metrics)[-1]["step"]
        started = time.monotonic()
        while time.monotonic() - started < LEARNER_FREEZE_S:
            for port in [*ports, stack["rewarder"]["port"]]:
                wait_serving(f"127.0.0.1:{port}", 10)  # TimeoutError: a service stopped serving meanwhile
            time.sleep(2)
        _signal(frozen, signal.SIGCONT)
        frozen = []
        wait_for(lambda: _records(metrics)[-1]["step"] >= frozen_at + 2, 300, "no steps after the learner resumed",
                 proc, log_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 130, log_path.read_text()[-5000:]
    finally:
        _signal(frozen, signal.SIGCONT)
        stop_up(proc, run_dir)
    text = log_path.read_text()
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "a step was lost or repeated"
    assert all(sum(v for k, v in r.items() if k.startswith("rollout/groups_by_replica/")) == 4 for r in records)
    assert "restart 1 of sampler-1" not in (run_dir / "logs" / "sampler-1.log").read_text(), "resumed, not restarted"
    assert "rewarder has not answered its health check" in text
    assert any(r["rollout/unhealthy_replicas"] >= 1 for r in records)
    assert sum(r["rollout/lost_wait_s"] for r in records) > 0
    assert all(r["reward/errors"] == 0 for r in records)
