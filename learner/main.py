"""`dgrpo learner`: check the config and data files, then train (alone, or one rank under torchrun).

SIGTERM / SIGINT ask the loop to stop after the step in progress (a checkpoint is written); a second signal
cancels at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from dgrpo.common.config import ConfigError
from dgrpo.common.logs import setup_logging
from dgrpo.learner.config import LearnerRunConfig
from dgrpo.learner.data import check_files


def main(cfg: LearnerRunConfig) -> int:
    """Run GRPO training; returns the exit code."""
    log = setup_logging("learner")
    try:
        check_files(cfg.learner.data)  # before torch is imported: a typo in a path fails in a second
    except ConfigError as e:
        print(f"dgrpo learner: {e}", file=sys.stderr)
        return 2
    from dgrpo.common.devices import detect_device, learner_env

    for key, value in learner_env(detect_device(cfg.model.device)).items():
        os.environ.setdefault(key, value)
    from dgrpo.learner.loop import Trainer
    from dgrpo.learner.reward_client import RewardError
    from dgrpo.learner.rollout import RolloutError

    trainer = Trainer(cfg)
    try:
        trainer.setup()
        asyncio.run(_run(trainer))
    except ConfigError as e:
        print(f"dgrpo learner: {e}", file=sys.stderr)
        return 2
    except (RolloutError, RewardError) as e:
        log.error("training stopped at step %d: %s (resume from the last checkpoint once the services are back)",
                  trainer.step_num, e)
        return 1
    finally:
        from dgrpo.learner.distributed import shutdown_distributed

        shutdown_distributed()
    log.info("training %s at step %d (weight version %d)",
             "stopped" if trainer.state.stop_requested else "finished", trainer.step_num, trainer.version)
    return 0


async def _run(trainer) -> None:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if trainer.state.stop_requested:
            task.cancel()  # second signal: do not wait for the step
        else:
            trainer.state.request_stop(signame)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await trainer.run()
