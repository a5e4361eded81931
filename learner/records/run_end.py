"""After the run, for supervisors that restart every exit (`learner.trainer.on_end: idle`, a Kubernetes StatefulSet):
the learner records how its run ended and keeps its control service answering instead of exiting.

A StatefulSet restarts a container whatever its exit code, so a learner that exits when its run is done would train
again from its last checkpoint, and one ended by the Stop RPC would simply carry on. `ended.json` in the run's
metrics folder (on the runs volume) says the run is over; a restarted learner that finds it serves Status (phase
`done` or `stopped`) and health, trains nothing, and exits 0 on SIGTERM. A run ended by a signal (a node drain, `kubectl
delete pod`) writes no record: its restart resumes training from the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

from dgrpo.common.auth_config import Credentials
from dgrpo.learner.records.control import LoopState, start_control_server

log = logging.getLogger(__name__)

RECORD = "ended.json"


def record_path(log_dir: str, run_name: str) -> Path:
    return Path(log_dir) / run_name / RECORD


def write_record(path: Path, state: LoopState) -> None:
    """Whole-file replace: a learner killed while writing leaves the old record or none, never half of one."""
    record = {"phase": state.phase, "step": state.step, "total_steps": state.total_steps,
              "weight_version": state.weight_version, "epoch": state.epoch, "stop_reason": state.stop_reason}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def read_record(path: Path) -> LoopState | None:
    """The ended run's state, or None when the run has not ended. A record that does not parse is an error naming
    the file: guessing either way could train a run its operator stopped."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        return LoopState(step=int(record["step"]), total_steps=int(record["total_steps"]),
                         weight_version=int(record["weight_version"]), epoch=int(record["epoch"]),
                         phase=str(record["phase"]), stop_requested=record["phase"] == "stopped",
                         stop_reason=str(record["stop_reason"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a run-end record ({e}): delete it to train, or restore it") from e


async def serve_until_terminated(state: LoopState, host: str, port: int | None, credentials: Credentials) -> None:
    """Status and health from the ended run's state until SIGTERM or SIGINT."""
    terminated = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, terminated.set)
    server = await start_control_server(state, host, port, credentials=credentials) if port is not None else None
    try:
        await terminated.wait()
    finally:
        if server is not None:
            await server.stop(1.0)
