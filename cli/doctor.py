"""`dgrpo doctor [--config FILE] [--service NAME ...] [--json] [KEY=VALUE ...]`: check this host before a launch.

Per service of the config: installed packages against the verified matrix (docs/versions.md), the CANN toolkit on
Ascend, the device and its memory, the collective backend, the environment variables the Ascend stack reads, free
ports, /dev/shm against two weight slots, the model folder, whether the configured addresses answer health, and
`dgrpo plan`'s memory verdict. Exit 1 when any finding is FAIL: the services themselves refuse to start on the same
findings (`DGRPO_DOCTOR=warn` lets them start anyway).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dgrpo.common.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo doctor", description=__doc__.split("\n\n")[1],
                                     epilog="Overrides: dotted KEY=VALUE pairs, as for every dgrpo command.")
    parser.add_argument("--config", metavar="FILE", help="stack YAML (default: every default, the bundled model)")
    parser.add_argument("--service", action="append", choices=["sampler", "rewarder", "learner"],
                        help="check only this service (repeatable; default: all three)")
    parser.add_argument("--no-network", action="store_true", help="skip the health probes of configured addresses")
    parser.add_argument("--json", action="store_true", help="one JSON object: findings and counts")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.doctor import SERVICES, run_checks

    try:
        cfg = load_config(StackConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"dgrpo doctor: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    findings = run_checks(cfg, tuple(args.service or SERVICES), network=not args.no_network, memory=True)
    counts = {s: sum(f.status == s for f in findings) for s in ("OK", "WARN", "FAIL")}
    if args.json:
        print(json.dumps({"findings": [f.as_dict() for f in findings], "counts": counts,
                          "seconds": round(time.perf_counter() - t0, 3)}, indent=1))
    else:
        for f in findings:
            print(f.line())
        print(f"dgrpo doctor: {counts['OK']} OK, {counts['WARN']} WARN, {counts['FAIL']} FAIL "
              f"({time.perf_counter() - t0:.2f} s)")
    return 1 if counts["FAIL"] else 0
