"""Scripted stand-ins for a sampler replica and the rewarder: real grpc.aio servers of the dgrpo.v1 services (with
the standard health service SERVING), each in a process of its own, whose timing is a script instead of a model.

The learner's timing logic (hedging, the straggler watch, keepalive, the progress check, retries) then runs over real
gRPC against replicas whose speed is known to the test, in seconds, instead of against real vLLM engines whose speed
depends on how loaded the machine is. Cheap on purpose: grpc and the generated protos only (no torch, no vLLM).

    python tests/scripted_services.py sampler --port P --script '{"replica_id": "r1", "rate": 20}'
    python tests/scripted_services.py rewarder --port P --script '{"fail_calls": 1}'

The scripted engine steps `rate` times a second while it holds requests; each step adds one token to every running
completion (engines batch), so `rate` is every prompt's token rate. Prompt i of a call of k prompts completes after
ceil(max_tokens * (i + 1) / k) tokens (stop), the last one at max_tokens (length): groups stream one by one, as
completions of different lengths do; `jitter` makes its steps uneven. Info reports what the real sampler reports
(sampler/servicer.py): engine_steps, running_requests, busy_seconds, weight_version. Faults: `stall_after_steps` (or
SIGUSR1; SIGUSR2 resumes) stops the engine while gRPC keeps answering; `abort_after_groups` drops a stream with
UNAVAILABLE; the test freezes the process (`ScriptedService.frozen`, SIGSTOP) or kills it. Every event goes to a
JSON-lines journal the test reads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dgrpo.common import grpc_server
from dgrpo.sampler.busy import BusyClock
from dgrpo.v1 import rewarder_pb2, rewarder_pb2_grpc, sampler_pb2, sampler_pb2_grpc


class Journal:
    """One JSON line per event, flushed at once (a killed process keeps what it wrote)."""

    def __init__(self, path: str | None, **common):
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (open for the process's life)
        self.common = common

    def write(self, event: str, **fields) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"t": time.time(), "event": event, **self.common, **fields}) + "\n")


# ---- the sampler ----------------------------------------------------------------------------------------------------

@dataclass
class Request:
    """One prompt's n samples in the engine: done once the longest has `length` tokens."""

    prompt: sampler_pb2.Prompt
    n: int
    length: int
    max_tokens: int
    first_version: int
    produced: int = 0
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Engine:
    """Steps at `rate` per second while it holds requests (catching up on late wake-ups, at most 0.2 s worth). With
    `jitter` j, each step instead takes (1 +- j) / rate, drawn uniformly (seeded by `seed`): the uneven steps of an
    engine on a loaded host."""

    def __init__(self, rate: float, stall_after_steps: int | None, jitter: float = 0.0, seed: int = 0):
        self.rate, self.stall_after_steps = rate, stall_after_steps
        self.jitter, self.rng = jitter, random.Random(seed)
        self.steps, self.stalled = 0, False
        self.running: list[Request] = []
        self.wake = asyncio.Event()
        self._busy = BusyClock()  # the engine's own (sampler/busy.py)

    def add(self, requests: list[Request]) -> None:
        self.running.extend(requests)
        self._note_busy()
        self.wake.set()

    def remove(self, requests: list[Request]) -> None:
        self.running = [r for r in self.running if r not in requests]
        self._note_busy()

    def set_stalled(self, stalled: bool) -> None:
        self.stalled = stalled
        self.wake.set()

    @property
    def can_step(self) -> bool:
        limit = self.stall_after_steps
        return bool(self.running) and not self.stalled and (limit is None or self.steps < limit)

    async def run(self) -> None:
        credit, last = 0.0, time.monotonic()
        while True:
            if not self.can_step:
                self.wake.clear()
                await self.wake.wait()
                credit, last = 0.0, time.monotonic()
                continue
            if self.jitter:
                await asyncio.sleep(self.rng.uniform(1 - self.jitter, 1 + self.jitter) / self.rate)
                if self.can_step:
                    self.step()
                continue
            await asyncio.sleep(1 / self.rate)
            now = time.monotonic()
            credit = min(credit + (now - last) * self.rate, max(1.0, 0.2 * self.rate))
            last = now
            while credit >= 1 and self.can_step:
                credit -= 1
                self.step()

    def step(self) -> None:
        self.steps += 1
        for r in self.running:
            r.produced += 1
            if r.produced >= r.length and not r.done.done():
                r.done.set_result(r)
        self.running = [r for r in self.running if not r.done.done()]
        self._note_busy()

    def _note_busy(self) -> None:
        self._busy.note(bool(self.running))

    @property
    def busy_seconds(self) -> float:
        return self._busy.seconds


