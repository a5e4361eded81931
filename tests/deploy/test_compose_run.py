"""`docker compose up` for real: the CPU images, one then two then one sampler replicas, a killed sampler, both
reward hot swaps, a learner that crashes and is restarted by its policy, the learner stopped from the host, and
`down -v` leaving nothing behind. (The shipped demo config, and a learner killed by `docker kill`:
test_compose_demo.py.)

One run of deploy/docker-compose.yml as a user starts it (only variables and a config file of our own: the tiny
model instead of SmolLM2 so that two vLLM replicas and the learner fit on 2 cores, long completions so a step
spends seconds sampling, no step limit: the test stops the learner). The run is a chain of module-scoped phase
fixtures (`one_replica` -> `scaled_up` -> `replica_killed` -> `scaled_down` -> `reloaded` -> `swapped` ->
`learner_crashed` -> `stopped` -> `downed`), each doing what a user or a fault does and keeping what it saw; every
test checks one property of one phase, so a broken property is named by its test and the others are still checked.
Every claim is read from what the stack reports: Docker's health status (the gRPC health probe), the learner's
metrics.jsonl (groups per replica, retried prompts, reward spec version and functions per step), the learner's
Status RPC, a sampler's Info RPC.

Needs a Docker daemon (.ci/run starts one when it can). Without one the tests are skipped with the reason printed;
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


# A phase's set-up is its test's: the replica added mid-run takes minutes to start on 2 cores shared with a training
# learner (240 s in CI), the first phase may build the image (~250 s cold).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LABEL = "test_compose_run"


@pytest.fixture(scope="module")
def stack(docker_ready, tiny_model, tmp_path_factory):
    stack = tiny_stack(tmp_path_factory.mktemp("compose_run"), tiny_model)
    try:
        yield stack
    finally:
        stack.down(LABEL)


@pytest.fixture(scope="module")
def one_replica(stack):
    """`up -d` with one replica, every container healthy through its probe, a step on groups from the replica."""
    with stack.phase("healthy"):
        cids = stack.up_healthy(("rewarder", "learner", "sampler"))
    with stack.phase("first_step"):
        first = stack.wait_step(lambda r: len(replicas(r)) == 1, "with groups from the replica")
    holder = stack.note_namespaces()
    return {"cids": cids, "first": first, "holder": holder, "health": {c: stack.health(c) for ids in cids.values()
                                                                     for c in ids}}


@pytest.fixture(scope="module")
def scaled_up(stack, one_replica):
    """`--scale sampler=2` while training: the new replica's Info when it turns healthy, and the replicas that
    served groups after it (both, in one step or over several: with two replicas on 2 cores the rollout's straggler
    watch often hedges one's prompts on the other, and the first complete group wins)."""
    with stack.phase("second_replica_healthy"):
        version_before = stack.learner_rpc("Status").weight_version
        assert version_before >= 1, "the learner has published no weights yet"
        stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=2", "sampler", timeout=600)
        new = [c for c in stack.containers("sampler") if c not in one_replica["cids"]["sampler"]]
        assert len(new) == 1, new
        stack.wait_healthy(new)
        info = stack.sampler_info(new[0])
    with stack.phase("second_replica_serving"):
        served: set[str] = set()
        both = stack.wait_step(lambda r: bool(served.update(replicas(r))) or len(served) == 2,
                               "with groups from both replicas", after=one_replica["first"]["step"])
    return {"new": new[0], "info": info, "version_before": version_before, "served": served, "both": both}


@pytest.fixture(scope="module")
def replica_killed(stack, scaled_up):
    """`docker kill` of the newest replica (the one `--scale sampler=1` removes: a stopped survivor would be started
    again) while the learner samples; the step that saw it, and one after."""
    with stack.phase("kill_and_recovery"):
        deadline = time.monotonic() + 300
        while stack.learner_rpc("Status").phase != "sampling":
            assert time.monotonic() < deadline, "the learner never entered its sampling phase"
            time.sleep(0.05)
        killed_during = stack.learner_rpc("Status").step + 1
        run(["docker", "kill", scaled_up["new"]])
        hit = stack.wait_step(lambda r: r["rollout/failed_calls"] > 0 or r["rollout/retried_prompts"] > 0,
                              "that saw the killed replica's stream fail", after=killed_during - 1, timeout=300)
        after = stack.wait_step(lambda r: True, "after the kill", after=hit["step"] + 1)
    return {"killed_during": killed_during, "hit": hit, "after": after}


@pytest.fixture(scope="module")
def scaled_down(stack, replica_killed):
    with stack.phase("scale_to_1"):
        stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=1", "sampler", timeout=600)
        left = stack.containers("sampler")
        one = stack.wait_step(lambda r: len(replicas(r)) == 1, "on one replica", after=stack.steps()[-1]["step"])
    return {"left": left, "one": one}


@pytest.fixture(scope="module")
def reloaded(stack, scaled_down):
    """The reward spec edited in place and the rewarder sent SIGHUP (docs/deploy.md)."""
    with stack.phase("reload_in_place"):
        first_version = scaled_down["one"]["reward/spec_version_max"]
        spec = yaml.safe_load((stack.rewards / "spec.yaml").read_text())
        spec["name"] = "math-v2"
        (stack.rewards / "spec.yaml").write_text(yaml.safe_dump(spec))
        stack("kill", "-s", "SIGHUP", "rewarder")
        step = stack.wait_step(lambda r: r["reward/spec_version_min"] > first_version, "scored by the reloaded spec",
                               after=scaled_down["one"]["step"])
    return {"first_version": first_version, "step": step}


@pytest.fixture(scope="module")
def swapped(stack, reloaded):
    """A second rewarder (profile `swap`, spec-next) started, then the first stopped."""
    with stack.phase("second_rewarder"):
        stack("--profile", "swap", "up", "-d", "--no-deps", "rewarder-next", timeout=600)
        stack.wait_healthy(stack.containers("rewarder-next"), timeout=300)
        stack("stop", "rewarder", timeout=120)
        step = stack.wait_step(lambda r: "reward/fn/brevity" in r, "scored by rewarder-next",
                               after=reloaded["step"]["step"])
        after = stack.wait_step(lambda r: True, "after the swap", after=step["step"])
    return {"step": step, "after": after}


@pytest.fixture(scope="module")
def learner_crashed(stack, swapped):
    """The learner's process SIGKILLed from the host while it samples, as the kernel's OOM killer would (`docker
    kill` is a manual stop, which no restart policy restarts); the first step it trains after its restart."""
    with stack.phase("learner_crash_to_resumed_step"):
        learner, sampler = stack.containers("learner")[0], stack.containers("sampler")[0]
        sampler_started = inspect(sampler, "{{.State.StartedAt}}")
        status = stack.wait_phase("sampling", after_step=swapped["step"]["step"] + 1)
        os.kill(int(inspect(learner, "{{.State.Pid}}")), signal.SIGKILL)
        resumed = stack.wait_step(lambda r: r["weights/version"] > status.weight_version, "trained after the restart",
                                  after=status.step - status.step % 2, timeout=600)
    return {"learner": learner, "sampler": sampler, "sampler_started": sampler_started, "crashed_at": status.step,
            "resumed": resumed}


@pytest.fixture(scope="module")
def stopped(stack, learner_crashed):
    """The Stop RPC from the host (the published control port, with the token)."""
    with stack.phase("stop_rpc_to_exit"):
        last = stack.learner_rpc("Stop", reason="compose test").stopping_after_step
        learner = stack.containers("learner")[0]
        code = stack.wait_exit(learner, timeout=300)
    return {"last": last, "learner": learner, "code": code, "steps": stack.steps()}


# 1. One replica


def test_every_container_turns_healthy_through_its_grpc_probe(one_replica):
    assert all(state == "running healthy" for state in one_replica["health"].values()), one_replica["health"]


def test_learner_and_sampler_map_the_weight_slots_of_the_shared_memory_holder(stack, one_replica):
    """The holder's /dev/shm (what the learner and every sampler map) holds the weight slots, named with the PID
    namespace all of them share."""
    learner, sampler = one_replica["cids"]["learner"][0], one_replica["cids"]["sampler"][0]
    slots = stack.slots(learner)
    assert slots and all(stack.shm_pidns in s for s in slots), slots
    assert stack.slots(sampler) == slots, "the sampler does not see the slots"
    assert inspect(one_replica["holder"], "{{.HostConfig.IpcMode}}") == "shareable"


# 2. Scaled to two replicas while training (one engine more, not two: three replicas and the learner on 2 cores
# proved nothing two do not, at minutes per start-up)


def test_a_replica_added_mid_run_holds_the_latest_weights_when_healthy(scaled_up):
    assert scaled_up["info"]["weight_version"] >= scaled_up["version_before"], scaled_up


def test_the_added_replica_maps_the_same_weight_slots(stack, one_replica, scaled_up):
    assert stack.slots(scaled_up["new"]) == stack.slots(one_replica["cids"]["learner"][0])


def test_the_added_replica_binds_cores_of_its_own(stack, one_replica, scaled_up):
    # sampler.cpu_cores=all: alone, every core; joining, the share common/cpu_leases.py leases it away from the busy
    # replica's lowest core, where that engine's main thread runs (217 s to SERVING there against 48 s elsewhere)
    first = stack.bound_cores(one_replica["cids"]["sampler"][0])
    joined = stack.bound_cores(scaled_up["new"])
    assert first == sorted(os.sched_getaffinity(0)) and joined and min(first) not in joined, (first, joined)
    assert len(joined) == max(1, len(first) // 2), (first, joined)


def test_both_replicas_serve_groups(scaled_up):
    assert len(scaled_up["served"]) == 2 and scaled_up["info"]["replica_id"] in scaled_up["served"], scaled_up


# 3. A replica killed mid-sampling


def test_a_killed_replicas_prompts_are_retried_in_the_step_it_died_in(replica_killed):
    hit = replica_killed["hit"]
    assert hit["step"] == replica_killed["killed_during"], \
        f"the kill during step {replica_killed['killed_during']} showed up in step {hit['step']}"
    print(f"\n[{LABEL}] kill in step {hit['step']}: {hit['rollout/failed_calls']:.0f} failed calls, "
          f"{hit['rollout/retried_prompts']:.0f} prompts retried, groups {replicas(hit)}")


# 4. Scaled down


def test_scaling_down_leaves_one_replica_serving_every_group(scaled_down):
    assert len(scaled_down["left"]) == 1, scaled_down["left"]
    assert sum(replicas(scaled_down["one"]).values()) == BATCH


# 5. Reward hot swaps


def test_sighup_reloads_the_edited_reward_spec(reloaded):
    assert reloaded["step"]["reward/spec_version_min"] > reloaded["first_version"]


def test_a_second_rewarder_takes_over_from_the_first(swapped):
    """spec-next's `brevity` function scores the steps once rewarder-next serves and the first is stopped."""
    assert "reward/fn/brevity" in swapped["after"], sorted(swapped["after"])


# 6. The learner crashes


def test_a_crashed_learner_is_restarted_by_its_policy_and_resumes_from_its_checkpoint(stack, learner_crashed):
    """Docker's on-failure policy restarts the same container, which resumes from its newest checkpoint
    (save_freq 2) and trains on."""
    learner, crashed_at = learner_crashed["learner"], learner_crashed["crashed_at"]
    assert stack.containers("learner") == [learner] and int(inspect(learner, "{{.RestartCount}}")) >= 1
    logs = run(["docker", "logs", learner]).stderr
    resumed_from = crashed_at - crashed_at % 2
    assert f"resumed from /opt/dgrpo/runs/checkpoints/step_{resumed_from} at step {resumed_from}" in logs, \
        logs[-3000:]


def test_the_replica_that_stayed_up_serves_the_resumed_learner(stack, learner_crashed):
    """Neither the replica's container nor its process restarted with the learner."""
    sampler = learner_crashed["sampler"]
    assert stack.containers("sampler") == [sampler]
    assert inspect(sampler, "{{.State.StartedAt}}") == learner_crashed["sampler_started"]
    assert replicas(learner_crashed["resumed"]) == {stack.sampler_info(sampler)["replica_id"]: BATCH}
    assert stack.sampler_info(sampler)["weight_version"] >= learner_crashed["resumed"]["weights/version"]


# 7. Stopped from the host


def test_the_stop_rpc_ends_the_run_and_the_learner_stays_down(stack, stopped):
    assert stopped["code"] == 0
    assert stack.health(stopped["learner"]).startswith("exited"), "a finished run must stay down"
    assert stopped["steps"][-1]["step"] == stopped["last"]


def test_every_step_trained_once_on_a_whole_batch(stopped):
    """Through a scale-up, a killed replica, a scale-down, two reward swaps and a crashed learner: consecutive
    steps, each on exactly BATCH groups, none duplicated into training."""
    steps = stopped["steps"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "a step failed or was skipped"
    for r in steps:
        assert sum(replicas(r).values()) == BATCH, f"step {r['step']} trained on {replicas(r)} groups"
    print(f"\n[{LABEL}] {len(steps)} steps, {sum(r['rollout/duplicates_dropped'] for r in steps):.0f} duplicates "
          f"dropped")


def test_down_leaves_nothing_behind(stack, stopped):
    """`down -v`: no container, network or volume of the project, the holder's /dev/shm unmounted, no segment of
    the stack's in the host's /dev/shm."""
    stack.down(LABEL)
