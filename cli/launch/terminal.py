"""What `dgrpo up` shows on the terminal: the services' lines worth a person's attention, and a progress bar with
the live reward read from the learner's metrics.jsonl. Every line still goes to the service's log file."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tqdm import tqdm

OUR_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+) \[\w+\] (?P<logger>\S+):")
TRACEBACK_LINE = re.compile(r"^(Traceback|  File |\w+(Error|Exception)\b)")


def worth_showing(line: str) -> bool:
    """vLLM and transformers are chatty: the terminal shows dgrpo's own log lines, errors and tracebacks
    (every line still goes to the service's log file)."""
    m = OUR_LOG_LINE.match(line)
    if m:
        return m["logger"].startswith("dgrpo") or m["level"] in ("ERROR", "CRITICAL")
    if line.startswith("("):  # vLLM's engine / worker processes
        return " ERROR " in line
    return line.startswith("dgrpo ") or bool(TRACEBACK_LINE.match(line))


class Progress:
    """A progress bar with the live reward, fed by the learner's metrics.jsonl."""

    def __init__(self, metrics_path: Path, total: int | None):
        self.path, self.offset, self.file_id = metrics_path, 0, (0, 0)
        # Off when stdout is not a terminal (CI, log files): the learner logs one line per step anyway.
        self.bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True, file=sys.stdout,
                        disable=not sys.stdout.isatty())

    def update(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if (stat.st_ino, stat.st_dev) != self.file_id or stat.st_size < self.offset:
            # The learner rewrote the file (a run starting or resuming drops the records of the steps it will run
            # again, with os.replace): read the new one from its start.
            self.file_id, self.offset = (stat.st_ino, stat.st_dev), 0
            self.bar.reset(total=self.bar.total)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a partial line: read it next time
                self.offset += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a progress bar never stops the run
                if "reward/mean" in record:
                    self.bar.update(1)
                    self.bar.set_postfix(reward=f"{record['reward/mean']:.3f}", kl=f"{record.get('actor/kl', 0):.4f}",
                                         len=f"{record.get('response/length_mean', 0):.0f}", refresh=False)
                elif "val/reward_mean" in record:
                    self.bar.set_postfix_str(f"val reward {record['val/reward_mean']:.3f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
