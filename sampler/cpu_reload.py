"""In-place weight reload for vLLM-CPU models made of plain and unquantized layers, without the layerwise machinery.

vLLM's layerwise reload is general (any quantization, any processed layout) and pays for that on every version: it
re-materializes every layer's checkpoint-format tensors from meta (a fresh 270 MB of allocations for SmolLM2-135M),
wraps every parameter's loader, binds each call's arguments with `inspect`, and counts each loader's copies under a
dispatch mode to learn when a layer is complete. On vLLM-CPU that bookkeeping is over a third of a 135M reload
(docs/weight_sync.md, "Measured": 0.362 s against 0.224 s direct, in one process). Where every layer's post-load
processing is a pure function of its loaded tensors (unquantized linear and embedding layers: oneDNN packing on CPU;
norms: none) the bookkeeping buys nothing: `DirectReload` keeps the checkpoint-format tensors between versions, loads
into them with the model's own `load_weights` and weight loaders, re-runs each layer's processing once, and copies the
results into the tensors the engine runs with (their storage is kept, as the layerwise reload keeps it). The engine's
tensors change only after every tensor of the version was loaded, so a load that fails half-way leaves the previous
version serving.

Any other model (a quantized or MoE layer, attention with its own weights, a non-CPU platform) is not eligible:
`DirectReload.refusal(model)` names the reason and the caller uses vLLM's layerwise reload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# Post-load processing that depends only on the layer's own loaded tensors (vLLM 0.32, CPU: oneDNN / sgl packing).
PLAIN_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


class DirectReload:
    """Checkpoint-format staging tensors for every loadable layer of one model, reused for every version."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = self.refusal(model)
        if reason:
            raise ValueError(f"direct reload does not apply: {reason}")
        self.model = model
        # (layer, {name: checkpoint-format staging parameter}), in module order
        self._layers: list[tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]] = []
        self._loaded: set[int] = set()  # ids of the staging parameters a loader wrote in this version
        for layer in model.modules():
            staged = {name: self._staging(layer, meta) for name, meta in _restore_params(layer).items()}
            if staged:
                self._layers.append((layer, staged))

    @staticmethod
    def refusal(model: torch.nn.Module) -> str | None:
        """Why this model needs vLLM's layerwise reload, or None when every layer can be reloaded directly."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return f"the platform is {current_platform.device_type}, not cpu"
        if hasattr(model, "process_weights_after_loading"):
            return f"{type(model).__name__} has a model-level post-load hook"
        recorded = False
        for name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if method is not None and type(method).__name__ not in PLAIN_METHODS:
                return f"{name or 'the model'} ({type(layer).__name__}) is processed by {type(method).__name__}"
            restore = _restore_params(layer)
            if restore and is_deferred_attention_layer(layer):
                return f"{name} ({type(layer).__name__}) is an attention layer with weights of its own"
            recorded = recorded or bool(restore)
        return None if recorded else "vLLM recorded no checkpoint-format metadata for this model"

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], extra: Callable[[], None] = lambda: None) -> None:
        """Load one version: `named_tensors` through the model's `load_weights`, then `extra()` (what the model's
        loader skips, e.g. a tied output layer), then each layer's processing and the copy into the engine's tensors.
        A layer the version sends nothing for keeps what it runs with; a version is expected to send every tensor of
        the layers it sends (the learner publishes them all): a missing part keeps the last version's values."""
        kernels = [{name: layer._parameters[name] for name in staged} for layer, staged in self._layers]
        self._loaded.clear()
        try:
            for layer, staged in self._layers:
                layer._parameters.update(staged)
            self.model.load_weights(named_tensors)
            extra()
        except BaseException:
            for (layer, _), kernel in zip(self._layers, kernels, strict=True):
                layer._parameters.update(kernel)
            raise
        for (layer, staged), kernel in zip(self._layers, kernels, strict=True):
            if not any(id(param) in self._loaded for param in staged.values()):
                layer._parameters.update(kernel)  # nothing of this layer was sent: keep what it runs with
                continue
            _process(layer)
            self._keep_staging_intact(layer, staged)
            for name, old in kernel.items():
                new = layer._parameters[name]
                if old.shape == new.shape:
                    # In module order, as the layerwise reload does: a tensor two layers share (tied embeddings)
                    # ends with the later layer's values, as in transformers' load_state_dict.
                    old.data.copy_(new.data)
                    layer._parameters[name] = old
                # else: processing changed the parameter's shape; the layer keeps the new one

    def _keep_staging_intact(self, layer: torch.nn.Module, staged: dict[str, torch.nn.Parameter]) -> None:
        """Processing that re-points a loaded tensor at a packed layout (`weight.data = pack(weight)`) would leave the
        next version loading into the packed one: give that parameter a fresh staging tensor."""
        for name, meta in _restore_params(layer).items():
            if staged[name].shape != meta.shape or staged[name].dtype != meta.dtype:
                staged[name] = self._staging(layer, meta)

    def _staging(self, layer: torch.nn.Module, meta: torch.Tensor) -> torch.nn.Parameter:
        """A real tensor shaped and typed like the checkpoint's, with the parameter's attributes (its loader bound to
        `layer` again: vLLM keeps them unbound), whose loader records that it ran."""
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        tensor = torch.zeros(meta.shape, dtype=meta.dtype, device="cpu")
        tensor.__class__ = meta.__class__
        tensor.__dict__ = meta.__dict__.copy()
        restore_layer_refs(tensor, layer)
        tensor.requires_grad_(False)
        loader = _get_original_loader(tensor)  # without the wrappers an earlier layerwise reload left on the metadata
        tensor.weight_loader = self._recording(loader, id(tensor))
        return tensor

    def _recording(self, loader: Callable, key: int) -> Callable:
        loaded = self._loaded

        def load(*args, **kwargs):
            loaded.add(key)
            return loader(*args, **kwargs)

        return load


def _restore_params(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint-format (meta) parameters vLLM recorded for `layer` at its first load."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return dict(info.restore_metadata[0]) if info is not None else {}


def _process(layer: torch.nn.Module) -> None:
    """The layer's post-load processing, as vLLM's loader runs it (model_loader/utils.process_weights_after_loading)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(layer, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
