"""`docker compose up` for real: the CPU images, one then two then one sampler replicas, a killed sampler, both
reward hot swaps, a learner that crashes and is restarted by its policy, the learner stopped from the host, and
`down -v` leaving nothing behind. (The shipped demo config, and a learner killed by `docker kill`:
test_compose_demo.py.)

One run of deploy/docker-compose.yml as a user starts it (only variables and a config file of our own: the tiny
model instead of SmolLM2 so that two vLLM replicas and the learner fit on 2 cores, long completions so a step
spends seconds sampling, no step limit: the test stops the learner). Every claim is read from what the stack
reports: Docker's health status (the gRPC health probe), the learner's metrics.jsonl (groups per replica, retried
prompts, reward spec version and functions per step), the learner's Status RPC, a sampler's Info RPC.

Needs a Docker daemon (.ci/run starts one when it can). Without one the test is skipped with the reason printed;
the images are built by deploy/build.sh (cached: a warm build takes seconds).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml
from compose_support import DEPLOY, ROOT, Stack, inspect, replicas, run

BATCH = 8  # prompts per step: every step must get exactly this many groups, whatever happens to the samplers
RUN_NAME = "compose_test"


def tiny_stack(tmp: Path, tiny_model: Path) -> Stack:
    """The compose file with a config of this test's own (a copy of cpu-demo.yaml on the tiny model) and a token."""
    configs, rewards, runs = tmp / "configs", tmp / "rewards", tmp / "runs"
    configs.mkdir()
    runs.mkdir()
    shutil.copytree(DEPLOY / "rewards", rewards)
    shutil.copytree(tiny_model, configs / "tiny-model")
    config = yaml.safe_load((ROOT / "configs" / "cpu-demo.yaml").read_text())
    config["model"] = {"path": "/opt/dgrpo/configs/tiny-model", "dtype": "bfloat16"}
    config["sampler"].update(max_model_len=512, max_num_seqs=32, cpu_cores="all")
    learner = config["learner"]
    learner["data"]["train_batch_size"] = BATCH
    learner["rollout"].update(n=4, max_response_length=256)
    learner["actor"].update(max_tokens_per_micro_batch=4096)
    learner["checkpoint"].update(save_freq=2, export_dir=None)
    learner["trainer"].update(total_training_steps=100_000, test_freq=0, val_before_train=False, run_name=RUN_NAME)
    (configs / "test.yaml").write_text(yaml.safe_dump(config))
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    load_config(StackConfig, configs / "test.yaml", [])  # a bad key fails here, not in a crash-looping container
    variables = {"DGRPO_CONFIG": "test.yaml", "DGRPO_CONFIG_DIR": str(configs), "DGRPO_REWARDS_DIR": str(rewards),
                 "DGRPO_RUNS_DIR": str(runs), "DGRPO_SHM_SIZE": "512mb"}
    stack = Stack(variables, runs / RUN_NAME / "metrics.jsonl", token=secrets.token_urlsafe(24))
    stack.rewards = rewards
    return stack


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_up_scaled_with_faults(docker_ready, tiny_model, tmp_path):
    stack = tiny_stack(tmp_path, tiny_model)
    stack.run_phases("test_compose_run", lambda timings: _phases(stack, timings))


