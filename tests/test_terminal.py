"""What `dgrpo up` shows on the terminal (cli/launch/terminal.py): the lines worth showing, and the progress bar's
reading of
the learner's metrics.jsonl as it grows, is cut mid-line, and is rewritten by a resumed run."""

from __future__ import annotations

import json
import os

from dgrpo.cli.launch.terminal import Progress, worth_showing


def test_the_terminal_shows_our_lines_errors_and_tracebacks_not_library_chatter():
    assert worth_showing("12:00:01 INFO [learner] dgrpo.learner: step 3/20 | reward 0.5\n")
    assert worth_showing("12:00:01 ERROR [sampler] vllm.engine: engine died\n")  # anyone's error
    assert not worth_showing("12:00:01 INFO [sampler] vllm.engine: KV cache 1 GiB\n")
    assert not worth_showing("(EngineCore pid=12) INFO 12-06 12:00:01 [core.py:90] warming up\n")
    assert worth_showing("(EngineCore pid=12) ERROR 12-06 12:00:01 [core.py:90] EngineCore failed\n")
    assert worth_showing("Traceback (most recent call last):\n")
    assert worth_showing('  File "/x/learner/loop.py", line 10, in step\n')
    assert worth_showing("RuntimeError: no sampler answered\n")
    assert worth_showing("dgrpo up: sampler-0 restarted\n")
    assert not worth_showing("Loading weights: 100%|██████████| 272/272\n")


def _record(step: int, reward: float) -> bytes:
    return (json.dumps({"step": step, "reward/mean": reward, "actor/kl": 0.0}) + "\n").encode()


def test_the_progress_bar_reads_whole_records_and_starts_over_on_a_rewritten_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    progress = Progress(path, total=4)
    try:
        progress.update()  # no file yet: nothing read, nothing raised
        assert progress.offset == 0
        first, second = _record(1, 0.25), _record(2, 0.5)
        path.write_bytes(first + second[:10])  # the learner is mid-write of step 2
        progress.update()
        assert progress.offset == len(first)  # the partial line waits for its end
        with open(path, "ab") as f:
            f.write(second[10:] + b"not json\n")
        progress.update()
        assert progress.offset == len(first + second) + len(b"not json\n")  # a bad line is skipped, not fatal
        # A resumed run replaces the file (os.replace) with fewer records: it is read again from its start.
        resumed = tmp_path / "metrics.jsonl.new"
        resumed.write_bytes(_record(1, 0.3))
        os.replace(resumed, path)
        progress.update()
        assert progress.offset == len(_record(1, 0.3))
    finally:
        progress.close()
