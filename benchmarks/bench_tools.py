"""Per-call overhead of the tool sandbox: median wall time of calculator calls, strict vs process level.

The calculator itself takes microseconds, so the figure is the cost of the isolation: starting a fresh interpreter
(`python -I -m dgrpo.tools.child`), namespaces and read-only remounts (strict), the fork of the tool process,
and the JSON round trip. It bounds how often a rollout can afford a tool call: a decode step of the 135M model on
CPU is ~10-30 ms, so one call costs a few dozen tokens' worth of time. One warm-up call, then `--calls` timed ones,
sequential, then the same calls from `--threads` threads at once (throughput).

    python benchmarks/bench_tools.py [--calls 20] [--threads 8] [--levels strict process]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--levels", nargs="+", default=["strict", "process"], choices=["strict", "process"])
    args = ap.parse_args()

    from dgrpo.tools import SandboxUnavailable, ToolCall, ToolLimits, ToolRunner
    from dgrpo.tools.builtins import calculator
    from dgrpo.tools.spec import builtin_toolset

    t0 = time.perf_counter()
    for _ in range(1000):
        calculator("987654321 * 123456789")
    print(f"in-process calculator: {(time.perf_counter() - t0) * 1e3:.1f} us per call (no sandbox)")
    call = ToolCall("calculator", {"expression": "987654321 * 123456789"}, "")
    for level in args.levels:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                runner = ToolRunner(builtin_toolset("calculator"), ToolLimits(timeout_s=10), scratch, sandbox=level)
            except SandboxUnavailable as e:
                print(f"{level}: unavailable ({e})")
                continue
            runner.run(call)  # warm-up: page cache, imports
            times = []
            for _ in range(args.calls):
                res = runner.run(call)
                assert res.ok and res.text == "121932631112635269", res
                times.append(res.seconds)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                results = list(pool.map(runner.run, [call] * args.calls))
            wall = time.perf_counter() - t0
            assert all(r.ok for r in results)
            q = statistics.quantiles(times, n=10)
            print(f"{level}: median {statistics.median(times) * 1e3:.0f} ms per call (p10 {q[0] * 1e3:.0f}, "
                  f"p90 {q[-1] * 1e3:.0f}; {args.calls} sequential calls); {args.threads} threads: "
                  f"{args.calls / wall:.1f} calls/s")
            print(f"  isolation: {runner.isolation}")
            runner.close()


if __name__ == "__main__":
    main()
