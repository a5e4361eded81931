"""Where the suite's time goes: per-module seconds and what each module starts, from pytest's junit XML.

    python scripts/test_report.py reports/*.xml [--top 15]

A test's time is its set-up, call and tear-down (junit's default), so a module's sum includes the engines its
fixtures start. The starts (engines, services, stacks, containers, netns) are the junit properties tests/tiers.py
records from every process a test's process starts (docs/testing.md).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

KINDS = ("engines", "services", "stacks", "containers", "images", "netns", "schedulers")


def module_of(case: ET.Element) -> str:
    """tests/learner/test_loop.py from classname `tests.learner.test_loop` (or `...test_loop.TestClass`)."""
    parts = case.get("classname", "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else case.get("classname", "?")


def read(paths: list[Path]) -> list[dict]:
    cases = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                       else "skipped" if case.find("skipped") is not None else "passed")
            cases.append({"module": module_of(case), "name": case.get("name"), "time": float(case.get("time", 0)),
                          "tier": props.get("tier", "?"), "outcome": outcome,
                          **{kind: int(props.get(kind, 0)) for kind in KINDS}})
    return cases


def table(cases: list[dict]) -> str:
    modules: dict[str, dict] = collections.defaultdict(lambda: collections.Counter())
    tiers: dict[str, set] = collections.defaultdict(set)
    for case in cases:
        row = modules[case["module"]]
        row["tests"] += 1
        row["time"] += case["time"]
        for kind in KINDS:
            row[kind] += case[kind]
        tiers[case["module"]].add(case["tier"])
    total = sum(row["time"] for row in modules.values())
    lines = ["| module | tier | tests | seconds | share | " + " | ".join(KINDS) + " |",
             "|---|---|---|---|---|" + "---|" * len(KINDS)]
    for name, row in sorted(modules.items(), key=lambda kv: -kv[1]["time"]):
        lines.append(f"| {name} | {'+'.join(sorted(tiers[name]))} | {row['tests']} | {row['time']:.0f} | "
                     f"{100 * row['time'] / max(total, 1e-9):.1f}% | "
                     + " | ".join(str(row[kind]) for kind in KINDS) + " |")
    by_tier = collections.Counter()
    for case in cases:
        by_tier[case["tier"]] += case["time"]
    lines.append(f"| **all** | {', '.join(f'{t} {s:.0f} s' for t, s in sorted(by_tier.items()))} | {len(cases)} | "
                 f"{total:.0f} | 100% | " + " | ".join(str(sum(r[k] for r in modules.values())) for k in KINDS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="also list the N slowest tests")
    args = parser.parse_args()
    cases = read([p for p in args.reports if p.exists()])
    print(table(cases))
    if args.top:
        print(f"\nslowest {args.top} tests (set-up + call + tear-down):")
        for case in sorted(cases, key=lambda c: -c["time"])[: args.top]:
            print(f"  {case['time']:7.1f} s  {case['tier']:<11} {case['module']}::{case['name']}  {case['outcome']}")
    failed = [c for c in cases if c["outcome"] == "failed"]
    print(f"\n{len(cases)} tests, {len(failed)} failed" + "".join(f"\n  FAILED {c['module']}::{c['name']}"
                                                                 for c in failed))


if __name__ == "__main__":
    main()
