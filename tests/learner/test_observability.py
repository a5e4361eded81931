"""Everything a run shows, on a real stack: one sampler (vLLM on CPU, tiny model), a rewarder, weight sync, and the
learner as `dgrpo learner` in its own process.

With everything on: the rollout JSONL holds every trained completion with the rewarder's rewards and the versions
the metrics report; the console table appears; W&B (offline) and an MLflow file store hold the metrics and the
table; /metrics of all three services, scraped mid-run, parse with prometheus_client's parser and carry the named
series; the spans of a step, received by an OTLP endpoint the test runs, link learner, sampler and rewarder in one
trace. With nothing on: the learner opens no port but the weight channel's and writes no file but its metrics.
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from loop_support import fixed_port, read_jsonl, write_sums
from otlp_support import OtlpReceiver
from prometheus_client.parser import text_string_to_metric_families
from support import ServiceProcess, free_port

pytestmark = pytest.mark.slow
BATCH, N, STEPS = 2, 4, 3
REWARD_FNS = Path(__file__).parent / "reward_fns.py"
char_diversity = runpy.run_path(str(REWARD_FNS))["char_diversity"]  # the rewarder's function, to recompute rewards


@pytest.fixture(scope="module")
def stack(child_processes, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    announce, control = fixed_port(), fixed_port()
    weights = [f"weights.announce_port={announce}", f"weights.control_port={control}"]
    sampler_metrics, rewarder_metrics = free_port(), free_port()
    sampler_port, rewarder_port = free_port(), free_port()
    receiver = OtlpReceiver()  # the services export their spans here, every 0.2 s
    tracing = [f"tracing.otlp_endpoint={receiver.endpoint}"]
    quick_export = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
    sampler = ServiceProcess("sampler", [
        f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={sampler_port}", "sampler.enforce_eager=true",
        "sampler.max_model_len=512", "sampler.replica_id=r0", "sampler.shutdown_grace_s=1",
        f"sampler.metrics_port={sampler_metrics}", *weights, *tracing], sampler_port, quick_export)
    rewarder = ServiceProcess("rewarder", [
        f"rewarder.port={rewarder_port}", "rewarder.workers=1", f"rewarder.metrics_port={rewarder_metrics}",
        f"rewarder.spec={{name: obs, functions: [{{type: file, path: {REWARD_FNS}, function: char_diversity}}]}}",
        *tracing], rewarder_port, quick_export)
    try:
        for svc in (rewarder, sampler):
            svc.wait_ready(timeout=400)
        config = {
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "sampler": {"addresses": [sampler.address], "max_model_len": 512},
            "weights": {"announce_port": announce, "control_port": control},
            "learner": {
                "data": {**write_sums(root, 4), "train_batch_size": BATCH, "max_prompt_length": 64},
                "rollout": {"n": N, "max_response_length": 16, "seed": 3, "rewarder_address": rewarder.address},
                "actor": {"ppo_mini_batch_size": BATCH, "micro_batch_size_per_device": 8, "dtype": "float32",
                          "compute_entropy": False},
                "optim": {"lr": 1e-3},
                "checkpoint": {"save_freq": 0, "keep_last": None},
                "trainer": {"total_training_steps": STEPS, "test_freq": STEPS, "control_port": None},
            },
        }
        (root / "stack.yaml").write_text(yaml.safe_dump(config))
        yield {"root": root, "config": root / "stack.yaml", "ports": {"sampler": sampler_metrics,
               "rewarder": rewarder_metrics}, "weight_ports": {announce, control}, "receiver": receiver,
               "sampler_address": sampler.address}
    finally:
        receiver.stop()
        for svc in (rewarder, sampler):
            if svc.proc.poll() is None:
                svc.proc.terminate()
        for svc in (rewarder, sampler):
            svc.stop(timeout=30)


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Series name -> {labels: value}, parsed by prometheus_client's own text parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """The history rows of an offline W&B run, read from its transaction log (`run-*.wandb`: a 7-byte header, then
    32 KiB blocks of records, each with a 7-byte header of crc32, length and type: the LevelDB log format)."""
    from wandb.proto import wandb_internal_pb2

    raw = Path(glob.glob(str(run_dir / "run-*.wandb"))[0]).read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunks, rows = 32768, 7, [], []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        chunks.append(raw[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def run_learner(stack, overrides: list[str], cwd: Path, watch, env: dict | None = None) -> str:
    """`dgrpo learner` on the stack's config in its own process, `watch(proc)` on a thread while it runs (it returns
    when the process ends); asserts exit 0 and returns stderr."""
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]), *overrides]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=watch, args=(proc,), daemon=True)
    watcher.start()
    try:
        _, stderr = proc.communicate(timeout=500)
    finally:
        proc.kill()
    watcher.join(timeout=10)
    assert proc.returncode == 0, stderr[-6000:]
    return stderr


def test_everything_on(stack, monkeypatch):
    root, ports = stack["root"], dict(stack["ports"])
    ports["learner"] = fixed_port()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    overrides = [
        f"learner.checkpoint.dir={root / 'ckpt'}", "learner.trainer.run_name=allon", f"learner.trainer.log_dir={root}",
        "learner.trainer.loggers=[console,jsonl,wandb,mlflow]", f"learner.trainer.rollout_data_dir={root / 'roll'}",
        f"learner.trainer.validation_data_dir={root / 'val'}", "learner.trainer.log_completions=true",
        "learner.trainer.num_completions_to_print=3", "learner.trainer.log_val_generations=1",
        f"learner.trainer.metrics_port={ports['learner']}",
        f"tracing.otlp_endpoint={stack['receiver'].endpoint}"]
    scrapes: dict[str, dict] = {}

    def scrape_mid_run(proc: subprocess.Popen) -> None:  # every service, once the learner has finished a step
        deadline = time.monotonic() + 500
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                learner = scrape(ports["learner"])
                if learner["dgrpo_learner_step"][()] >= 1:
                    scrapes.update(learner=learner, sampler=scrape(ports["sampler"]),
                                   rewarder=scrape(ports["rewarder"]))
                    return
            except (OSError, KeyError):
                pass  # not serving yet, or no step yet
            time.sleep(0.5)

    stderr = run_learner(stack, overrides, root, scrape_mid_run, env)

    # Rollout JSONL: every trained completion, the rewarder's reward, the versions the metrics report.
    steps = [r for r in read_jsonl(root / "allon" / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sorted(p.name for p in (root / "roll").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    for m in steps:
        records = read_jsonl(root / "roll" / f"{m['step']}.jsonl")
        assert len(records) == BATCH * N and {r["step"] for r in records} == {m["step"]}
        assert len({r["prompt_id"] for r in records}) == BATCH
        for r in records:  # recomputed from the dumped text with the rewarder's own function
            assert r["reward"] == pytest.approx(char_diversity([r["prompt"]], [r["completion"]], None)[0])
            assert r["breakdown"] == {"char_diversity": pytest.approx(r["reward"])}
            assert r["status"] == "ok" and r["replica"] == "r0" and r["spec"].startswith("obs@1#")
            assert r["weight_version"] == r["first_weight_version"] == m["weights/version"] - 1  # lockstep
            assert r["staleness"] == 0 and 1 <= r["length"] <= 16 and r["finish_reason"] in ("stop", "length")
        assert sum(r["reward"] for r in records) / len(records) == pytest.approx(m["reward/mean"], abs=1e-6)
        assert sum(r["length"] for r in records) / len(records) == pytest.approx(m["response/length_mean"])
        assert sum(r["finish_reason"] == "length" for r in records) / len(records) == pytest.approx(
            m["response/clip_frac"])
        for i in range(0, len(records), N):  # group-normalized: a group's advantages sum to 0
            assert sum(r["advantage"] for r in records[i:i + N]) == pytest.approx(0, abs=1e-4)
    val = read_jsonl(root / "val" / f"{STEPS}.jsonl")
    assert len(val) == 2 and {r["advantage"] for r in val} == {None} and {r["weight_version"] for r in val} == {STEPS}

    # The console table, every step, with the asked-for rows.
    assert all(f"completions, step {s}" in stderr for s in (1, 2, 3))

    # W&B (offline) and MLflow (file store): metrics of every step and the table.
    history = wandb_history(Path(glob.glob(str(root / "wandb" / "offline-run-*"))[0]))
    wb = {int(row["_step"]): row for row in history if "reward/mean" in row}
    assert sorted(wb) == [1, 2, 3] and all(float(wb[m["step"]]["reward/mean"]) == pytest.approx(m["reward/mean"])
                                           for m in steps)
    assert all(json.loads(row["completions/nrows"]) == BATCH * N for row in history if "completions/nrows" in row)
    assert sum("completions/nrows" in row for row in history) == STEPS
    (val_table,) = [row for row in history if "val/generations/nrows" in row]
    assert json.loads(val_table["val/generations/nrows"]) == 1 and int(val_table["_step"]) == STEPS
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(f"file:{root / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dgrpo").experiment_id])
    assert run.info.run_name == "allon"
    assert [(h.step, h.value) for h in client.get_metric_history(run.info.run_id, "reward/mean")] == [
        (m["step"], pytest.approx(m["reward/mean"])) for m in steps]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    table = json.loads((artifacts / "completions" / "step_2.json").read_text())
    assert len(table["data"]) == BATCH * N and "completion" in table["columns"]
    val_table = json.loads((Path(run.info.artifact_uri.removeprefix("file://")) / "val" / "generations" /
                            f"step_{STEPS}.json").read_text())
    assert len(val_table["data"]) == 1 and val_table["data"][0][val_table["columns"].index("advantage")] is None

    # Prometheus, scraped while the run was under way.
    assert set(scrapes) == {"learner", "sampler", "rewarder"}, "no scrape between the first and last step"
    lrn, smp, rwd = scrapes["learner"], scrapes["sampler"], scrapes["rewarder"]
    assert 1 <= lrn["dgrpo_learner_step"][()] <= STEPS and lrn["dgrpo_learner_total_steps"][()] == STEPS
    assert lrn["dgrpo_learner_weight_version"][()] >= 1
    assert 0 < lrn["dgrpo_learner_sample_wait_ratio"][()] < 1
    assert 0 <= lrn["dgrpo_learner_reward_mean"][()] <= 1
    assert lrn["dgrpo_learner_staleness_mean_versions"][()] == 0
    assert lrn["dgrpo_learner_weight_publish_seconds_count"][()] >= 1
    assert lrn["dgrpo_learner_phase_seconds_total"][(("phase", "train"),)] > 0
    replica = (("replica", "r0"),)
    assert smp["dgrpo_sampler_generated_tokens_total"][replica] >= BATCH * N
    assert smp["dgrpo_sampler_groups_total"][replica] >= BATCH
    assert smp["dgrpo_sampler_weight_version"][replica] >= 0
    for name in ("dgrpo_sampler_requests_in_flight", "dgrpo_sampler_groups_in_flight",
                 "dgrpo_sampler_generated_tokens_per_second", "dgrpo_sampler_waiting_requests",
                 "dgrpo_sampler_weight_load_seconds"):
        assert smp[name][replica] >= 0, name
    assert any(name.startswith("vllm:") for name in smp), "vLLM's own engine metrics are missing"
    assert rwd["dgrpo_rewarder_completions_total"][(("status", "ok"),)] >= BATCH * N
    assert rwd["dgrpo_rewarder_function_seconds_count"][(("function", "char_diversity"),)] >= BATCH
    assert rwd["dgrpo_rewarder_spec_version"][()] == 1
    assert rwd["dgrpo_rewarder_completions_per_second"][()] > 0

    check_step_trace(stack)


def step_trace(receiver: OtlpReceiver, step: int, timeout_s: float = 30.0) -> dict[str, list]:
    """The spans of step `step`'s trace by name, once the samplers' and the rewarder's exports have arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.spans()
        roots = [s for s in spans if s.name == "step" and s.attributes.get("step") == step]
        trace = [s for s in spans if roots and s.trace_id == roots[0].trace_id]
        by_name: dict[str, list] = {}
        for s in trace:
            by_name.setdefault(f"{s.service}/{s.name}", []).append(s)
        complete = {"dgrpo-sampler/Generate", "dgrpo-rewarder/Score", "dgrpo-sampler/load_weights"} <= set(by_name)
        if complete or time.monotonic() > deadline:
            return by_name
        time.sleep(0.5)


