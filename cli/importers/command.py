"""`dgrpo import-config --from verl|trl FILE [-o OUT]`: a dgrpo stack config from the config a user already has.

verl: a ppo_trainer YAML (hydra-style nested sections, or dotted keys) or the run script of hydra overrides
(`python3 -m verl.trainer.main_ppo data.train_batch_size=1024 ...`, as in verl's examples/grpo_trainer).
TRL: a GRPOConfig (its TrainingArguments included) as YAML or JSON.

Every key with a counterpart is written under its dgrpo name; every other key is listed with the reason, as
comments at the end of the output and on stderr: "ignored" (dgrpo behaves the same without it) or "unsupported"
(dgrpo behaves differently). Where a peer's default differs from dgrpo's in a way that changes the objective or the
optimizer and the file does not set the key (verl's dual-clip 3.0, TRL's linear lr decay), the peer's default is
written. The output is validated with the stack schema before it is written. docs/peers.md has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from dgrpo.cli.importers.common import Imported
from dgrpo.cli.importers.read import check_unresolved, read_source
from dgrpo.cli.importers.trl import TRL_REASONS, TRL_SAME, from_trl
from dgrpo.cli.importers.verl import VERL_REASONS, VERL_SAME, from_verl
from dgrpo.common.config import ConfigError, load_config

# ---- writing -------------------------------------------------------------------------------------------------


def _nest(values: dict[str, Any]) -> dict:
    root: dict = {}
    for key, v in values.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return root


def finish(out: Imported) -> None:
    """Cross-checks a peer does implicitly: the sampler context holds prompt + response (verl's max_model_len)."""
    if "sampler.max_model_len" not in out.values:
        total = out.values.get("learner.data.max_prompt_length", 512) + out.values.get(
            "learner.rollout.max_response_length", 256)
        if total > 2048:
            out.set("sampler.max_model_len", total, "max_prompt_length + max_response_length")


def validate(out: Imported) -> None:
    """The output must load as a stack config; errors name the dgrpo key and the peer key it came from."""
    from dgrpo.cli.stack import StackConfig

    overrides = [f"{k}={json.dumps(v)}" for k, v in out.values.items()]
    try:
        load_config(StackConfig, None, overrides).check_whole_stack()
    except ConfigError as e:
        origins = [f"{k} <- {o}" for k, o in out.origin.items() if k in str(e)]
        raise ConfigError(f"{e}\n  (from: {'; '.join(origins) or 'the peer defaults'})") from None


def render(out: Imported, source: str, path: str) -> str:
    lines = [yaml.safe_dump(_nest(out.values), sort_keys=False).rstrip(), "",
             f"# Imported by `dgrpo import-config --from {source} {path}` (docs/peers.md).", "# dgrpo key <- source:"]
    lines += [f"#   {k} <- {o}" for k, o in out.origin.items()]
    for title, entries in (("ignored (no counterpart; dgrpo behaves the same)", out.ignored),
                           ("unsupported (no counterpart; dgrpo behaves differently)", out.unsupported)):
        if entries:
            lines.append(f"# {source} keys {title}:")
            lines += [f"#   {k}: {reason}" for k, reason in entries.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo import-config", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", choices=("verl", "trl"), required=True, help="the peer's format")
    parser.add_argument("file", help="verl: ppo_trainer YAML or run script of overrides; trl: GRPOConfig YAML/JSON")
    parser.add_argument("-o", "--output", help="write the dgrpo stack YAML here (default: stdout)")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="trl: training processes the batch sizes were for (per_device_* x processes)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="verl run script: a variable the script reads from the environment (repeatable; on top "
                             "of this process's environment)")
    args = parser.parse_args(argv)
    try:
        env = dict(os.environ)
        for item in args.env:
            name, eq, value = item.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise ConfigError(f"--env {item!r}: expected NAME=VALUE")
            env[name] = value
        flat = read_source(Path(args.file), env)
        same, reasons = (VERL_SAME, VERL_REASONS) if args.source == "verl" else (TRL_SAME, TRL_REASONS)
        unknown = check_unresolved(flat, same, reasons)
        out = from_verl(flat) if args.source == "verl" else from_trl(flat, args.num_processes)
        out.ignored.update(unknown)
        finish(out)
        validate(out)
    except ConfigError as e:
        print(f"dgrpo import-config: {e}", file=sys.stderr)
        return 2
    text = render(out, args.source, args.file)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {len(out.values)} keys", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for title, entries in (("ignored", out.ignored), ("unsupported", out.unsupported)):
        for k, reason in entries.items():
            print(f"{title}: {k}={flat.get(k)!r}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
