"""`dgrpo learner`: preflight (data files and columns, writable output folders with room for a checkpoint, free
ports), then train (alone, or one rank under torchrun).

SIGTERM / SIGINT ask the loop to stop after the step in progress (a checkpoint is written). A second one drops the
step in flight if it is still sampling (the last completed step is checkpointed, and a resume redoes the dropped
one); during the update it waits for the update to end. A third cancels at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from dgrpo.common import preflight as pf
from dgrpo.common import tracing
from dgrpo.common.config import ConfigError
from dgrpo.common.logs import setup_logging
from dgrpo.learner.config import LearnerRunConfig
from dgrpo.learner.records import run_end
from dgrpo.learner.records.metrics import check_loggers
from dgrpo.learner.rollout.data import check_files


def output_needs(cfg: LearnerRunConfig) -> list[tuple[str, str, int, str]]:
    """(key, folder, bytes, what) of everything the run writes: one checkpoint, the export, the metrics, the rollout
    dumps (their size grows with the run: only writability is checked)."""
    lc = cfg.learner
    params = pf.parameter_count(_model_dir(cfg.model.path))
    ckpt = pf.checkpoint_bytes(params, lc.checkpoint.contents) if params else 0
    what = f"one checkpoint of {params / 1e6:.0f}M parameters ({'+'.join(lc.checkpoint.contents)})" if params else ""
    needs = [("learner.checkpoint.dir", lc.checkpoint.dir, ckpt, what),
             ("learner.trainer.log_dir", str(Path(lc.trainer.log_dir) / lc.trainer.run_name), 0, "metrics")]
    if lc.checkpoint.export_dir:
        needs.append(("learner.checkpoint.export_dir", lc.checkpoint.export_dir,
                      pf.export_bytes(params, cfg.model.dtype) if params else 0, f"the export in {cfg.model.dtype}"))
    for key in ("rollout_data_dir", "validation_data_dir"):
        if getattr(lc.trainer, key):
            needs.append((f"learner.trainer.{key}", getattr(lc.trainer, key), 0, "rollout records"))
    return needs


def _model_dir(path: str | None) -> Path:
    """The model folder, without preparing the bundled model (that is heavy; unprepared, the size is unknown)."""
    if path:
        return Path(path).expanduser()
    from dgrpo.common.models import BUNDLED_NAME, cache_dir

    return cache_dir() / "models" / BUNDLED_NAME


def learner_bindings(cfg: LearnerRunConfig) -> list[pf.Binding]:
    """The sockets the learner binds (rank 0): its control service and the weight publisher's two."""
    return pf.learner_bindings(cfg.learner.trainer, cfg.weights)


def preflight(cfg: LearnerRunConfig) -> None:
    """Everything that can be checked before torch is imported, so a typo or a full disk fails in a second."""
    check_files(cfg.learner.data)
    check_loggers(cfg.learner.trainer.loggers)
    tracing.check(cfg.tracing)
    pf.check_space(output_needs(cfg))
    if cfg.learner.checkpoint.export_dir:
        pf.check_replaceable("learner.checkpoint.export_dir", cfg.learner.checkpoint.export_dir, "config.json")
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 binds
        pf.check_ports(learner_bindings(cfg))


def main(cfg: LearnerRunConfig) -> int:
    """Run GRPO training; returns the exit code."""
    log = setup_logging("learner")
    try:
        preflight(cfg)
    except ConfigError as e:
        print(f"dgrpo learner: {e}", file=sys.stderr)
        return 2
    from dgrpo.common.devices import detect_device, learner_env, preloaded_allocator

    for key, value in learner_env(detect_device(cfg.model.device)).items():
        os.environ.setdefault(key, value)
    allocator = preloaded_allocator()
    if allocator:
        log.info("host allocator: %s (LD_PRELOAD)", allocator)
    from dgrpo.learner.loop import Trainer
    from dgrpo.learner.records.checkpoint import CheckpointError
    from dgrpo.learner.rollout.client import RolloutError
    from dgrpo.learner.rollout.reward_client import RewardError

    ended = _ended_run(cfg)
    if ended is not None:
        return _idle(cfg, ended)
    trainer = Trainer(cfg)
    if os.environ.get("RANK", "0") == "0":  # rank 0 drives the loop: its spans are the step's
        tracing.init(cfg.tracing, "learner")
    try:
        trainer.setup()
        asyncio.run(_run(trainer))
    except ConfigError as e:
        print(f"dgrpo learner: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # a full disk mid-run: one line naming the key, the earlier checkpoints intact
        print(f"dgrpo learner: stopped at step {trainer.step_num}: {e}", file=sys.stderr)
        return 1
    except (RolloutError, RewardError) as e:
        log.error("training stopped at step %d: %s (resume from the last checkpoint once the services are back)",
                  trainer.step_num, e)
        return 1
    finally:
        from dgrpo.learner.update.distributed import shutdown_distributed

        shutdown_distributed()
        tracing.shutdown()  # the last step's spans are still queued
    log.info("training %s at step %d (weight version %d)",
             "stopped" if trainer.state.stop_requested else "finished", trainer.step_num, trainer.version)
    state = trainer.state
    if cfg.learner.trainer.on_end == "idle" and (state.phase == "done" or state.stopped_by_rpc):
        return _idle(cfg, state)  # (the loop recorded the end)
    return 0


def _record(cfg: LearnerRunConfig) -> Path:
    return run_end.record_path(cfg.learner.trainer.log_dir, cfg.learner.trainer.run_name)


def _ended_run(cfg: LearnerRunConfig):
    """With on_end: idle, the state of a run that already ended (finished, or stopped by the Stop RPC)."""
    if cfg.learner.trainer.on_end != "idle":
        return None
    try:
        state = run_end.read_record(_record(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if state is not None:
        logging.getLogger("dgrpo.learner").info(
            "run %s ended at step %d (%s%s; %s): serving Status until terminated. To train on, delete that file "
            "(and raise learner.trainer.total_training_steps for a finished run), then restart the learner",
            cfg.learner.trainer.run_name, state.step, state.phase,
            f": {state.stop_reason}" if state.phase == "stopped" else "", _record(cfg))
    return state


def _idle(cfg: LearnerRunConfig, state) -> int:
    """Rank 0 keeps the control service up until SIGTERM; the other ranks have nothing to serve and exit."""
    if os.environ.get("RANK", "0") != "0":
        return 0
    tc = cfg.learner.trainer
    asyncio.run(run_end.serve_until_terminated(state, tc.control_host, tc.control_port, cfg.auth.credentials()))
    return 0


async def _run(trainer) -> None:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    signals = [0]

    def on_signal(signame: str) -> None:
        signals[0] += 1
        if signals[0] == 1:
            trainer.state.request_stop(signame)  # after the step in progress, with a checkpoint
        elif signals[0] > 2 or trainer.can_drop_step():
            task.cancel()  # drop the step in flight (the loop keeps the last completed step) / third: at once
        else:
            logging.getLogger("dgrpo.learner").warning(
                "%s while %s: the update finishes first (a third signal cancels at once)", signame, trainer.state.phase)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await trainer.run()