def completion(request: Request, sample: int, vocab_size: int, version: int) -> sampler_pb2.Completion:
    """Sample `sample` of a finished request: deterministic token ids, a logprob (< 0) per token."""
    length = max(1, request.length - sample)
    seed = zlib.crc32(f"{request.prompt.id}/{sample}".encode())
    ids = [(seed + 7919 * t) % vocab_size for t in range(length)]
    reason = sampler_pb2.FINISH_REASON_LENGTH if length >= request.max_tokens else sampler_pb2.FINISH_REASON_STOP
    return sampler_pb2.Completion(token_ids=ids, logprobs=[-0.05 - (i % 13) / 10 for i in ids],
                                  text=" ".join(f"t{i}" for i in ids), finish_reason=reason, weight_version=version,
                                  first_weight_version=request.first_version)


def invalid(request: sampler_pb2.GenerateRequest, vocab_size: int) -> str | None:
    """What the real sampler answers INVALID_ARGUMENT to (sampler/requests.py), for the fields used here."""
    ids = [p.id for p in request.prompts]
    if not ids:
        return "prompts: empty batch (send at least one prompt)"
    if len(set(ids)) != len(ids):
        return "a prompt id appears twice in the batch"
    if request.sampling.n < 1 or request.sampling.max_tokens < 1:
        return f"sampling.n={request.sampling.n}, max_tokens={request.sampling.max_tokens}: must be >= 1"
    for p in request.prompts:
        if p.WhichOneof("input") not in ("token_ids", "text"):
            return f"prompt {p.id!r}: send token_ids or text"
        if any(t >= vocab_size for t in p.token_ids.ids):
            return f"prompt {p.id!r}: token ids outside the vocabulary (size {vocab_size})"
    return None


