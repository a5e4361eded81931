"""The learner loop against real services: two sampler replicas (vLLM on CPU, tiny model), a rewarder, weight sync.

One module-scoped stack serves every test (engine start-ups are the expensive part). Order matters: the last test
kills a replica.
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
from loop_support import fixed_port, read_jsonl, sampler_info, start_rewarder
from support import ServiceProcess, free_port

from dgrpo.v1 import learner_pb2, learner_pb2_grpc, sampler_pb2

pytestmark = pytest.mark.slow
@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """Rewarder + two sampler replicas subscribed to weight sync on free ports; all started in parallel."""
    root = tmp_path_factory.mktemp("loop")
    announce, control = fixed_port(), fixed_port()
    weights = [f"weights.announce_port={announce}", f"weights.control_port={control}"]
    samplers = [
        ServiceProcess("sampler", [f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}",
                                   "sampler.host=127.0.0.1", "sampler.enforce_eager=true", "sampler.max_model_len=512",
                                   f"sampler.replica_id=r{i}", "sampler.shutdown_grace_s=1", *weights], port)
        for i, port in enumerate([free_port(), free_port()])
    ]
    rewarder = start_rewarder(free_port())
    try:
        for svc in [rewarder, *samplers]:
            svc.wait_ready(timeout=400)
        rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(4) for b in range(4)]
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
        config = {
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "sampler": {"addresses": [s.address for s in samplers], "max_model_len": 512},
            "weights": {"announce_port": announce, "control_port": control},
            "learner": {
                "data": {"train_files": [str(root / "train.jsonl")], "val_files": [str(root / "val.jsonl")],
                         "train_batch_size": 2, "max_prompt_length": 64},
                "rollout": {"n": 4, "max_response_length": 16, "seed": 3, "rewarder_address": rewarder.address},
                "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 8, "dtype": "float32",
                          "compute_entropy": False},
                "optim": {"lr": 1e-3},
                "checkpoint": {"save_freq": 1, "keep_last": None},
                "trainer": {"total_training_steps": 2, "test_freq": 2, "control_port": 0,
                            "log_dir": str(root / "runs")},
            },
        }
        (root / "stack.yaml").write_text(yaml.safe_dump(config))
        yield {"root": root, "config": root / "stack.yaml", "samplers": samplers, "rewarder": rewarder}
    finally:
        for svc in [rewarder, *samplers]:  # SIGTERM all first: they shut down in parallel
            if svc.proc.poll() is None:
                svc.proc.terminate()
        for svc in [rewarder, *samplers]:
            svc.stop(timeout=30)


def test_short_run_trains_publishes_and_logs(stack, tiny_model):
    """`dgrpo learner --config ... overrides`: 2 steps, weights change, versions increase, samplers serve them."""
    root = stack["root"]
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]),
           f"learner.checkpoint.dir={root / 'ckpt_a'}", "learner.trainer.run_name=a",
           "learner.trainer.loggers=[console,jsonl,tensorboard]"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-6000:]

    records = read_jsonl(root / "runs" / "a" / "metrics.jsonl")
    steps = [r for r in records if "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in steps)
    assert [r["weights/version"] for r in steps] == [1.0, 2.0]
    assert all(r["rollout/replicas"] == 2 and r["rollout/failed_calls"] == 0 for r in steps)
    assert all(r["rollout/groups_by_replica/r0"] == r["rollout/groups_by_replica/r1"] == 1 for r in steps)
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
        assert sampler_info(svc.address).weight_version == 2


def test_resume_repeats_the_uninterrupted_step_and_stop_rpc(stack):
    """Resume from step 1 of run a: step 2 draws the same prompts and yields bit-identical weights; Stop works."""
    from dgrpo.cli.main import main

    root = stack["root"]
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
    # Replicas held run a's v2: the resumed weights were published as v3, and each step adds one.
    assert all(s.weight_version == s.step + 2 for s in seen if s.phase != "setup")
    done = sorted(int(p.name.split("_")[1]) for p in (root / "ckpt_b").glob("step_*"))
    assert 2 in done and max(done) < 6  # stopped early, with a checkpoint
    a = torch.load(root / "ckpt_a" / "step_2" / "model.pt", weights_only=True)
    b = torch.load(root / "ckpt_b" / "step_2" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    step2 = lambda run: next(r for r in read_jsonl(root / "runs" / run / "metrics.jsonl") if r.get("step") == 2
                             and "actor/loss" in r)
    for key in ("reward/mean", "actor/loss", "prompt/length_mean", "data/epoch"):
        assert step2("a")[key] == step2("b")[key], key


def test_rewarder_restart_does_not_lose_a_group(tmp_path):
    """A group sent while the rewarder is down is scored once it is back (wait_for_ready + retry)."""
    from dgrpo.learner.reward_client import RewardClient, score_group

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
    from dgrpo.learner.rollout import RolloutClient, RolloutConfig, RolloutStats, make_prompt

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