def check_step_trace(stack) -> None:
    """Step 2's trace: the learner's step, Generate, Score and publish spans; the sampler's Generate and its load of
    the published version; the rewarder's Score, each a child of the learner's span that caused it."""
    spans = step_trace(stack["receiver"], 2)
    (step,) = spans["dgrpo-learner/step"]
    assert step.parent_id == "" and step.attributes["weight_version"] == 1
    (publish,) = spans["dgrpo-learner/publish"]
    assert publish.parent_id == step.span_id and publish.attributes["weight_version"] == 2
    calls = spans["dgrpo-learner/Generate"]
    # One assertion per property, each naming the calls it saw: a CI log folds long messages.
    seen = [(c.parent_id, dict(c.attributes)) for c in calls]
    assert calls, "no Generate call in step 2's trace"
    assert {c.parent_id for c in calls} == {step.span_id}, f"a Generate call outside step {step.span_id}: {seen}"
    assert {c.attributes["replica"] for c in calls} == {stack["sampler_address"]}, seen
    assert {c.attributes["min_weight_version"] for c in calls} == {1}, seen
    assert sum(c.attributes["groups"] for c in calls) == BATCH
    served = spans["dgrpo-sampler/Generate"]
    assert {s.parent_id for s in served} == {c.span_id for c in calls}
    # The learner cancels a call once its last group arrived: the server may record that as cancelled.
    assert all(s.instance == "r0" and s.attributes["outcome"] in ("ok", "cancelled") for s in served), \
        [dict(s.attributes) for s in served]
    scores = spans["dgrpo-learner/Score"]
    assert len(scores) == BATCH and {s.parent_id for s in scores} == {step.span_id}
    assert sorted(s.parent_id for s in spans["dgrpo-rewarder/Score"]) == sorted(s.span_id for s in scores)
    (load,) = spans["dgrpo-sampler/load_weights"]
    assert load.parent_id == publish.span_id and load.attributes["weight_version"] == 2 and load.instance == "r0"