class ScriptedSampler(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, script: dict):
        self.replica_id = script.get("replica_id", "scripted")
        self.weight_version = int(script.get("weight_version", 0))
        self.vocab_size = int(script.get("vocab_size", 1000))
        self.max_model_len = int(script.get("max_model_len", 2048))
        self.abort_after_groups = script.get("abort_after_groups")
        self.abort_calls = script.get("abort_calls", 1)  # how many calls (the first ones) drop; None: every one
        self.engine = Engine(float(script.get("rate", 100.0)), script.get("stall_after_steps"),
                             float(script.get("jitter", 0.0)), zlib.crc32(self.replica_id.encode()))
        self.journal = Journal(script.get("journal"), replica=self.replica_id)
        self.calls = 0

    async def Generate(self, request: sampler_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        problem = invalid(request, self.vocab_size)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.min_weight_version > self.weight_version:  # never reached: the fence times out, as it would
            await asyncio.sleep(request.weight_wait_timeout_s or 1.0)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"weight version {request.min_weight_version} not loaded (at {self.weight_version})")
        self.calls += 1
        call, k, s = self.calls, len(request.prompts), request.sampling
        drops = self.abort_after_groups is not None and (self.abort_calls is None or call <= self.abort_calls)
        requests = [Request(p, s.n, math.ceil(s.max_tokens * (i + 1) / k), s.max_tokens, self.weight_version)
                    for i, p in enumerate(request.prompts)]
        self.journal.write("start", call=call, prompts=[p.id for p in request.prompts])
        self.engine.add(requests)
        sent = 0
        try:
            for next_done in asyncio.as_completed([r.done for r in requests]):
                if drops and sent >= self.abort_after_groups:
                    self.journal.write("drop", call=call, after=sent)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: stream dropped")
                r = await next_done
                self.journal.write("group", call=call, prompt=r.prompt.id)
                yield sampler_pb2.Group(
                    prompt_id=r.prompt.id, replica_id=self.replica_id,
                    prompt_token_ids=list(r.prompt.token_ids.ids) or list(r.prompt.text.encode()),
                    completions=[completion(r, j, self.vocab_size, self.weight_version) for j in range(r.n)])
                sent += 1
        except (asyncio.CancelledError, GeneratorExit):  # the client cancelled (or went away)
            self.journal.write("cancelled", call=call, after=sent)
            raise
        finally:
            self.engine.remove(requests)

    async def Info(self, request: sampler_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        e = self.engine
        return sampler_pb2.SamplerInfo(
            model="scripted", dtype="float32", device="cpu", max_model_len=self.max_model_len,
            replica_id=self.replica_id, weight_version=self.weight_version,
            running_requests=sum(r.n for r in e.running),  # vLLM v1 runs each of the n samples as a request
            waiting_requests=0, vocab_size=self.vocab_size, busy_seconds=e.busy_seconds, engine_steps=e.steps)


# ---- the rewarder ---------------------------------------------------------------------------------------------------

class ScriptedRewarder(rewarder_pb2_grpc.RewarderServicer):
    """Exact match against the group's extra "answer" (1.0 or 0.0). `fail_calls`: the first calls fail with
    `fail_code`; `exit_on_call`: the process dies on that call (1-based) before answering; `delay_s`: scoring time."""

    SPEC = rewarder_pb2.RewardSpecRef(name="scripted", version=1, content_hash="0" * 64)

    def __init__(self, script: dict):
        self.fail_calls, self.fail_code = int(script.get("fail_calls", 0)), script.get("fail_code", "UNAVAILABLE")
        self.exit_on_call, self.delay_s = script.get("exit_on_call"), float(script.get("delay_s", 0.0))
        self.journal = Journal(script.get("journal"), pid=os.getpid())
        self.calls = self.in_flight = 0

    async def Score(self, request: rewarder_pb2.ScoreRequest, context: grpc.aio.ServicerContext):
        self.calls += 1
        call, ids = self.calls, [g.prompt_id for g in request.groups]
        self.journal.write("call", call=call, prompts=ids)
        if call == self.exit_on_call:
            os._exit(3)  # a crash mid-call: no answer, the connection reset
        if call <= self.fail_calls:
            self.journal.write("fail", call=call, code=self.fail_code)
            await context.abort(grpc.StatusCode[self.fail_code], f"scripted failure of call {call}")
        problem = ("the request has no groups" if not ids else "duplicate prompt_id" if len(set(ids)) < len(ids)
                   else next((f"groups[{i}] has {len(g.completions)} completions, group_size is {request.group_size}"
                              for i, g in enumerate(request.groups)
                              if not g.completions or (request.group_size and
                                                       len(g.completions) != request.group_size)), None))
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.in_flight += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        response = rewarder_pb2.ScoreResponse(spec=self.SPEC)
        for g in request.groups:
            answer = g.extra.fields["answer"].string_value if "answer" in g.extra.fields else None
            out = response.groups.add(prompt_id=g.prompt_id)
            for text in g.completions:
                value = float(text == answer)
                out.scores.add(reward=value, breakdown={"exact_match": value}, status=rewarder_pb2.SCORE_STATUS_OK)
        self.journal.write("scored", call=call, prompts=ids)
        return response

    async def Info(self, request, context):
        return rewarder_pb2.RewarderInfo(
            spec=self.SPEC, functions=[rewarder_pb2.RewardFunctionInfo(name="exact_match", kind="exact_match",
                                                                         weight=1.0)],
            workers=1, workers_alive=1, on_error="error", in_flight_requests=self.in_flight)


# ---- the process ----------------------------------------------------------------------------------------------------

async def serve(kind: str, port: int, script: dict) -> None:
    if kind == "sampler":
        servicer, add = ScriptedSampler(script), sampler_pb2_grpc.add_SamplerServicer_to_server
        name = sampler_pb2.DESCRIPTOR.services_by_name["Sampler"].full_name
    else:
        servicer, add = ScriptedRewarder(script), rewarder_pb2_grpc.add_RewarderServicer_to_server
        name = rewarder_pb2.DESCRIPTOR.services_by_name["Rewarder"].full_name
    # The real services' bootstrap: the same server options (keepalive pings accepted), health and reflection.
    server = grpc_server.create_server(servicer, add, name, host="127.0.0.1", port=port, config_key=f"{kind}.port")
    await server.start()
    if kind == "sampler":
        servicer.engine_task = asyncio.create_task(servicer.engine.run())  # referenced: never garbage-collected
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, servicer.engine.set_stalled, True)
        loop.add_signal_handler(signal.SIGUSR2, servicer.engine.set_stalled, False)
    await server.set_serving(True)
    print(f"DGRPO_READY scripted {kind} port={server.port}", flush=True)
    await grpc_server.serve_until_signal(server, grace=0.5)