def _phases(stack: Stack, timings: dict[str, float]) -> None:
    t = time.monotonic()
    # 1. One replica; every container healthy through the gRPC probe; the replica serves groups.
    stack("up", "-d", timeout=900)
    cids = {s: stack.containers(s) for s in ("rewarder", "learner", "sampler")}
    assert len(cids["sampler"]) == 1 and len(cids["learner"]) == 1 and len(cids["rewarder"]) == 1, cids
    stack.wait_healthy([c for ids in cids.values() for c in ids])
    timings["healthy"] = time.monotonic() - t
    first = stack.wait_step(lambda r: len(replicas(r)) == 1, "with groups from the replica")
    timings["first_step"] = time.monotonic() - t
    # The holder's /dev/shm (what the learner and every sampler map) holds the weight slots, named with the PID
    # namespace all of them share.
    learner = cids["learner"][0]
    holder = stack.note_namespaces()
    assert stack.slots(learner) and all(stack.shm_pidns in s for s in stack.slots(learner)), stack.slots(learner)
    assert stack.slots(cids["sampler"][0]) == stack.slots(learner), "the sampler does not see the slots"
    assert inspect(holder, "{{.HostConfig.IpcMode}}") == "shareable"

    # 2. Scale to 2 while training: the new replica maps the same slots, holds the latest weights when it turns
    # healthy, then serves groups next to the first. (One engine more, not two: three replicas and the learner on
    # 2 cores proved nothing two do not, at minutes per start-up.)
    version_before = stack.learner_rpc("Status").weight_version
    assert version_before >= 1, "the learner has published no weights yet"
    stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=2", "sampler", timeout=600)
    new = [c for c in stack.containers("sampler") if c not in cids["sampler"]]
    assert len(new) == 1, new
    t = time.monotonic()
    stack.wait_healthy(new)
    info = stack.sampler_info(new[0])
    timings["second_replica_healthy"] = time.monotonic() - t
    assert info["weight_version"] >= version_before, (info, version_before)
    assert stack.slots(new[0]) == stack.slots(learner), f"sampler {new[0][:12]} does not see the slots"
    # (In one step or over several: with two replicas on 2 cores the rollout's straggler watch often hedges one's
    # prompts on the other, and the first complete group wins.)
    served: set[str] = set()
    stack.wait_step(lambda r: bool(served.update(replicas(r))) or len(served) == 2,
                    "with groups from both replicas", after=first["step"])
    assert info["replica_id"] in served
    timings["second_replica_serving"] = time.monotonic() - t
    t = time.monotonic()

    # 3. Kill a sampler while the learner samples: its prompts are retried elsewhere, training goes on. The victim
    # is the newest replica, the one `--scale sampler=1` removes (a stopped survivor would be started again).
    victim = new[0]
    deadline = time.monotonic() + 300
    while stack.learner_rpc("Status").phase != "sampling":
        assert time.monotonic() < deadline, "the learner never entered its sampling phase"
        time.sleep(0.05)
    killed_during = stack.learner_rpc("Status").step + 1
    run(["docker", "kill", victim])
    hit = stack.wait_step(lambda r: r["rollout/failed_calls"] > 0 or r["rollout/retried_prompts"] > 0,
                          "that saw the killed replica's stream fail", after=killed_during - 1, timeout=300)
    assert hit["step"] == killed_during, f"the kill during step {killed_during} showed up in step {hit['step']}"
    stack.wait_step(lambda r: True, "after the kill", after=hit["step"] + 1)

    timings["kill_and_recovery"] = time.monotonic() - t
    t = time.monotonic()

    # 4. Scale down to one replica.
    stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=1", "sampler", timeout=600)
    left = stack.containers("sampler")
    assert len(left) == 1, left
    one = stack.wait_step(lambda r: len(replicas(r)) == 1, "on one replica", after=stack.steps()[-1]["step"])

    timings["scale_to_1"] = time.monotonic() - t
    t = time.monotonic()

    # 5a. Reward hot swap in place: edit the spec file, SIGHUP the rewarder; the spec version steps up.
    first_version = one["reward/spec_version_max"]
    spec = yaml.safe_load((stack.rewards / "spec.yaml").read_text())
    spec["name"] = "math-v2"
    (stack.rewards / "spec.yaml").write_text(yaml.safe_dump(spec))
    stack("kill", "-s", "SIGHUP", "rewarder")
    reloaded = stack.wait_step(lambda r: r["reward/spec_version_min"] > first_version, "scored by the reloaded spec",
                               after=one["step"])

    timings["reload_in_place"] = time.monotonic() - t
    t = time.monotonic()

    # 5b. A second rewarder, then retire the first: steps are scored by spec-next (its `brevity` function).
    stack("--profile", "swap", "up", "-d", "--no-deps", "rewarder-next", timeout=600)
    stack.wait_healthy(stack.containers("rewarder-next"), timeout=300)
    stack("stop", "rewarder", timeout=120)
    swapped = stack.wait_step(lambda r: "reward/fn/brevity" in r, "scored by rewarder-next", after=reloaded["step"])
    stack.wait_step(lambda r: True, "after the swap", after=swapped["step"])

    timings["second_rewarder"] = time.monotonic() - t
    t = time.monotonic()

    # 5c. The learner crashes (its process SIGKILLed from the host, as the kernel's OOM killer would): Docker's
    # on-failure policy restarts the same container, which resumes from its newest checkpoint (save_freq 2) and
    # publishes to the replica that stayed up; neither the replica's container nor its process restarts.
    learner, sampler = stack.containers("learner")[0], stack.containers("sampler")[0]
    sampler_started = inspect(sampler, "{{.State.StartedAt}}")
    status = stack.wait_phase("sampling", after_step=swapped["step"] + 1)
    crashed_at, version_before = status.step, status.weight_version
    os.kill(int(inspect(learner, "{{.State.Pid}}")), signal.SIGKILL)
    resumed = stack.wait_step(lambda r: r["weights/version"] > version_before, "trained after the restart",
                              after=crashed_at - crashed_at % 2, timeout=600)
    assert stack.containers("learner") == [learner] and int(inspect(learner, "{{.RestartCount}}")) >= 1
    logs = run(["docker", "logs", learner]).stderr
    assert f"resumed from /opt/dgrpo/runs/checkpoints/step_{crashed_at - crashed_at % 2} at step " \
           f"{crashed_at - crashed_at % 2}" in logs, logs[-3000:]
    assert stack.containers("sampler") == [sampler] and inspect(sampler, "{{.State.StartedAt}}") == sampler_started
    assert replicas(resumed) == {stack.sampler_info(sampler)["replica_id"]: BATCH}
    assert stack.sampler_info(sampler)["weight_version"] >= resumed["weights/version"]
    timings["learner_crash_to_resumed_step"] = time.monotonic() - t
    t = time.monotonic()

    # Every step so far: consecutive, exactly BATCH groups, none duplicated into training.
    steps = stack.steps()
    print(f"\n[test_compose_run] kill in step {hit['step']}: {hit['rollout/failed_calls']:.0f} failed calls, "
          f"{hit['rollout/retried_prompts']:.0f} prompts retried, groups {replicas(hit)}; spec version "
          f"{first_version:.0f} -> {reloaded['reward/spec_version_min']:.0f} at step {reloaded['step']} (SIGHUP), "
          f"rewarder-next from step {swapped['step']} (version {swapped['reward/spec_version_max']:.0f}); "
          f"{len(steps)} steps, {sum(r['rollout/duplicates_dropped'] for r in steps):.0f} duplicates dropped")
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "a step failed or was skipped"
    for r in steps:
        assert sum(replicas(r).values()) == BATCH, f"step {r['step']} trained on {replicas(r)} groups"

    # 6. Stop through the control RPC from the host; the learner exits 0 and stays down.
    t = time.monotonic()
    last = stack.learner_rpc("Stop", reason="compose test").stopping_after_step
    learner = stack.containers("learner")[0]
    assert stack.wait_exit(learner, timeout=300) == 0
    assert stack.health(learner).startswith("exited"), "a finished run must stay down"
    assert stack.steps()[-1]["step"] == last
    timings["stop_rpc_to_exit"] = time.monotonic() - t
