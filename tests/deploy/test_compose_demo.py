"""`docker compose up` exactly as the README and docs/deploy.md say, on the shipped configs/cpu-demo.yaml: only the
step count (DGRPO_LEARNER_OVERRIDES) and the output folder (DGRPO_RUNS_DIR) are changed, through the documented
variables, plus the host port of the control service. The learner is killed with SIGKILL (`docker kill`) while it
samples, started again as docs/deploy.md says (`docker compose up -d learner`), resumes from its checkpoint on the
runs volume and publishes to the sampler that stayed up, which serves every version after the restart; then the
run finishes, exports, exits 0 and stays down.

Also: the image imports every optional module the shipped configurations and the defaults use, so a default that
names a package the image lacks fails here instead of in a crash-looping container.
"""

from __future__ import annotations

import time

import grpc
import pytest
import yaml
from compose_support import ROOT, Stack, inspect, replicas, run

STEPS = 8
SAVE_FREQ = 5  # configs/cpu-demo.yaml's learner.checkpoint.save_freq: the kill comes after its first checkpoint


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_shipped_demo_survives_a_killed_learner(docker_ready, tmp_path):
    demo = yaml.safe_load((ROOT / "configs" / "cpu-demo.yaml").read_text())["learner"]
    assert demo["checkpoint"]["save_freq"] == SAVE_FREQ < STEPS, "the shipped demo's checkpoint frequency changed"
    runs = tmp_path / "runs"
    runs.mkdir()
    stack = Stack({"DGRPO_RUNS_DIR": str(runs),
                   "DGRPO_LEARNER_OVERRIDES": f"learner.trainer.total_training_steps={STEPS}"},
                  runs / demo["trainer"]["run_name"] / "metrics.jsonl")
    stack.run_phases("test_compose_demo", lambda timings: _run_and_kill_the_learner(stack, runs, timings))


def _run_and_kill_the_learner(stack: Stack, runs, timings: dict[str, float]) -> None:
    t = time.monotonic()
    stack("up", "-d", timeout=900)  # the README's command, detached
    cids = {s: stack.containers(s) for s in ("shm", "rewarder", "learner", "sampler")}
    assert all(len(c) == 1 for c in cids.values()), cids
    stack.wait_healthy([c for ids in cids.values() for c in ids])
    stack.note_namespaces()
    learner, sampler = cids["learner"][0], cids["sampler"][0]
    sampler_started = inspect(sampler, "{{.State.StartedAt}}")
    timings["healthy"] = time.monotonic() - t

    # No DGRPO_TOKEN was given, and still no call goes through without the token the stack made for itself.
    with pytest.raises(grpc.RpcError) as refused:
        stack.learner_rpc("Status", authenticated=False)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(stack.token) >= 32

    # The learner samples the step after its first checkpoint: SIGKILL, no chance to save or say goodbye.
    status = stack.wait_phase("sampling", after_step=SAVE_FREQ, timeout=900)
    assert (runs / "checkpoints" / f"step_{SAVE_FREQ}" / "meta.json").is_file()
    killed_at, version_before = status.step, status.weight_version
    timings["trained_to_kill"] = time.monotonic() - t
    run(["docker", "kill", learner])
    assert stack.wait_exit(learner, timeout=60) == 137
    time.sleep(3)  # Docker leaves a killed container down (docs/deploy.md): nothing restarts it on its own
    assert stack.health(learner).startswith("exited"), stack.health(learner)
    for cid in (*cids["shm"], *cids["rewarder"], sampler):
        assert stack.health(cid).startswith("running"), f"{cid[:12]} went down with the learner"
    served_before = stack.sampler_info(sampler)
    assert served_before["weight_version"] == version_before  # the replica keeps serving its weights

    t = time.monotonic()
    stack("up", "-d", "learner", timeout=600)  # docs/deploy.md, "When the learner fails"
    assert stack.wait_exit(stack.containers("learner", all_states=True)[0], timeout=1500) == 0
    timings["restart_to_finished"] = time.monotonic() - t

    learner_logs = run(["docker", "logs", stack.containers("learner", all_states=True)[0]]).stderr
    assert f"resumed from /opt/dgrpo/runs/checkpoints/step_{SAVE_FREQ} at step {SAVE_FREQ}" in learner_logs
    steps = [r for r in stack.steps() if "actor/loss" in r]  # (validation records: steps 0 and 8)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), "steps lost or trained twice"
    again = [r for r in steps if r["step"] > SAVE_FREQ]
    assert all(r["weights/version"] > version_before for r in again), [r["weights/version"] for r in again]
    # The same replica (container, process, replica id) served every version of the restarted learner.
    assert stack.containers("sampler") == [sampler] and inspect(sampler, "{{.State.StartedAt}}") == sampler_started
    assert inspect(sampler, "{{.RestartCount}}") == "0"
    assert all(replicas(r) == {served_before["replica_id"]: 8.0} for r in again), [replicas(r) for r in again]
    assert stack.sampler_info(sampler)["weight_version"] == steps[-1]["weights/version"]
    sampler_logs = run(["docker", "logs", sampler]).stderr
    assert "weights from a restarted learner of run 'cpu_demo'" in sampler_logs
    assert (runs / "cpu_demo" / "model" / "config.json").is_file(), "the finished run exported no model"
    print(f"\n[test_compose_demo] killed during step {killed_at + 1} (version {version_before}); resumed at step "
          f"{SAVE_FREQ}, versions after the restart {[int(r['weights/version']) for r in again]}")


@pytest.mark.slow
def test_the_image_imports_every_optional_module_the_shipped_configs_use(docker_ready):
    """Inside dgrpo:cpu: every shipped config and the defaults, their loggers checked as the learner checks them at
    start and their modules imported for real."""
    code = """
import importlib, pathlib
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config
from dgrpo.learner.metrics import LOGGER_PACKAGES, check_loggers
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
