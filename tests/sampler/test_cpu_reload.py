"""Which models the direct reload takes (sampler/cpu_reload.py) and which it sends to vLLM's layerwise reload.

Loading itself runs in real vLLM workers: tests/weights/test_engine_sync.py (bit-for-bit against the layerwise
reload, and against transformers) and tests/weights/test_replicas.py (the method each sampler process took).
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

from dgrpo.sampler.cpu_reload import DirectReload


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.LayerNorm(4)
        self.proj.quant_method = UnquantizedLinearMethod()


def recorded(model: torch.nn.Module) -> torch.nn.Module:
    record_metadata_for_reloading(model)  # what vLLM's loader does at the first load
    return model


def test_plain_and_unquantized_layers_are_reloaded_directly():
    assert DirectReload.refusal(recorded(TwoLayers())) is None


def test_a_quantized_layer_sends_the_model_to_the_layerwise_reload():
    model = TwoLayers()
    model.proj.quant_method = object.__new__(Fp8LinearMethod)  # the class is what decides; no fp8 kernels needed
    assert DirectReload.refusal(recorded(model)) == "proj (Linear) is processed by Fp8LinearMethod"


def test_a_model_level_post_load_hook_is_not_skipped():
    model = TwoLayers()
    model.process_weights_after_loading = lambda: None
    assert "model-level post-load hook" in DirectReload.refusal(recorded(model))


def test_a_model_vllm_recorded_nothing_for_is_refused_and_building_one_says_why():
    model = TwoLayers()  # never loaded by vLLM: no checkpoint-format metadata to stage from
    reason = DirectReload.refusal(model)
    assert reason == "vLLM recorded no checkpoint-format metadata for this model"
    with pytest.raises(ValueError, match="recorded no checkpoint-format metadata"):
        DirectReload(model)
