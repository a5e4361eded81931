"""`dgrpo plan --config FILE [--learner-ranks N] [--device D] [--device-memory-gb G] [--json] [KEY=VALUE ...]`.

Memory per device of each service from the model's config.json (no weights loaded) and the config's knobs: the
learner's weights, gradients, AdamW states, reference, activations per micro-batch and logits; the sampler's
weights, KV cache per token and how many tokens and sequences fit; the weight slots in /dev/shm. Says what does not
fit and the knob to turn first (cli/doctor/memory.py has the formulas and their sources). Exit 1 when something does not
fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dgrpo.common.config import ConfigError, load_config
from dgrpo.common.preflight import fmt_bytes


def _print_part(part, title: str) -> None:
    where = f", {part.devices} device(s)" if part.service != "host" else ""
    limit = part.budget if part.budget is not None else part.device_bytes
    of = f" of {fmt_bytes(limit)}" if limit else ""
    print(f"\n{title}{where}: {fmt_bytes(part.total)}{of} per device -> {'fits' if part.fits else 'DOES NOT FIT'}")
    for t in part.terms:
        print(f"  {t.name:<24}{fmt_bytes(t.bytes):>10}  {t.formula}")
    for note in part.notes:
        print(f"  note: {note}")
    if part.problem:
        print(f"  problem: {part.problem}\n  first knob: {part.fix}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo plan", description=__doc__.split("\n\n")[1],
                                     epilog="Overrides: dotted KEY=VALUE pairs, as for every dgrpo command.")
    parser.add_argument("--config", metavar="FILE", help="stack YAML (default: every default, the bundled model)")
    parser.add_argument("--device", choices=["cpu", "cuda", "npu"],
                        help="plan for this device (default: model.device, or what this host has)")
    parser.add_argument("--device-memory-gb", type=float, metavar="G",
                        help="memory of one device in GB (default: read from nvidia-smi / npu-smi; host RAM on CPU)")
    parser.add_argument("--learner-ranks", type=int, default=int(os.environ.get("WORLD_SIZE", "1")), metavar="N",
                        help="learner ranks FSDP shards over (torchrun --nproc-per-node; default $WORLD_SIZE or 1)")
    parser.add_argument("--samplers", type=int, metavar="N", help="sampler replicas on this host (CPU: they share "
                        "its memory; default: the number of sampler.addresses)")
    parser.add_argument("--json", action="store_true", help="the plan as one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.learner_ranks < 1:
        parser.error("--learner-ranks must be >= 1")
    from dgrpo.cli.doctor.devices import device_info, resolve_device
    from dgrpo.cli.doctor.memory import plan_stack
    from dgrpo.cli.stack import StackConfig

    try:
        cfg = load_config(StackConfig, args.config, args.overrides)
        device = args.device or resolve_device(cfg.model.device)[0]
        if args.device_memory_gb is not None:
            memory = int(args.device_memory_gb * 1e9)
        else:
            info = device_info(device)
            memory = info.memory_bytes[0] if info.memory_bytes else None
        p = plan_stack(cfg, device=device, device_bytes=memory, learner_ranks=args.learner_ranks,
                       samplers=args.samplers)
    except (ConfigError, FileNotFoundError) as e:
        print(f"dgrpo plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.as_dict(), indent=1))
        return 0 if p.fits else 1
    m = p.model
    print(f"model: {m.params / 1e6:.0f}M parameters ({m.params_from}); {m.layers} layers, hidden {m.hidden}, "
          f"{m.heads} heads / {m.kv_heads} KV heads x {m.head_dim}, MLP {m.intermediate}, vocab {m.vocab}")
    print(f"device: {device}, " + (f"{fmt_bytes(memory)} per device" if memory else "memory unknown "
                                   "(--device-memory-gb)"))
    _print_part(p.learner, f"learner ({args.learner_ranks} rank(s))")
    _print_part(p.sampler, "sampler (each replica)")
    if p.shm:
        print(f"\nshared memory: {fmt_bytes(p.shm.bytes)} ({p.shm.formula})")
    if p.host:
        _print_part(p.host, "this host (every service shares its memory)")
    print(f"\ndgrpo plan: {'fits' if p.fits else 'does NOT fit'}")
    return 0 if p.fits else 1
