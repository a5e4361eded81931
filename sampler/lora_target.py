"""The sampler's weight target for LoRA adapter versions (learner.lora on, merge_on_sync off).

The engine runs vLLM with LoRA enabled (`enable_lora`, `max_lora_rank` from the learner's rank); version 0 is the
base model (a fresh adapter's B is zero, so the policy equals it), every later version an adapter that replaces the
previous one in place under one LoRA id, which every request then names:

    stage   (generation running)  open the slot, verify the checksums, copy the adapter out: a PEFT folder
                                  (adapter_model.safetensors + adapter_config.json) in weights.shm_dir; then the
                                  seqlock check, so the files are exactly the announced version and no later write
                                  can tear them
    pause the scheduler (weights.pause_mode)
      apply                       AsyncLLM.add_lora(LoRARequest(..., load_inplace=True)): vLLM loads and checks the
                                  new adapter before it evicts the old one; reset_prefix_cache (KV blocks of the old
                                  adapter share its id and must not be reused)
      set_version                 requests fenced on the version go, with the adapter
    resume_generation

vLLM LoRA serving and `load_inplace`: https://docs.vllm.ai/en/latest/features/lora.html
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import weakref
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from dgrpo.sampler.engine import SamplerEngine
from dgrpo.sampler.weight_target import paused_generation
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.slot import WeightIntegrityError
from dgrpo.weights.target import SlotRef

LORA_NAME = "dgrpo-policy"
"""The adapter's name in vLLM (one adapter at a time: the policy's current version)."""
LORA_ID = 1
"""Its LoRA id: every version is loaded in place under it."""


def write_adapter_folder(ref: SlotRef, folder: Path) -> None:
    """Copy the adapter version `ref` out of its slot into a PEFT adapter folder, verified and untorn."""
    from safetensors.torch import save_file

    from dgrpo.weights.slot import open_slot

    if ref.streamed:
        raise WeightIntegrityError(f"version {ref.version}: adapter versions are never streamed (seq {ref.seq} odd)")
    reader, mapped = open_slot(ref)
    try:
        try:
            if ref.verify:
                reader.verify()
            tensors = {name: t.clone() for name, t in reader.tensors()}
            reader.check_intact()  # what was copied is what was announced
            config = reader.manifest.adapter_config
        finally:
            reader.release()
    finally:
        try:
            mapped.close()
        except BufferError:  # a view is still alive (e.g. in a traceback); the mapping goes when it does
            pass
    if not config:
        raise WeightIntegrityError(f"version {ref.version} holds full weights, not a LoRA adapter")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(json.loads(config), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


class LoraWeightTarget:
    """Loads adapter versions into one SamplerEngine started with LoRA enabled."""

    def __init__(self, engine: SamplerEngine, cfg: WeightSyncConfig):
        self.engine, self.pause_mode = engine, cfg.pause_mode
        # A tmpfs folder of our own: adapters are a few MB, and vLLM reads them from a path.
        self.root = Path(tempfile.mkdtemp(prefix="dgrpo-lora-", dir=cfg.shm_dir))
        weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._staged: tuple[int, Path] | None = None
        self._served: Path | None = None

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def start(self) -> None:
        """Nothing to hand the workers: vLLM's own LoRA manager loads each adapter."""

    async def stage(self, ref: SlotRef) -> None:
        folder = self.root / f"v{ref.version}-{ref.seq}"
        if self._staged is not None and self._staged[1] not in (folder, self._served):
            shutil.rmtree(self._staged[1], ignore_errors=True)  # staged, never applied (refused, or superseded)
        await asyncio.to_thread(write_adapter_folder, ref, folder)
        self._staged = (ref.version, folder)

    def paused(self) -> AbstractAsyncContextManager[float]:
        return paused_generation(self.engine.llm, self.pause_mode)

    async def apply(self, ref: SlotRef) -> None:
        from vllm.lora.request import LoRARequest

        if self._staged is None or self._staged[0] != ref.version:
            raise RuntimeError(f"apply of adapter version {ref.version}: the staged version is {self._staged}")
        folder = self._staged[1]
        try:
            await self.engine.llm.add_lora(LoRARequest(LORA_NAME, LORA_ID, str(folder), load_inplace=True))
        except Exception as e:  # noqa: BLE001 (vLLM checks an adapter before it evicts the old one, which serves on)
            raise WeightIntegrityError(f"adapter version {ref.version}: vLLM refused it: {e}") from None
        await self.engine.llm.reset_prefix_cache()
        # Requests name the adapter without load_inplace: with it, every scheduled step would reload the files.
        self.engine.lora_request = LoRARequest(LORA_NAME, LORA_ID, str(folder))
        if self._served is not None and self._served != folder:
            shutil.rmtree(self._served, ignore_errors=True)
        self._served, self._staged = folder, None

    def set_version(self, version: int) -> None:
        self.engine.set_weight_version(version)
