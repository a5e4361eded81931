"""What a step shows beyond its scalars (rank 0): rollout and validation dumps, the completions table, and the
learner's Prometheus series. Each is off unless its key in `learner.trainer` is set; the loop calls three hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dgrpo.learner.config import TrainerConfig
from dgrpo.learner.records import completions_table
from dgrpo.learner.records.metrics import MetricsLogger
from dgrpo.learner.records.rollout_dump import completion_records, write_step_file
from dgrpo.learner.rollout.pipeline import staleness_metrics

log = logging.getLogger("dgrpo.learner")


class StepReports:
    def __init__(self, cfg: TrainerConfig, metrics: MetricsLogger):
        self.cfg, self.metrics = cfg, metrics
        self.prometheus = None
        self._server = None
        if cfg.metrics_port is not None:
            from dgrpo.learner.records.prometheus import LearnerMetrics

            self.prometheus = LearnerMetrics()
            self._server = self.prometheus.serve(cfg.metrics_host, cfg.metrics_port)
            log.info("Prometheus metrics on http://%s:%d/metrics", cfg.metrics_host, self._server.server_port)

    def rollouts(self, step: int, scored: Sequence[Any], advantages: Sequence[float], version: int) -> None:
        """The batch step `step` trains (groups.ScoredGroup list, one advantage per completion) from `version`."""
        cfg = self.cfg
        if self.prometheus is not None:
            self.prometheus.observe_staleness(staleness_metrics(scored, version))
        if not (cfg.rollout_data_dir or cfg.log_completions):
            return
        records = completion_records(step, scored, advantages, version, cfg.rollout_data_max_chars)
        if cfg.rollout_data_dir:
            write_step_file(cfg.rollout_data_dir, step, records)
        if cfg.log_completions:
            log.info(
                "\n%s", completions_table.render(completions_table.pick(records, cfg.num_completions_to_print), step)
            )
            self._log_table(step, records, "completions")

    def validation(self, step: int, scored: Sequence[Any], version: int) -> None:
        """Greedy validation generations after step `step`."""
        cfg = self.cfg
        if not (cfg.validation_data_dir or cfg.log_val_generations):
            return
        records = completion_records(step, scored, None, version, cfg.rollout_data_max_chars)
        if cfg.validation_data_dir:
            write_step_file(cfg.validation_data_dir, step, records)
        if cfg.log_val_generations:
            self._log_table(step, records[: cfg.log_val_generations], "val/generations")

    def _log_table(self, step: int, records: list[dict], key: str) -> None:
        cols = completions_table.columns(records)
        self.metrics.log_table(step, cols, completions_table.rows(records, cols), key=key)

    def step_logged(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if self.prometheus is not None:
            self.prometheus.observe_step(step, total, metrics)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
