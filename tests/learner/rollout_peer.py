"""The learner's rollout client, run inside a simulated host (tests/hosts_support.py) and driven over stdin, for
tests/learner/test_hung_hosts.py: the test process cannot reach the hosts' addresses, a process inside host a can.

    python rollout_peer.py --addresses '["127.0.0.1:50071", "10.213.7.2:50072"]' --config '<RolloutConfig JSON>'

One JSON command per stdin line, one JSON event per stdout line:
- {"do": "collect", "tag": T, "prompts": N, "max_tokens": M, "holding": ADDRESS?}: N prompts' groups through the
  real RolloutClient; with "holding", the event `holding` is printed once ADDRESS's engine runs some of them (the
  moment to cut its link); then `collected` with the prompt ids received and the client's own RolloutStats.
- {"do": "wait_answering", "address": A}: `answering` once A answers Info again (bounded).
Its end (or "stop") ends the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.client import RolloutClient, RolloutStats, make_prompt
from dgrpo.v1 import sampler_pb2

PROMPT = list(range(100, 120))


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def collect(client: RolloutClient, tag: str, n_prompts: int, max_tokens: int) -> None:
    stats = RolloutStats()
    prompts = [make_prompt(f"{tag}-{i}", PROMPT) for i in range(n_prompts)]
    params = sampler_pb2.SamplingParams(n=2, max_tokens=max_tokens, temperature=1.0)
    started = time.monotonic()
    ids = [g.prompt_id async for g in client.generate(prompts, params, stats=stats)]
    emit("collected", tag=tag, prompt_ids=ids, seconds=time.monotonic() - started,
         groups_by_replica=dict(stats.groups_by_replica), unhealthy=sorted(stats.unhealthy_replicas),
         failed_calls=stats.failed_calls, stuck_calls=stats.stuck_calls, retried_prompts=stats.retried_prompts,
         duplicates_dropped=stats.duplicates_dropped)


async def wait_holding(client: RolloutClient, address: str) -> None:
    deadline = time.monotonic() + 120
    while (await client.info(address, 5.0)).running_requests == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} never received its prompts")
        await asyncio.sleep(0.02)
    emit("holding", address=address)


async def wait_answering(client: RolloutClient, address: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            await client.info(address, 2.0, wait_for_ready=True)
            emit("answering", address=address)
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addresses", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    client = RolloutClient(json.loads(args.addresses), RolloutConfig(**json.loads(args.config)))
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line.strip() or line.strip() == "stop":
                return
            cmd = json.loads(line)
            if cmd["do"] == "collect":
                task = asyncio.create_task(collect(client, cmd["tag"], cmd["prompts"], cmd["max_tokens"]))
                if cmd.get("holding"):
                    await wait_holding(client, cmd["holding"])
                await task
            elif cmd["do"] == "wait_answering":
                await wait_answering(client, cmd["address"])
            else:
                raise ValueError(f"unknown command {cmd!r}")
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
