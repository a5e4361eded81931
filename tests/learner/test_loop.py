"""The learner loop against real services: two sampler replicas (vLLM on CPU, tiny model), a rewarder, weight sync.

The replicas and the rewarder are the session's shared pair (tests/shared_services.py: engine start-ups are the
expensive part; test_async.py and test_dynamic_sampling.py use the same), so they may hold an earlier learner's
versions: versions are asserted relative to the newest one a replica held before the run. The last test kills a
replica; the shared fixture replaces it before the next test that uses the pair.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from loop_support import fixed_port, read_jsonl, sampler_info, start_rewarder, write_sums
from support import ServiceProcess, free_port

from dgrpo.common import devices
from dgrpo.v1 import learner_pb2, learner_pb2_grpc, sampler_pb2

pytestmark = pytest.mark.slow
@pytest.fixture(scope="module")
def _config(_shared_replicas_session, tiny_model, tmp_path_factory):
    """This module's learner config for the shared replicas and rewarder (a lockstep run: no max_staleness)."""
    root = tmp_path_factory.mktemp("loop")
    shared = _shared_replicas_session
    config = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "sampler": {"addresses": shared.addresses, "max_model_len": 512},
        "weights": shared.weights,
        "learner": {
            "data": {**write_sums(root, 4), "train_batch_size": 2, "max_prompt_length": 64},
            "rollout": {"n": 4, "max_response_length": 16, "seed": 3, "rewarder_address": shared.rewarder.address},
            "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 8, "dtype": "float32",
                      "compute_entropy": False},
            "optim": {"lr": 1e-3},
            "checkpoint": {"save_freq": 1, "keep_last": None},
            "trainer": {"total_training_steps": 2, "test_freq": 2, "control_port": 0,
                        "log_dir": str(root / "runs")},
        },
    }
    (root / "stack.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "config": root / "stack.yaml"}


@pytest.fixture
def stack(shared_replicas, _config):
    """The shared replicas (whole: one killed by an earlier test is replaced) and this module's config."""
    return {**_config, "shared": shared_replicas, "samplers": shared_replicas.samplers,
            "rewarder": shared_replicas.rewarder}


def test_short_run_trains_publishes_and_logs(stack, tiny_model):
    """`dgrpo learner --config ... overrides`: 2 steps, weights change, versions increase, samplers serve them."""
    root = stack["root"]
    base = stack["shared"].fresh_run_base()
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]),
           f"learner.checkpoint.dir={root / 'ckpt_a'}", "learner.trainer.run_name=a",
           "learner.trainer.loggers=[console,jsonl,tensorboard]"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-6000:]

    records = read_jsonl(root / "runs" / "a" / "metrics.jsonl")
    steps = [r for r in records if "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in steps)
    assert [r["weights/version"] for r in steps] == [base + 1.0, base + 2.0]
    assert all(r["rollout/replicas"] == 2 and r["rollout/failed_calls"] == 0 for r in steps)
    # One prompt per replica, unless a replica lagging (e.g. still loading the version) had its prompt hedged.
    assert all(r.get("rollout/groups_by_replica/r0") == r.get("rollout/groups_by_replica/r1") == 1
               or (r["rollout/hedged_prompts"] >= 1
                   and r.get("rollout/groups_by_replica/r0", 0) + r.get("rollout/groups_by_replica/r1", 0) == 2)
               for r in steps), [{k: v for k, v in r.items() if k.startswith("rollout/")} for r in steps]
    assert all(r["rollout/stale_completions"] == 0 for r in steps)  # step 2 sampled on version 1
    assert all(r["bottleneck"] in ("generate", "reward", "logprob", "train", "weight_sync") for r in steps)
    assert {"time/generate_s", "time/train_s", "time/weight_sync_s", "reward/mean"} <= set(steps[0])
    assert any("val/reward_mean" in r for r in records)
    assert list((root / "runs" / "a" / "tensorboard").glob("events.out.tfevents.*"))
    assert "bottleneck" in proc.stderr and "step 2/2" in proc.stderr

    from safetensors.torch import load_file

    initial = load_file(str(Path(tiny_model) / "model.safetensors"))
    trained = torch.load(root / "ckpt_a" / "step_2" / "model.pt", weights_only=True)
    assert any(not torch.equal(trained[k].float(), initial[k].float()) for k in initial if k in trained)
    for svc in stack["samplers"]:  # every replica loaded the last version
        assert sampler_info(svc.address).weight_version == base + 2


def test_resume_repeats_the_uninterrupted_step_and_stop_rpc(stack):
    """Resume from step 1 of run a: step 2 draws the same prompts and yields bit-identical weights; Stop works."""
    from dgrpo.cli.main import main

    root = stack["root"]
    held = stack["shared"].newest_version()
    run_a = [r for r in read_jsonl(root / "runs" / "a" / "metrics.jsonl") if "actor/loss" in r]
    argv = ["learner", "--config", str(stack["config"]), f"learner.checkpoint.resume={root / 'ckpt_a' / 'step_1'}",
            f"learner.checkpoint.dir={root / 'ckpt_b'}", "learner.trainer.run_name=b",
            "learner.trainer.total_training_steps=6", f"learner.trainer.control_port={fixed_port()}"]
    control = argv[-1].split("=")[1]
    seen: list[learner_pb2.LearnerStatus] = []

    def stop_during_step_2() -> None:
        fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 500)]
        with grpc.insecure_channel(f"127.0.0.1:{control}", options=fast_reconnect) as ch:
            stub = learner_pb2_grpc.LearnerStub(ch)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    status = stub.Status(learner_pb2.StatusRequest(), timeout=5)
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                seen.append(status)
                if status.step >= 2 or (status.step == 1 and status.phase == "training"):
                    stub.Stop(learner_pb2.StopRequest(reason="test"), timeout=5)
                    return
                time.sleep(0.2)

    watcher = threading.Thread(target=stop_during_step_2, daemon=True)
    watcher.start()
    assert main(argv) == 0
    watcher.join(timeout=10)

    assert seen and seen[0].total_steps == 6
    # Replicas held run a's last version (v2 on fresh replicas): the resumed weights were published as the next,
    # and each step adds one.
    assert held == run_a[-1]["weights/version"]
    assert all(s.weight_version == s.step + held for s in seen if s.phase != "setup")
    done = sorted(int(p.name.split("_")[1]) for p in (root / "ckpt_b").glob("step_*"))
    assert 2 in done and max(done) < 6  # stopped early, with a checkpoint
    a = torch.load(root / "ckpt_a" / "step_2" / "model.pt", weights_only=True)
    b = torch.load(root / "ckpt_b" / "step_2" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    step2 = lambda run: next(r for r in read_jsonl(root / "runs" / run / "metrics.jsonl") if r.get("step") == 2
                             and "actor/loss" in r)
    for key in ("reward/mean", "actor/loss", "prompt/length_mean", "data/epoch"):
        assert step2("a")[key] == step2("b")[key], key


def _status(address: str) -> learner_pb2.LearnerStatus | None:
    with grpc.insecure_channel(address) as ch:
        try:
            return learner_pb2_grpc.LearnerStub(ch).Status(learner_pb2.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return None


def _wait_status(learner: ServiceProcess, done, timeout: float = 300) -> learner_pb2.LearnerStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert learner.proc.poll() is None, f"the learner exited {learner.proc.returncode}:\n{learner.logs()[-4000:]}"
        status = _status(learner.address)
        if status is not None and done(status):
            return status
        time.sleep(0.3)
    raise AssertionError(f"no such status within {timeout:.0f} s; log:\n{learner.logs()[-4000:]}")


def test_on_end_idle_serves_status_after_stop_and_a_restart_trains_nothing(stack):
    """learner.trainer.on_end=idle (the Kubernetes StatefulSet's learner): the Stop RPC ends the run, the learner
    stays up answering Status (phase stopped) and records the end; restarted, it trains nothing; SIGTERM exits 0."""
    root = stack["root"]
    port = fixed_port()
    args = ["--config", str(stack["config"]), f"learner.checkpoint.dir={root / 'ckpt_idle'}",
            "learner.trainer.run_name=idle", "learner.trainer.total_training_steps=4", "learner.trainer.on_end=idle",
            f"learner.trainer.control_port={port}", "learner.trainer.val_before_train=false"]
    learner = ServiceProcess("learner", args, port)
    try:
        _wait_status(learner, lambda s: s.step >= 1)
        # On CPU it trains on tcmalloc where the system has it (.ci/run installs it), under the PID it started with.
        maps = Path(f"/proc/{learner.proc.pid}/maps").read_text()
        assert ("/libtcmalloc" in maps) == (devices.find_tcmalloc() is not None), "allocator not as the host allows"
        with grpc.insecure_channel(learner.address) as ch:
            stop = learner_pb2_grpc.LearnerStub(ch).Stop(learner_pb2.StopRequest(reason="k8s done"), timeout=5)
        ended = _wait_status(learner, lambda s: s.phase == "stopped")
        assert ended.step == stop.stopping_after_step < 4 and ended.stop_requested
        record = json.loads((root / "runs" / "idle" / "ended.json").read_text())
        assert record["phase"] == "stopped" and record["step"] == ended.step and record["stop_reason"] == "k8s done"
        time.sleep(2)
        assert learner.proc.poll() is None, "the learner exited: a StatefulSet would restart it"
        assert learner.stop() == 0
    finally:
        learner.kill()
    trained = len(read_jsonl(root / "runs" / "idle" / "metrics.jsonl"))

    again = ServiceProcess("learner", args, port)
    try:
        status = _wait_status(again, lambda s: s.phase == "stopped", timeout=120)
        assert (status.step, status.weight_version) == (ended.step, ended.weight_version)
        assert "ended at step" in again.logs() and "delete that file" in again.logs()
        assert again.stop() == 0
    finally:
        again.kill()
    assert len(read_jsonl(root / "runs" / "idle" / "metrics.jsonl")) == trained, "the restarted learner trained"
    assert not (root / "ckpt_idle" / f"step_{ended.step + 1}").exists()


def test_rewarder_restart_does_not_lose_a_group(child_processes, tmp_path):
    """A group sent while the rewarder is down is scored once it is back (wait_for_ready + retry)."""
    from dgrpo.learner.rollout.reward_client import RewardClient, score_group

    port = free_port()
    first = start_rewarder(port).wait_ready(timeout=120)
    group = score_group("g0", "What is 1+1?", ["2", "22", "abc"], {"answer": "2"})

    async def scenario() -> tuple[list[float], list[float], int]:
        client = RewardClient(f"127.0.0.1:{port}", timeout_s=120, retry_backoff_s=0.2)
        before = (await client.score(group)).rewards
        first.stop()
        pending = asyncio.create_task(client.score(group))
        await asyncio.sleep(1.0)
        assert not pending.done()  # waiting for the rewarder, not failed
        second = await asyncio.to_thread(lambda: start_rewarder(port).wait_ready(timeout=120))
        try:
            after = await asyncio.wait_for(pending, 120)
        finally:
            await client.close()
            second.stop()
        return before, after.rewards, after.retries

    before, after, _ = asyncio.run(scenario())
    assert before == after == pytest.approx([1.0, 0.5, 1.0])


def test_replica_killed_mid_step_loses_and_duplicates_nothing(stack):
    """SIGKILL one replica while its stream is open: its unfinished prompts are resampled on the other one."""
    from dgrpo.learner.config import RolloutConfig
    from dgrpo.learner.rollout.client import RolloutClient, RolloutStats, make_prompt

    victim, survivor = stack["samplers"]
    prompts = [make_prompt(f"p{i}", [1, 2, 3, 10 + i]) for i in range(8)]
    sampling = sampler_pb2.SamplingParams(n=2, max_tokens=100, temperature=1.0)
    cfg = RolloutConfig(prompts_per_request=2, retry_backoff_s=0.2, max_backoff_s=1.0, step_timeout_s=300)

    async def scenario() -> tuple[list[sampler_pb2.Group], RolloutStats]:
        client = RolloutClient([victim.address, survivor.address], cfg)
        stats, groups = RolloutStats(), []
        try:
            async for group in client.generate(prompts, sampling, stats=stats):
                groups.append(group)
                if len(groups) == 1:
                    victim.kill()
        finally:
            await client.close()
        return groups, stats

    groups, stats = asyncio.run(scenario())
    ids = [g.prompt_id for g in groups]
    assert sorted(ids) == sorted(p.id for p in prompts) and len(set(ids)) == len(ids)
    assert all(len(g.completions) == 2 for g in groups)
    assert stats.failed_calls >= 1 and stats.retried_prompts >= 1
    assert stats.groups_by_replica["r1"] > len(prompts) // 2  # the survivor did the killed replica's share
