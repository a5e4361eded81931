"""Device selection and per-device environment. NPU/CUDA are faked (this machine has neither)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from pydantic import ValidationError

from dgrpo.common import devices
from dgrpo.sampler.config import SamplerConfig


def test_cpu_machine_detects_cpu_and_gloo():
    assert devices.detect_device() == "cpu"
    assert devices.dist_backend("cpu") == "gloo"
    assert devices.torch_device("cpu") == torch.device("cpu")


def test_npu_branch_with_faked_torch_npu(monkeypatch):
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8),
                        raising=False)
    assert devices.detect_device() == "npu"
    assert devices.dist_backend("npu") == "hccl"


def test_npu_present_but_no_device_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0),
                        raising=False)
    assert devices.detect_device() == "cpu"
    with pytest.raises(RuntimeError, match="npu"):
        devices.detect_device("npu")


def test_cuda_branch_faked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.detect_device() == "cuda"
    assert devices.dist_backend("cuda") == "nccl"
    assert devices.torch_device("cuda", 1) == torch.device("cuda", 1)


def test_explicit_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        devices.detect_device("cuda")
    with pytest.raises(ValueError, match="tpu"):
        devices.detect_device("tpu")


def test_ascend_sampler_environment():
    env = devices.sampler_env("npu", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True,foo:1"})
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "foo:1"  # vllm-ascend's sleep-mode allocator refuses it
    assert devices.sampler_env("npu", {"VLLM_ASCEND_ENABLE_NZ": "1"})["VLLM_ASCEND_ENABLE_NZ"] == "1"
    assert devices.learner_env("npu", {}) == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    assert devices.learner_env("cuda", {}) == {}


def test_visible_devices_are_honoured():
    assert devices.visible_devices("npu", {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6"}) == [4, 5, 6]
    assert devices.visible_devices("cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == [1]
    assert devices.visible_devices("npu", {}) is None
    assert devices.visible_devices("cpu", {"CUDA_VISIBLE_DEVICES": "1"}) is None


def test_sampler_cpu_core_binding():
    assert devices.cpu_thread_binding("auto") == {}  # vLLM's own choice
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert devices.cpu_thread_binding("all") == {"VLLM_CPU_OMP_THREADS_BIND": every,
                                                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert devices.cpu_thread_binding("0-3")["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    with pytest.raises(ValidationError, match="cpu_cores"):
        SamplerConfig(cpu_cores="most")


def test_replicas_on_one_cpu_host_get_cores_of_their_own():
    assert devices.replica_cpu_cores(0, 1, [0, 1]) is None  # one replica: vLLM's own binding
    assert [devices.replica_cpu_cores(i, 2, [0, 1]) for i in range(2)] == ["0", "1"]
    assert [devices.replica_cpu_cores(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == ["0,1", "2,3"]
    assert [devices.replica_cpu_cores(i, 3, [4, 5]) for i in range(3)] == ["4", "5", "4"]  # more replicas than cores
    for i in range(2):  # every binding is one `dgrpo sampler` accepts
        SamplerConfig(cpu_cores=devices.replica_cpu_cores(i, 2))


def test_cpu_samplers_do_not_split_prefills_unless_asked():
    # Unset on CPU: off, with a budget that holds a whole max_model_len; seeds are safe.
    assert devices.sampler_prefill("cpu", None, None, 1024) == (False, 4096, True)
    assert devices.sampler_prefill("cpu", None, None, 32768) == (False, 32768, True)
    assert devices.sampler_prefill("cpu", None, 8192, 2048) == (False, 8192, True)
    # A budget below max_model_len needs splitting, as does an explicit true: seeded requests are then refused.
    assert devices.sampler_prefill("cpu", None, 1024, 2048) == (None, 1024, False)
    assert devices.sampler_prefill("cpu", True, None, 1024) == (True, None, False)
    assert devices.sampler_prefill("cpu", False, None, 1024) == (False, 4096, True)
    # Other devices: vLLM's own choice, untouched.
    assert devices.sampler_prefill("npu", None, None, 4096) == (None, None, True)
    assert devices.sampler_prefill("cuda", True, 2048, 4096) == (True, 2048, True)


def test_a_cpu_learner_runs_on_tcmalloc_where_the_system_has_it(monkeypatch, tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(devices, "TCMALLOC_GLOBS", (str(tmp_path / "libtcmalloc_minimal.so.4"),))
    env = devices.host_allocator_env("cpu", {})
    assert env["LD_PRELOAD"] == str(lib) and int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 30
    # Another preload stays, after tcmalloc; the user's report threshold stands.
    env = devices.host_allocator_env("cpu", {"LD_PRELOAD": "/x/libgomp.so.1",
                                             "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"})
    assert env == {"LD_PRELOAD": f"{lib}:/x/libgomp.so.1", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}
    # Left alone: an allocator already preloaded, glibc asked for, an accelerator's learner, no tcmalloc installed.
    assert devices.host_allocator_env("cpu", {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == {}
    assert devices.host_allocator_env("cpu", {"DGRPO_CPU_ALLOCATOR": "system"}) == {}
    assert devices.host_allocator_env("cuda", {}) == {} and devices.host_allocator_env("npu", {}) == {}
    monkeypatch.setattr(devices, "TCMALLOC_GLOBS", (str(tmp_path / "none.so"),))
    assert devices.host_allocator_env("cpu", {}) == {}


def test_cpu_flags_come_from_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert devices.cpu_flags(str(info)) == {"fpu", "avx2", "avx512f", "amx_bf16"}
    assert devices.cpu_flags(str(tmp_path / "missing")) == set()
    assert devices.computes_bf16("cpu", {"avx512_bf16"}) and not devices.computes_bf16("cpu", {"avx512f", "avx2"})
