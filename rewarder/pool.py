"""A pool of reward worker processes for one spec snapshot; dead or hung workers are replaced.

Each call borrows an idle worker, sends it the call and waits in a thread (the connection is blocking); a
call past its timeout kills the worker (the only way to stop user code that hangs), a closed connection
means the worker crashed. Either way the call fails with a clear message and a replacement is started in
the background; the pool keeps serving with the workers it has meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from dgrpo.common.retry import Backoff
from dgrpo.rewarder.spec import SpecError, SpecSnapshot

log = logging.getLogger("dgrpo.rewarder.pool")


class CallFailed(Exception):
    """A reward function call that produced no values: it raised, timed out (`timed_out`), or its worker died."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class _WorkerDied(Exception):
    pass


class _CallTimeout(Exception):  # not TimeoutError: that is an OSError, which means "worker died" here
    pass


def _exit_reason(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return "its connection closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def worker_env(size: int) -> dict[str, str]:
    """The workers' environment: CPU threads split between them (torch and numpy default to every core each,
    and `size` workers oversubscribing the cores is slower than one); a user's OMP_NUM_THREADS wins."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    return env


class _Worker:
    """One worker process and its connection (blocking methods: run them in a thread)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn

    @classmethod
    def spawn(cls, snap: SpecSnapshot, load_timeout: float, size: int) -> _Worker:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "dgrpo.rewarder.worker", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env=worker_env(size),
        )
        theirs.close()
        worker = cls(proc, Connection(ours.detach()))
        try:
            worker.conn.send(snap)
            if not worker.conn.poll(load_timeout):
                raise SpecError(f"loading the reward spec took more than load_timeout_s={load_timeout:g}s")
            kind, message = worker.conn.recv()
        except (EOFError, OSError):
            worker.kill()
            raise SpecError(f"the worker process died while loading the reward spec ({_exit_reason(proc)})") from None
        except SpecError:
            worker.kill()
            raise
        if kind != "ready":
            worker.kill()
            raise SpecError(message)
        return worker

    def call(self, msg: tuple, timeout: float):
        try:
            self.conn.send(msg)
            if not self.conn.poll(timeout):
                raise _CallTimeout
            return self.conn.recv()
        except (EOFError, OSError):
            raise _WorkerDied(_exit_reason(self.proc)) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class WorkerPool:
    """`size` workers all built from one snapshot. `start()` raises SpecError if the spec does not load."""

    def __init__(self, snap: SpecSnapshot, size: int, load_timeout: float):
        self.snap, self.size, self.load_timeout = snap, size, load_timeout
        self._executor = ThreadPoolExecutor(max_workers=2 * size + 2, thread_name_prefix="reward-call")
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._closed = False
        self._replacing: set[asyncio.Task] = set()

    @property
    def alive(self) -> int:
        return sum(1 for w in self._all if w.proc.poll() is None)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *[loop.run_in_executor(self._executor, _Worker.spawn, self.snap, self.load_timeout, self.size)
              for _ in range(self.size)],
            return_exceptions=True,
        )
        workers = [r for r in results if isinstance(r, _Worker)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for w in workers:
                await loop.run_in_executor(self._executor, w.stop)
            self._executor.shutdown(wait=False)
            raise errors[0] if isinstance(errors[0], SpecError) else SpecError(str(errors[0]))
        for w in workers:
            self._all.add(w)
            self._idle.put_nowait(w)

    async def call(self, index: int, prompts: list, completions: list, kwargs: dict, timeout: float,
                   state: dict | None = None):
        """Run function `index` on one worker; the checked values (a calling.Scored), or CallFailed with the reason.
        `state`: TRL's trainer_state fields."""
        loop = asyncio.get_running_loop()
        worker = await self._idle.get()
        msg = ("call", index, prompts, completions, kwargs, state)
        future = loop.run_in_executor(self._executor, worker.call, msg, timeout)
        try:
            kind, payload = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller went away (client cancel, shutdown) but the worker is still busy: take it back when done.
            future.add_done_callback(lambda f: self._settle(worker, f))
            raise
        except _CallTimeout:
            self._replace(worker)
            raise CallFailed(f"timed out after {timeout:g}s (its worker was killed and replaced)",
                             timed_out=True) from None
        except _WorkerDied as e:
            self._replace(worker)
            raise CallFailed(f"crashed its worker process ({e}); the worker was replaced") from None
        self._idle.put_nowait(worker)
        if kind == "error":
            raise CallFailed(payload)
        return payload

    def _settle(self, worker: _Worker, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            self._replace(worker)
        else:
            self._idle.put_nowait(worker)

    def _replace(self, dead: _Worker) -> None:
        self._all.discard(dead)
        dead.kill()
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._respawn())
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)

    async def _respawn(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=1.0, cap=30.0)
        while not self._closed:
            started = time.monotonic()
            try:
                worker = await loop.run_in_executor(
                    self._executor, _Worker.spawn, self.snap, self.load_timeout, self.size
                )
            except SpecError as e:
                log.error("could not replace a reward worker (retrying in %.0fs): %s", backoff.delay, e)
                await backoff.wait()
                continue
            if self._closed:
                await loop.run_in_executor(self._executor, worker.stop)
                return
            log.info("replaced a reward worker in %.1fs (pid %d)", time.monotonic() - started, worker.proc.pid)
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return

    async def close(self) -> None:
        """Stop every worker (callers must have finished: the scorer drains a spec before closing its pool)."""
        self._closed = True
        # Replacements still loading finish (bounded by load_timeout_s) and stop their worker themselves.
        await asyncio.gather(*list(self._replacing), return_exceptions=True)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.run_in_executor(self._executor, w.stop) for w in list(self._all)])
        self._all.clear()
        self._executor.shutdown(wait=False)