class ScriptedService:
    """A scripted service in its own process (own session), its journal in a temp file; for the tests."""

    def __init__(self, kind: str, script: dict, port: int | None = None, journal: Path | None = None):
        from support import free_port

        self.kind, self.port = kind, port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.journal_path = journal or Path(tempfile.mkstemp(prefix=f"scripted-{kind}-", suffix=".jsonl")[1])
        self.script = {**script, "journal": str(self.journal_path)}
        self.log_path = Path(tempfile.mkstemp(prefix=f"scripted-{kind}-", suffix=".log")[1])
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, kind, "--port", str(self.port), "--script", json.dumps(self.script)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 30.0) -> ScriptedService:
        from support import wait_serving

        try:
            wait_serving(self.address, timeout, self.proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"scripted {self.kind} did not start ({e}); log:\n{self.log_path.read_text()}") from None
        return self

    def events(self, event: str | None = None) -> list[dict]:
        lines = self.journal_path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if event is None or e["event"] == event]

    def wait_event(self, event: str, timeout: float = 10.0) -> list[dict]:
        """The journal's `event` entries, polled for until there is one (bounded): the service writes them on its own
        time, e.g. a cancellation after the client has moved on."""
        deadline = time.monotonic() + timeout
        while not (found := self.events(event)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event!r} in the journal of {self.address} within {timeout:g}s: "
                                     f"{self.events()}")
            time.sleep(0.01)
        return found

    @contextmanager
    def frozen(self):
        """The whole process stopped (no error, no closed connection: a frozen host), resumed on exit."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def is_stopped(self) -> bool:
        return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """Resumed if frozen, terminated (killed after 5 s); its log and journal removed."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        for path in (self.log_path, self.journal_path):
            path.unlink(missing_ok=True)


def start_all(kind: str, scripts: list[dict]) -> list[ScriptedService]:
    """Start every script at once (the processes start in parallel), then wait for each to be SERVING."""
    services = [ScriptedService(kind, s) for s in scripts]
    try:
        for s in services:
            s.wait_ready()
    except BaseException:
        for s in services:
            s.stop()
        raise
    return services


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["sampler", "rewarder"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", default="{}", help="JSON object: the behaviour (see the classes above)")
    args = parser.parse_args()
    asyncio.run(serve(args.kind, args.port, json.loads(args.script)))