def test_nothing_on_opens_no_port_and_writes_no_file(stack, tmp_path):
    """Defaults: the learner listens only on the weight channel's two ports (control service off here) and writes
    only metrics.jsonl and config.yaml."""
    overrides = [f"learner.checkpoint.dir={tmp_path / 'ckpt'}", "learner.trainer.run_name=quiet",
                 f"learner.trainer.log_dir={tmp_path / 'runs'}", "learner.trainer.total_training_steps=1",
                 "learner.trainer.test_freq=0"]
    listening: set[int] = set()

    def watch(proc: subprocess.Popen) -> None:
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                listening.update(c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN)
            except psutil.Error:
                return
            time.sleep(0.2)

    stderr = run_learner(stack, overrides, tmp_path, watch)
    assert listening == stack["weight_ports"]
    files = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and "ckpt" not in p.parts}
    assert files == {"runs/quiet/metrics.jsonl", "runs/quiet/config.yaml"}
    assert "completions, step" not in stderr and "Prometheus" not in stderr


def test_a_default_rewarder_listens_on_its_grpc_port_only(child_processes, tmp_path):
    """The rewarder with defaults (no metrics_port, no tracing): one listening socket, its gRPC port."""
    port = free_port()
    rewarder = ServiceProcess("rewarder", [f"rewarder.port={port}", "rewarder.workers=1"], port)
    try:
        rewarder.wait_ready(timeout=120)
        ports = {c.laddr.port for c in psutil.Process(rewarder.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    finally:
        rewarder.stop(timeout=30)
    assert ports == {port}
    assert "Prometheus" not in rewarder.logs() and "tracing" not in rewarder.logs()
