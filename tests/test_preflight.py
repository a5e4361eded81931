"""Preflight: each check fails in well under a second with the key named, on real files, folders and sockets; the
port picker never hands out a port twice; `dgrpo up` fails before any service starts and keeps the user's keys; a
resumed run's metrics.jsonl has one record per step."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dgrpo.cli.launch.preflight import assign_ports, given_keys
from dgrpo.cli.launch.up import resolve_stack, stable_free_port
from dgrpo.cli.stack import StackConfig
from dgrpo.common import preflight as pf
from dgrpo.common.config import ConfigError, load_config
from dgrpo.learner.main import preflight
from dgrpo.learner.records.metrics import MetricsLogger

ROWS = [{"prompt": f"What is {a}+1?", "answer": str(a + 1)} for a in range(4)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def stack_cfg(tmp_path: Path, *overrides: str) -> StackConfig:
    """A stack config whose outputs live under tmp_path and whose ports are free (port 0 is never probed)."""
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return load_config(StackConfig, None, [
        f"learner.data.train_files=[{train}]", f"learner.checkpoint.dir={tmp_path / 'ckpt'}",
        f"learner.trainer.log_dir={tmp_path / 'runs'}", "learner.trainer.control_port=0",
        f"weights.announce_port={stable_free_port()}", f"weights.control_port={stable_free_port()}",
        f"model.path={tmp_path / 'model'}", *overrides,
    ])


@pytest.fixture
def small_fs(child_processes, tmp_path):
    """A real 2 MB filesystem (tmpfs; needs root), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=False,
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fake_model(folder: Path, params: int) -> Path:
    """A model folder with a safetensors header of `params` fp32 parameters (the data itself is not needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [params], "data_offsets": [0, 4 * params]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (folder / "config.json").write_text("{}")
    return folder


# ---- data -------------------------------------------------------------------------------------------------------

def test_missing_train_file_names_the_key(tmp_path):
    cfg = stack_cfg(tmp_path, f"learner.data.train_files=[{tmp_path / 'nope.parquet'}]")
    with pytest.raises(ConfigError, match=r"learner.data.train_files\[0\]=.*nope.parquet.*no such file"):
        preflight(cfg.learner_run())


def test_missing_prompt_and_reward_columns_name_their_keys(tmp_path):
    from dgrpo.cli.launch.preflight import preflight_stack

    no_prompt = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "1"}])
    cfg = stack_cfg(tmp_path, f"learner.data.train_files=[{no_prompt}]")
    with pytest.raises(ConfigError, match=r"no column 'prompt' \(learner.data.prompt_key='prompt' names it\)"):
        preflight(cfg.learner_run())
    no_answer = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q"}])
    cfg = stack_cfg(tmp_path, f"learner.data.val_files=[{no_answer}]")
    ports = assign_ports(cfg, set(), 1)
    with pytest.raises(ConfigError, match=r"val_files\[0\]=.*no column 'answer' \(rewarder.spec.functions\[0\]"
                                          r".field='answer' names it\)"):
        preflight_stack(cfg, ports)


# ---- optional loggers -----------------------------------------------------------------------------------------

def test_default_loggers_need_nothing_beyond_the_default_install():
    """The shipped defaults and configs name only loggers the lean install (and every image) runs."""
    from dgrpo.learner.records.metrics import LOGGER_PACKAGES

    root = Path(__file__).parents[1]
    shipped = [StackConfig()] + [load_config(StackConfig, f, []) for f in sorted((root / "configs").glob("*.yaml"))]
    for cfg in shipped:
        assert not set(cfg.learner.trainer.loggers) & set(LOGGER_PACKAGES), cfg.learner.trainer.loggers


# The dev environment installs every logger (their tests need them): a missing one is a module name nothing provides.
ABSENT = "dgrpo_test_absent_module"


def test_a_logger_that_is_not_installed_is_refused_naming_key_and_package(tmp_path, monkeypatch):
    from dgrpo.learner.records import metrics
    from dgrpo.learner.records.metrics import check_loggers, missing_logger_packages

    assert importlib.util.find_spec(ABSENT) is None
    monkeypatch.setitem(metrics.LOGGER_PACKAGES, "wandb", (ABSENT, metrics.LOGGER_PACKAGES["wandb"][1]))
    cfg = stack_cfg(tmp_path, "learner.trainer.loggers=[console,jsonl,wandb]")
    with pytest.raises(ConfigError, match=r"learner.trainer.loggers=\['console', 'jsonl', 'wandb'\]: 'wandb' needs "
                                          r"the package dgrpo_test_absent_module \(pip install 'dgrpo\[wandb\]'\)"):
        preflight(cfg.learner_run())
    assert missing_logger_packages(["console", "jsonl", "tensorboard"]) == {}  # the dev extra has tensorboard
    check_loggers(["console", "jsonl", "tensorboard"])


def test_learner_with_a_missing_logger_exits_2_with_one_line_and_no_traceback(child_processes, tmp_path):
    """What a container in a restart loop would print: the key and the install line, not a traceback."""
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    argv = ["learner", f"learner.data.train_files=[{train}]", f"learner.checkpoint.dir={tmp_path / 'ckpt'}",
            f"learner.trainer.log_dir={tmp_path / 'runs'}", "learner.trainer.control_port=0",
            "learner.trainer.loggers=[console,wandb]"]
    absent = (f"import sys; from dgrpo.learner.records import metrics; metrics.LOGGER_PACKAGES['wandb'] = ({ABSENT!r}, "
              "metrics.LOGGER_PACKAGES['wandb'][1]); from dgrpo.cli.main import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", absent, *argv], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "learner.trainer.loggers" in proc.stderr and "pip install 'dgrpo[wandb]'" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# ---- folders and space ----------------------------------------------------------------------------------------

def test_checkpoint_dir_under_a_file_names_the_key(tmp_path):
    (tmp_path / "afile").write_text("x")
    cfg = stack_cfg(tmp_path, f"learner.checkpoint.dir={tmp_path / 'afile' / 'ckpt'}")
    with pytest.raises(ConfigError,
                       match=r"learner.checkpoint.dir=.*afile/ckpt.*cannot be a folder, .*afile is a file"):
        preflight(cfg.learner_run())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_log_dir_names_the_key(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    cfg = stack_cfg(tmp_path, f"learner.trainer.log_dir={ro}")
    with pytest.raises(ConfigError, match=r"learner.trainer.log_dir=.*ro/dgrpo.*not writable"):
        preflight(cfg.learner_run())


def test_full_disk_names_the_key_and_the_estimate(tmp_path, small_fs):
    fake_model(tmp_path / "model", 1_000_000)  # 1M parameters: 12 MB per checkpoint (fp32 weights + AdamW)
    cfg = stack_cfg(tmp_path, f"learner.checkpoint.dir={small_fs / 'ckpt'}")
    with pytest.raises(ConfigError, match=r"learner.checkpoint.dir=.*small/ckpt.*one checkpoint of 1M parameters "
                                          r"\(model\+optimizer\+extra\): needs ~12 MB, 2.1 MB free"):
        preflight(cfg.learner_run())
    cfg = stack_cfg(tmp_path, f"learner.checkpoint.dir={small_fs / 'ckpt'}", "learner.checkpoint.contents=[extra]")
    preflight(cfg.learner_run())  # a checkpoint without weights fits
    assert sorted(p.name for p in small_fs.iterdir()) == []  # the probe file is gone, nothing was created


def test_space_arithmetic_adds_up_folders_on_one_filesystem(tmp_path, monkeypatch):
    """Unit check of the sum (the real full disk is the tmpfs test above): two outputs that fit alone, not together."""
    free = 100 * 10**6
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    pf.check_space([("a.dir", tmp_path / "a", 60 * 10**6, "A"), ("b.dir", tmp_path / "b", 30 * 10**6, "B")])
    with pytest.raises(ConfigError, match=r"a.dir=.*~60 MB \(A\), b.dir=.*~50 MB \(B\): needs ~110 MB together"):
        pf.check_space([("a.dir", tmp_path / "a", 60 * 10**6, "A"), ("b.dir", tmp_path / "b", 50 * 10**6, "B")])


def test_parameter_count_reads_safetensors_headers(tiny_model):
    from safetensors import safe_open

    with safe_open(str(Path(tiny_model) / "model.safetensors"), "pt") as f:
        expected = sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118
    assert pf.parameter_count(tiny_model) == expected


def test_export_dir_of_foreign_files_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    cfg = stack_cfg(tmp_path, f"learner.checkpoint.export_dir={tmp_path / 'mine'}")
    with pytest.raises(ConfigError, match=r"learner.checkpoint.export_dir=.*mine.*not an earlier output"):
        preflight(cfg.learner_run())


# ---- ports --------------------------------------------------------------------------------------------------------

def test_port_clash_and_taken_port_name_the_keys(tmp_path):
    port = stable_free_port()
    cfg = stack_cfg(tmp_path, f"weights.announce_port={port}", f"weights.control_port={port}")
    with pytest.raises(ConfigError, match=f"weights.control_port={port} is also weights.announce_port"):
        preflight(cfg.learner_run())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cfg = stack_cfg(tmp_path, f"learner.trainer.control_port={taken}")
        with pytest.raises(ConfigError, match=f"learner.trainer.control_port={taken}: port {taken} is already in use"):
            preflight(cfg.learner_run())


def test_picker_never_returns_a_port_twice():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    batch = pf.pick_free_ports(40)
    singles = [stable_free_port() for _ in range(300)]
    ports = batch + singles
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)  # below the ephemeral range the engines' bind(0) draws from
    for p in batch[:5]:  # free when handed out
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


# ---- dgrpo up -------------------------------------------------------------------------------------------------------

def up_args(*overrides: str, config: Path | None = None, samplers: int = 1) -> argparse.Namespace:
    return argparse.Namespace(config=config, overrides=list(overrides), samplers=samplers, no_demo_data=False)


def test_up_fails_in_seconds_before_any_service_starts(launcher, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config = yaml.safe_load(Path(__file__).parents[1].joinpath("configs", "cpu-demo.yaml").read_text())
    config["learner"]["data"].update(train_files=[str(tmp_path / "missing.parquet")], val_files=[train])
    config["learner"]["trainer"]["log_dir"] = str(tmp_path / "runs")
    config["learner"]["checkpoint"].update(dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "export"))
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(config))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", "--config", str(tmp_path / "stack.yaml")],
                          check=False, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "learner.data.train_files[0]=" in proc.stderr and "missing.parquet" in proc.stderr
    assert elapsed < 10, elapsed
    assert "sampler-0" not in proc.stdout and "sampler(s)" not in proc.stdout  # nothing was started
    assert not (tmp_path / "runs" / "cpu_demo" / "logs").exists()


DEMO_FILE = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"
WROTE = ("dgrpo {}: wrote the missing data/arith-train.parquet, data/arith-val.parquet from the bundled tasks (what "
         "`python -m dgrpo.cli.tasks write data` writes)")

def clone_without_data(tmp_path: Path) -> Path:
    """A working folder as a fresh clone has it (no data/), where the demo config's export folder already holds a
    file of the user's: the preflight refuses it after the data check, so nothing starts."""
    clone = tmp_path / "clone"
    (clone / "runs" / "cpu_demo" / "model").mkdir(parents=True)
    (clone / "runs" / "cpu_demo" / "model" / "notes.txt").write_text("keep me")
    return clone


