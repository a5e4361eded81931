"""Demo of multi-turn rollouts with a calculator (issue 16): reward and tool-call rate per step, with and without tools.

Task: 3-digit x 2-digit multiplication (the bundled SmolLM2-135M-Instruct alone is right a few percent of the time).
The same prompts, seeds and settings (configs/tools-demo.yaml) run twice with `dgrpo up`: once with
learner.rollout.multi_turn.enable=true (the sampler injects the calculator's schema, runs the calls in the sandbox),
once with it false. Prints reward/mean and multi_turn/tool_call_rate per step, and the mean of the first and last
steps of each run.

    python benchmarks/demo_tools.py [--steps 10]      # both runs, ~10-20 min on 2 CPU cores
    python benchmarks/demo_tools.py --write-only       # only data/mdmul-*.parquet and data/calculator-tools.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
CONFIG = ROOT / "configs" / "tools-demo.yaml"
HINT = (' You can call the calculator: <tool_call>\n{"name": "calculator", "arguments": {"expression": "..."}}\n'
        "</tool_call>")


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        question = f"What is {a} * {b}?{HINT} Give the final answer as a number."
        out.append({"prompt": [{"role": "user", "content": question}], "answer": str(a * b)})
    return out


def write_data() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    DATA.mkdir(exist_ok=True)
    for split, n, seed in (("train", 512, 0), ("val", 32, 1)):
        pq.write_table(pa.Table.from_pylist(rows(n, seed)), DATA / f"mdmul-{split}.parquet")
    (DATA / "calculator-tools.yaml").write_text(yaml.safe_dump({"tools": [{"class_name": "calculator"}]}))


def run(tools: bool, steps: int, log_dir: Path) -> list[dict]:
    name = "tools_demo_on" if tools else "tools_demo_off"
    cmd = [sys.executable, "-m", "dgrpo.cli", "up", "--config", str(CONFIG), "--no-demo-data",
           f"learner.rollout.multi_turn.enable={str(tools).lower()}", f"learner.trainer.total_training_steps={steps}",
           f"learner.trainer.run_name={name}", f"learner.trainer.log_dir={log_dir}", "learner.rollout.seed=1"]
    t0 = time.monotonic()
    with open(log_dir / f"{name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code:
        raise SystemExit(f"{name}: dgrpo up exited {code}; see {log_dir / (name + '.log')}")
    records = [json.loads(line) for line in (log_dir / name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward/mean" in r]
    print(f"{name}: {len(records)} steps in {time.monotonic() - t0:.0f} s", flush=True)
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--write-only", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "runs" / "demo_tools")
    args = parser.parse_args()
    write_data()
    if args.write_only:
        return 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = {tools: run(tools, args.steps, args.log_dir) for tools in (True, False)}
    print("\n| step | reward, tools | tool-call rate | turns/sample | reward, no tools |\n|---|---|---|---|---|")
    on, off = results[True], results[False]
    for i in range(max(len(on), len(off))):
        a = on[i] if i < len(on) else {}
        b = off[i] if i < len(off) else {}
        print(f"| {i + 1} | {a.get('reward/mean', float('nan')):.3f} | {a.get('multi_turn/tool_call_rate', 0):.3f} | "
              f"{a.get('multi_turn/turns_mean', 0):.2f} | {b.get('reward/mean', float('nan')):.3f} |")
    k = max(1, min(len(on), len(off)) // 3)
    for label, recs in (("tools", on), ("no tools", off)):
        first = sum(r["reward/mean"] for r in recs[:k]) / k
        last = sum(r["reward/mean"] for r in recs[-k:]) / k
        rate = [r.get("multi_turn/tool_call_rate", 0.0) for r in recs]
        print(f"{label}: reward first {k} steps {first:.3f} -> last {k} {last:.3f}; tool-call rate "
              f"{sum(rate[:k]) / k:.3f} -> {sum(rate[-k:]) / k:.3f}; step time "
              f"{sum(r['time/step_s'] for r in recs) / len(recs):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
