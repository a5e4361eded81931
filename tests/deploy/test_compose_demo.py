"""`docker compose up` exactly as the README and docs/deploy.md say, on the shipped configs/cpu-demo.yaml: only the
step count (DGRPO_LEARNER_OVERRIDES) and the output folder (DGRPO_RUNS_DIR) are changed, through the documented
variables, plus the host port of the control service. The learner is killed with SIGKILL (`docker kill`) while it
samples, started again as docs/deploy.md says (`docker compose up -d learner`), resumes from its checkpoint on the
runs volume and publishes to the sampler that stayed up, which serves every version after the restart; then the
run finishes, exports, exits 0 and stays down.

Also: the image imports every optional module the shipped configurations and the defaults use, so a default that
names a package the image lacks fails here instead of in a crash-looping container.

The run is a chain of module-scoped phase fixtures (`demo_up` -> `learner_killed` -> `finished`), each test checking
one property of one phase.
"""

from __future__ import annotations

import time

import grpc
import pytest
import yaml
from compose_support import ROOT, Stack, inspect, replicas, run

STEPS = 8
SAVE_FREQ = 5  # configs/cpu-demo.yaml's learner.checkpoint.save_freq: the kill comes after its first checkpoint


# A phase's set-up is its test's: the first may build the image (~250 s cold), the restarted learner trains 3 steps of
# SmolLM2 and exports it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
LABEL = "test_compose_demo"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("compose_demo") / "runs"
    runs.mkdir()
    return runs


@pytest.fixture(scope="module")
def stack(docker_ready, runs):
    demo = yaml.safe_load((ROOT / "configs" / "cpu-demo.yaml").read_text())["learner"]
    assert demo["checkpoint"]["save_freq"] == SAVE_FREQ < STEPS, "the shipped demo's checkpoint frequency changed"
    stack = Stack({"DGRPO_RUNS_DIR": str(runs),
                   "DGRPO_LEARNER_OVERRIDES": f"learner.trainer.total_training_steps={STEPS}"},
                  runs / demo["trainer"]["run_name"] / "metrics.jsonl")
    try:
        yield stack
    finally:
        stack.down(LABEL)


@pytest.fixture(scope="module")
def demo_up(stack):
    """The README's command, detached; every container healthy."""
    with stack.phase("healthy"):
        cids = stack.up_healthy(("shm", "rewarder", "learner", "sampler"))
    stack.note_namespaces()
    sampler = cids["sampler"][0]
    return {"cids": cids, "learner": cids["learner"][0], "sampler": sampler,
            "sampler_started": inspect(sampler, "{{.State.StartedAt}}")}


@pytest.fixture(scope="module")
def learner_killed(stack, runs, demo_up):
    """SIGKILL (`docker kill`) while the learner samples the step after its first checkpoint: no chance to save or
    say goodbye. What every container's state is a few seconds later."""
    with stack.phase("trained_to_kill"):
        status = stack.wait_phase("sampling", after_step=SAVE_FREQ, timeout=900)
    checkpointed = (runs / "checkpoints" / f"step_{SAVE_FREQ}" / "meta.json").is_file()
    run(["docker", "kill", demo_up["learner"]])
    code = stack.wait_exit(demo_up["learner"], timeout=60)
    time.sleep(3)  # Docker leaves a killed container down (docs/deploy.md): nothing restarts it on its own
    others = [*demo_up["cids"]["shm"], *demo_up["cids"]["rewarder"], demo_up["sampler"]]
    return {"killed_at": status.step, "version_before": status.weight_version, "checkpointed": checkpointed,
            "code": code, "learner_state": stack.health(demo_up["learner"]),
            "others": {cid[:12]: stack.health(cid) for cid in others},
            "served_before": stack.sampler_info(demo_up["sampler"])}


@pytest.fixture(scope="module")
def finished(stack, learner_killed):
    """`docker compose up -d learner` (docs/deploy.md, "When the learner fails"), run to its end."""
    with stack.phase("restart_to_finished"):
        stack("up", "-d", "learner", timeout=600)
        learner = stack.containers("learner", all_states=True)[0]
        code = stack.wait_exit(learner, timeout=1500)
    steps = [r for r in stack.steps() if "actor/loss" in r]  # (validation records: steps 0 and 8)
    return {"learner": learner, "code": code, "steps": steps,
            "again": [r for r in steps if r["step"] > SAVE_FREQ]}