def assert_bundled_demo_files(folder: Path, reference: Path) -> None:
    """`folder` holds the demo task's files, byte for byte those `python -m dgrpo.cli.tasks write` writes."""
    from dgrpo.cli.tasks import write_task

    for made in write_task(reference):
        assert (folder / made.name).read_bytes() == made.read_bytes(), made.name


def test_up_on_a_clone_without_data_writes_the_bundled_task_its_config_names(launcher, tmp_path):
    """README's `dgrpo up --config configs/cpu-demo.yaml` before anything wrote data/: the files are written (one
    line says so) and the preflight goes on to its next check."""
    clone = clone_without_data(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", "--config", str(DEMO_FILE)], cwd=clone,
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "learner.checkpoint.export_dir='runs/cpu_demo/model'" in proc.stderr, proc.stderr  # the next check
    said = [line for line in proc.stdout.splitlines() if "data/arith-" in line]
    assert said == [WROTE.format("up")], proc.stdout
    assert_bundled_demo_files(clone / "data", tmp_path / "reference")
    assert "sampler(s)" not in proc.stdout  # nothing was started

    # --no-demo-data: nothing is written, the data check names the file.
    shutil.rmtree(clone / "data")
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", "--no-demo-data", "--config", str(DEMO_FILE)],
                          cwd=clone, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "learner.data.train_files[0]='data/arith-train.parquet': no such file" in proc.stderr, proc.stderr
    assert not (clone / "data").exists()


def test_learner_on_a_clone_without_data_writes_the_bundled_task_its_config_names(child_processes, tmp_path):
    """README's `dgrpo learner --config configs/cpu-demo.yaml` by hand, before anything wrote data/."""
    clone = clone_without_data(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(DEMO_FILE),
                           "learner.trainer.control_port=0"], cwd=clone, check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "learner.checkpoint.export_dir='runs/cpu_demo/model'" in proc.stderr, proc.stderr  # the next check
    said = [line for line in proc.stdout.splitlines() if "data/arith-" in line]
    assert said == [WROTE.format("learner")], proc.stdout
    assert_bundled_demo_files(clone / "data", tmp_path / "reference")


def test_up_keeps_the_users_train_files_and_ports(tmp_path):
    mine = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    port = stable_free_port()
    cfg, run_dir, sampler_ports, rewarder_port = resolve_stack(up_args(
        f"learner.data.train_files=[{mine}]", f"learner.trainer.log_dir={tmp_path / 'runs'}",
        f"learner.checkpoint.dir={tmp_path / 'ckpt'}", f"learner.checkpoint.export_dir={tmp_path / 'export'}",
        f"rewarder.port={port}"))
    assert cfg.learner.data.train_files == [mine]
    assert cfg.learner.data.val_files == []  # the demo's validation set is not mixed in
    assert rewarder_port == cfg.rewarder.port == port and cfg.learner.rollout.rewarder_address == f"127.0.0.1:{port}"
    assert cfg.sampler.addresses == [f"127.0.0.1:{sampler_ports[0]}"]
    picked = {*sampler_ports, rewarder_port, cfg.learner.trainer.control_port, cfg.weights.announce_port,
              cfg.weights.control_port}
    assert len(picked) == 5  # all distinct
    assert not (run_dir / "data").exists()  # no demo data written

    cfg, *_ = resolve_stack(up_args(f"learner.trainer.log_dir={tmp_path / 'runs'}",
                                    f"learner.checkpoint.dir={tmp_path / 'ckpt'}"))
    assert cfg.learner.data.train_files == [str(tmp_path / "runs" / "cpu_demo" / "data" / "arith-train.parquet")]


def test_up_refuses_what_it_cannot_honour(tmp_path):
    base = [f"learner.trainer.log_dir={tmp_path / 'runs'}", f"learner.checkpoint.dir={tmp_path / 'ckpt'}"]
    with pytest.raises(ConfigError, match=r"sampler.port=7000: dgrpo up starts 2 replicas"):
        resolve_stack(up_args(*base, "sampler.port=7000", samplers=2))
    with pytest.raises(ConfigError, match=r"sampler.addresses=.* lists 1 replica\(s\) but dgrpo up starts 2"):
        resolve_stack(up_args(*base, "sampler.addresses=[127.0.0.1:7001]", samplers=2))
    with pytest.raises(ConfigError, match=r"learner.rollout.rewarder_address='10.1.2.3:50052'.* must be local"):
        resolve_stack(up_args(*base, "learner.rollout.rewarder_address=10.1.2.3:50052"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"weights.announce_port={taken}: port {taken} is already in use"):
            resolve_stack(up_args(*base, f"weights.announce_port={taken}"))
    cfg = load_config(StackConfig, None, ["sampler.metrics_port=9100", "rewarder.port=7002"])
    ports = assign_ports(cfg, given_keys(["sampler.metrics_port=9100", "rewarder.port=7002"]), 2)
    assert ports.rewarder_port == 7002 and "rewarder.port=7002" not in ports.overrides
    from dgrpo.cli.launch.preflight import stack_bindings

    with pytest.raises(ConfigError, match="sampler.metrics_port=9100: each of the 2 replicas would bind it"):
        stack_bindings(cfg, ports)


# ---- metrics after resume -------------------------------------------------------------------------------------------

def read_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resumed_metrics_have_one_record_per_step(tmp_path):
    crashed = MetricsLogger(["jsonl"], tmp_path, "r", {})
    for step in range(1, 6):
        crashed.log(step, 5, {"reward/mean": float(step)}, "generate")
        if step == 2:
            crashed.log(step, 5, {"val/reward_mean": 0.5})  # validation at step 2
    crashed._jsonl.write('{"step": 6, "rew')  # killed mid-write
    crashed.close()

    resumed = MetricsLogger(["jsonl"], tmp_path, "r", {}, start_step=3)  # the checkpoint was at step 3
    assert read_steps(tmp_path / "metrics.jsonl") == [1, 2, 2, 3]
    for step in range(4, 7):
        resumed.log(step, 6, {"reward/mean": 10.0 + step}, "generate")
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["reward/mean"] for r in train][3:] == [14.0, 15.0, 16.0]  # the re-run's values, not the crashed ones

    MetricsLogger(["jsonl"], tmp_path, "r", {}, start_step=0).close()  # a fresh start: a fresh file
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert not list(tmp_path.glob("*.tmp"))


def test_resumed_tensorboard_shows_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    crashed = MetricsLogger(["tensorboard"], tmp_path, "r", {}, start_step=0)
    for step in range(1, 6):
        crashed.log(step, 5, {"reward/mean": float(step)})
    crashed.close()
    time.sleep(1.1)  # event files are named by the second they were opened
    resumed = MetricsLogger(["tensorboard"], tmp_path, "r", {}, start_step=3)
    for step in range(4, 7):
        resumed.log(step, 6, {"reward/mean": 10.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0),
                                                                       (5, 15.0), (6, 16.0)]
