"""How long a sampler replica takes to turn SERVING when it joins a host whose cores a first replica (generating
without pause) and a training learner (a 2-thread torch loop) keep busy, by the cores the joining replica binds.

    python benchmarks/bench_replica_join.py                         # the joining replica on `all`, then on `1-1`
    python benchmarks/bench_replica_join.py --join-cores all 1-1 --timeout 600

Both replicas are `dgrpo sampler --config configs/cpu-demo.yaml` (what `docker compose --scale sampler=2` runs on
one host; the demo's `sampler.cpu_cores: all`), weight sync off. Printed per case: the first replica's start on an
idle machine, the joining replica's start under load, and their ratio. Found (2026-12-07 08:29-08:37, 2 cores,
nothing else running): joining on `all` 217 s (8.0x its 27 s idle start), on core 1 alone 48 s (1.7x). vLLM's
multiprocessing executor starts its worker with OMP_PLACES / OMP_PROC_BIND for the bound cores
(vllm/utils/ompmultiprocessing.py), so the worker's main thread is pinned to the first of them as soon as its
`import torch` loads OpenMP, and under `all` that is the core where the busy replica's main thread runs: the rest of
its imports and its model load crawl there. Since then replicas that share a host agree on cores under `all`
(common/cpu_leases.py): the joining replica on `all` is bound to core 1 by its lease; measured 2026-12-07 10:44-10:50
with two test sessions beside it: 62.6 s on `all`, 69.2 s on `1-1`. Nothing else may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_async import _wait_serving

LEARNER = "import torch, time\ntorch.set_num_threads(2)\nx = torch.randn(512, 512)\nwhile True:\n    x @ x\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sampler(port: int, cores: str, replica: str, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "dgrpo.cli", "sampler", "--config", str(ROOT / "configs" / "cpu-demo.yaml"),
            f"sampler.port={port}", "sampler.host=127.0.0.1", f"sampler.cpu_cores={cores}",
            f"sampler.replica_id={replica}", "weights.enabled=false"]
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def _generate_forever(port: int, stop: threading.Event, tokens: list[int]) -> None:
    import grpc

    from dgrpo.v1 import sampler_pb2 as pb
    from dgrpo.v1 import sampler_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sampler_pb2_grpc.SamplerStub(channel)
        while not stop.is_set():
            request = pb.GenerateRequest(prompts=[pb.Prompt(id=f"p{i}", text=f"Count from {i} to 100.")
                                                  for i in range(8)],
                                         sampling=pb.SamplingParams(n=4, max_tokens=64, temperature=1.0))
            try:
                for group in stub.Generate(request, timeout=300):
                    tokens[0] += sum(len(c.token_ids) for c in group.completions)
            except grpc.RpcError:
                time.sleep(1)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def one_case(join_cores: str, timeout: float, logs: Path) -> dict:
    first_port, join_port = _free_port(), _free_port()
    first = _sampler(first_port, "all", "first", logs / f"first-{join_cores}.log")
    procs = [first]
    stop, tokens = threading.Event(), [0]
    try:
        t = time.monotonic()
        _wait_serving(first_port, first, 600)
        idle = time.monotonic() - t
        threading.Thread(target=_generate_forever, args=(first_port, stop, tokens), daemon=True).start()
        procs.append(subprocess.Popen([sys.executable, "-c", LEARNER], start_new_session=True))
        time.sleep(20)  # the first replica at full speed
        before = tokens[0]
        time.sleep(20)
        rate = (tokens[0] - before) / 20
        joining = _sampler(join_port, join_cores, "joining", logs / f"joining-{join_cores}.log")
        procs.append(joining)
        t = time.monotonic()
        try:
            _wait_serving(join_port, joining, timeout)
            joined = time.monotonic() - t
        except TimeoutError:
            joined = float("inf")
        return {"join_cores": join_cores, "first_start_idle_s": round(idle, 1), "join_under_load_s": round(joined, 1),
                "ratio_to_idle": round(joined / idle, 2), "first_tokens_per_s_under_load": round(rate, 1)}
    finally:
        stop.set()
        for proc in procs:
            _kill(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--join-cores", nargs="+", default=["all", "1-1"],
                        help="sampler.cpu_cores of the joining replica, one case each")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the joining replica may take")
    parser.add_argument("--logs", type=Path, default=Path("runs/bench_replica_join"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    results = [one_case(cores, args.timeout, args.logs) for cores in args.join_cores]
    for r in results:
        print(json.dumps(r))
    print("joining replica's start under load, by its cores: "
          + ", ".join(f"{r['join_cores']} {r['join_under_load_s']} s ({r['ratio_to_idle']}x idle)" for r in results))


if __name__ == "__main__":
    main()