def test_no_call_goes_through_without_the_token_the_stack_made(stack, demo_up):
    """No DGRPO_TOKEN was given, and still the control service refuses a call without the stack's own token."""
    with pytest.raises(grpc.RpcError) as refused:
        stack.learner_rpc("Status", authenticated=False)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(stack.token) >= 32


def test_a_killed_learner_stays_down_and_the_others_keep_serving(learner_killed):
    assert learner_killed["checkpointed"], f"no checkpoint at step {SAVE_FREQ} before the kill"
    assert learner_killed["code"] == 137
    assert learner_killed["learner_state"].startswith("exited"), learner_killed["learner_state"]
    assert all(state.startswith("running") for state in learner_killed["others"].values()), \
        f"went down with the learner: {learner_killed['others']}"
    # The replica keeps serving the weights it has.
    assert learner_killed["served_before"]["weight_version"] == learner_killed["version_before"]


def test_the_restarted_learner_resumes_from_its_checkpoint_and_finishes(finished):
    assert finished["code"] == 0
    logs = run(["docker", "logs", finished["learner"]]).stderr
    assert f"resumed from /opt/dgrpo/runs/checkpoints/step_{SAVE_FREQ} at step {SAVE_FREQ}" in logs
    assert [r["step"] for r in finished["steps"]] == list(range(1, STEPS + 1)), "steps lost or trained twice"


def test_the_replica_that_stayed_up_serves_every_version_after_the_restart(stack, demo_up, learner_killed, finished):
    """The same replica (container, process, replica id) served every version of the restarted learner."""
    again, sampler = finished["again"], demo_up["sampler"]
    assert all(r["weights/version"] > learner_killed["version_before"] for r in again), \
        [r["weights/version"] for r in again]
    assert stack.containers("sampler") == [sampler]
    assert inspect(sampler, "{{.State.StartedAt}}") == demo_up["sampler_started"]
    assert inspect(sampler, "{{.RestartCount}}") == "0"
    replica = learner_killed["served_before"]["replica_id"]
    assert all(replicas(r) == {replica: 8.0} for r in again), [replicas(r) for r in again]
    assert stack.sampler_info(sampler)["weight_version"] == finished["steps"][-1]["weights/version"]
    assert "weights from a restarted learner of run 'cpu_demo'" in run(["docker", "logs", sampler]).stderr
    print(f"\n[{LABEL}] killed during step {learner_killed['killed_at'] + 1} (version "
          f"{learner_killed['version_before']}); resumed at step {SAVE_FREQ}, versions after the restart "
          f"{[int(r['weights/version']) for r in again]}")


def test_the_finished_run_exports_its_model(runs, finished):
    assert (runs / "cpu_demo" / "model" / "config.json").is_file(), "the finished run exported no model"


def test_down_leaves_nothing_behind(stack, finished):
    stack.down(LABEL)


@pytest.mark.slow
def test_the_image_imports_every_optional_module_the_shipped_configs_use(docker_ready):
    """Inside dgrpo:cpu: every shipped config and the defaults, their loggers checked as the learner checks them at
    start and their modules imported for real."""
    code = """
import importlib, pathlib
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config
from dgrpo.learner.records.metrics import LOGGER_PACKAGES, check_loggers
configs = sorted(pathlib.Path('/opt/dgrpo/configs').glob('*.yaml'))
assert configs, 'no configs mounted'
for cfg in [StackConfig()] + [load_config(StackConfig, c, []) for c in configs]:
    check_loggers(cfg.learner.trainer.loggers)
    for name in cfg.learner.trainer.loggers:
        if name in LOGGER_PACKAGES:
            importlib.import_module(LOGGER_PACKAGES[name][0])
print('checked', len(configs) + 1)
"""
    proc = run(["docker", "run", "--rm", "-v", f"{ROOT / 'configs'}:/opt/dgrpo/configs:ro", "dgrpo:cpu",
                "python3", "-c", code], timeout=300)
    n_configs = len(list((ROOT / "configs").glob("*.yaml")))
    assert proc.stdout.split() == ["checked", str(n_configs + 1)], proc.stdout + proc.stderr
