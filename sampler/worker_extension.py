"""vLLM worker extension: the only dgrpo code that runs inside vLLM's worker processes.

Loaded by name through `worker_extension_cls`; reached only via `collective_rpc("dgrpo_...")` with
msgpack-able arguments (names, paths, versions), never callables.

Loading a weight version (see dgrpo.weights.slot for the slot layout) takes two calls, so that with tensor
parallelism either every worker loads a version or none does:
1. `dgrpo_stage_weights`: copy the slot into a private buffer under its sequence lock and verify the checksums
   on that copy. A torn or corrupt version is rejected here, before the model is touched, so the replica keeps
   serving the old weights. Generation keeps running during this step.
2. `dgrpo_apply_weights` (generation paused): load through vLLM's layerwise reload (`initialize_layerwise_reload`
   -> `model.load_weights` -> `finalize_layerwise_reload`). A raw `load_weights` on a running engine is wrong:
   vLLM-CPU repacks linear weights after the first load (the parameter becomes size 0) and MoE kernels on GPU
   keep processed layouts; the layerwise reload restores the checkpoint-format parameters, loads, and re-runs
   the post-load processing. We call it directly rather than the worker's `reload_weights`, which vllm-ascend's
   NPU worker lacks.
"""

from __future__ import annotations

import time


class DgrpoWorkerExtension:
    """Mixed into vLLM's worker class; methods carry the `dgrpo_` prefix to avoid clashes."""

    def dgrpo_ping(self) -> str:
        return "ok"

    def dgrpo_stage_weights(self, path: str, version: int, seq: int, manifest_xxh3: int, verify: bool = True) -> dict:
        """Copy weight `version` from the slot at `path` into private memory and verify it; the model is untouched.

        Returns {"ok": bool, "error"?: str, timings}. Integrity failures are returned, not raised: the engine stays
        healthy on the previous weights and the caller (dgrpo.sampler.weight_loader) logs and reports them.
        """
        from dgrpo.weights import slot
        from dgrpo.weights.shm import open_readonly

        self._dgrpo_staged = None
        t0 = time.perf_counter()
        try:
            mapped = open_readonly(path)
        except FileNotFoundError:
            return {"ok": False, "error": f"version {version}: slot {path} no longer exists (learner gone?)"}
        try:
            # The private copy is kept between loads: allocating (page-faulting) 270 MB costs more than the copy.
            manifest, self._dgrpo_buffer = slot.snapshot(
                mapped, version, seq, manifest_xxh3, getattr(self, "_dgrpo_buffer", None)
            )
            t1 = time.perf_counter()
            if verify:
                slot.verify(manifest, self._dgrpo_buffer)
        except slot.WeightIntegrityError as e:
            return {"ok": False, "error": str(e)}
        finally:
            mapped.close()
        self._dgrpo_staged = (version, manifest)
        return {"ok": True, "copy_s": t1 - t0, "verify_s": time.perf_counter() - t1}

    def dgrpo_apply_weights(self, version: int) -> dict:
        """Load the staged `version` into the model (call with generation paused)."""
        import torch

        from dgrpo.weights import slot

        staged = getattr(self, "_dgrpo_staged", None)
        if staged is None or staged[0] != version:
            raise RuntimeError(f"dgrpo_apply_weights({version}): staged is {staged[0] if staged else None}")
        t0 = time.perf_counter()
        with torch.no_grad():
            self._dgrpo_reload(slot.tensors(staged[1], self._dgrpo_buffer))
        self._dgrpo_staged = None
        return {"ok": True, "load_s": time.perf_counter() - t0}

    def _dgrpo_reload(self, named_tensors) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        model = self.model_runner.get_model()
        aliases = self._dgrpo_tied_aliases(model)
        named = list(named_tensors)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(named)
            # A tied output layer gets no weight of its own (checkpoints and the learner carry the embedding once,
            # and load_weights skips lm_head.* for tied models), so the layerwise reload would put its old tensors
            # back and the sampler would keep the first version's output layer. Load it from its source.
            sent = dict(named)
            for alias, source in aliases.items():
                tensor = sent.get(alias, sent.get(source))  # its own tensor when the publisher sent one
                if tensor is not None:
                    param = model.get_parameter(alias)
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            finalize_layerwise_reload(model, self.vllm_config.model_config)

    def _dgrpo_tied_aliases(self, model) -> dict[str, str]:
        """{alias parameter: the parameter it is tied to}, as the model was built (found once, before the first
        reload unties them): e.g. {"lm_head.weight": "model.embed_tokens.weight"}."""
        if not hasattr(self, "_dgrpo_aliases"):
            first: dict[int, str] = {}
            aliases: dict[str, str] = {}
            for name, param in model.named_parameters(remove_duplicate=False):
                if id(param) in first:
                    aliases[name] = first[id(param)]
                else:
                    first[id(param)] = name
            names = {name for name, _ in model.named_parameters()}
            hf_config = self.vllm_config.model_config.hf_config
            if not aliases and getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in names:
                embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
                if embed is not None:
                    aliases["lm_head.weight"] = embed
            self._dgrpo_aliases = aliases
        return self._dgrpo_aliases
