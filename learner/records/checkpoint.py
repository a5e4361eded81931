"""Checkpoints that resume a run exactly, and the export to a Hugging Face folder for deployment.

A checkpoint is a folder `<checkpoint.dir>/step_<N>/`:
  model.pt        full (unsharded) fp32 policy state dict, Hugging Face names          (contents: model)
                  (LoRA: the adapter's parameters only; the frozen base is the model folder's)
  optimizer.pt    AdamW state keyed by parameter name                                 (contents: optimizer)
  scheduler.pt    the lr scheduler's position                                          (contents: optimizer)
  extra.pt        the loop's `extra` dict (data position, ...), the actor's step        (contents: extra)
  rng_<rank>.pt   python / numpy / torch (and device) RNG states of each rank          (contents: extra)
  meta.json       step, contents, world size; written last, so a folder without it is incomplete
Full state dicts keyed by names (torch.distributed.checkpoint.state_dict) make a checkpoint independent of
the number of ranks it was written with. It is written to step_<N>.tmp and renamed when complete, so a crash or a
full disk mid-write leaves the previous checkpoints intact (the partial folder is removed, and the error names
learner.checkpoint.dir with the space needed); the export is swapped in the same way. With several hosts,
checkpoint.dir must be on a shared filesystem.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dgrpo.common.preflight import check_replaceable, checkpoint_bytes, disk_full, export_bytes, fmt_bytes
from dgrpo.learner.records.checkpoint_dirs import list_checkpoints
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.config import CheckpointConfig


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, lacking what was asked)."""


def _barrier(actor: Actor) -> None:
    if actor.ctx.distributed:
        dist.barrier()


def _save_options(actor: Actor) -> StateDictOptions:
    # Gathered to rank 0's CPU only: other ranks get empty dicts and never hold a full copy.
    return StateDictOptions(full_state_dict=True, cpu_offload=actor.ctx.distributed)


def _load_options(actor: Actor) -> StateDictOptions:
    # Rank 0 reads the files and broadcasts (other ranks pass empty dicts). LoRA: the checkpoint holds the adapter
    # only, the base comes from the model folder (load_checkpoint checks that every adapter weight is there).
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=actor.ctx.distributed,
                            strict=actor.lora is None)


def _lora_meta(actor: Actor) -> dict[str, Any] | None:
    """What a checkpoint records of learner.lora: resuming needs the same adapter shape."""
    if actor.lora is None:
        return None
    return {"rank": actor.lora.rank, "alpha": actor.lora.alpha, "target_modules": actor.lora.target_modules}


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state[device.type] = getattr(torch, device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type in state:
        getattr(torch, device.type).set_rng_state(state[device.type], device)


def full_model_state(actor: Actor) -> dict[str, torch.Tensor]:
    """The policy's unsharded state dict (on rank 0; empty elsewhere). Collective: every rank calls it."""
    return get_model_state_dict(actor.policy, options=_save_options(actor))


def trained_state(actor: Actor) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: every parameter, or with LoRA the adapter's alone. Collective."""
    if actor.lora is None:
        return full_model_state(actor)
    # The frozen base is never gathered (it is the model folder's); buffers are filtered out by name below.
    options = dataclasses.replace(_save_options(actor), ignore_frozen_params=True)
    state = get_model_state_dict(actor.policy, options=options)
    trainable = {name for name, p in actor.policy.named_parameters() if p.requires_grad}
    return {name: t for name, t in state.items() if name in trainable}


class _Writes:
    """Runs one rank's file writes, keeping the first failure instead of raising it at once: the rank must still
    join the collectives that follow (state-dict gathers, barriers), or the other ranks would hang."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def __call__(self, write: Callable[[], Any]) -> None:
        if self.error is None:
            try:
                write()
            except (OSError, RuntimeError, SafetensorError) as e:  # torch.save wraps write errors in RuntimeError
                # A copy without traceback or context: their frames would keep the half-written file open.
                self.error = OSError(e.errno, e.strerror) if isinstance(e, OSError) else RuntimeError(str(e))

    def first_failure(self, actor: Actor) -> BaseException | None:
        """The first rank's failure, on every rank (collective: it also serves as a barrier)."""
        if not actor.ctx.distributed:
            return self.error
        box: list[str | None] = [None] * actor.ctx.world_size
        dist.all_gather_object(box, None if self.error is None else f"rank {actor.ctx.rank}: {self.error!r}")
        mine = self.error
        return mine if mine is not None else next((RuntimeError(e) for e in box if e), None)


def _write_failed(err: BaseException, key: str, folder: Path, need: int, what: str) -> CheckpointError:
    """A failed write as one line naming the key, rather than torch's "unexpected pos" traceback."""
    where = f"{key}={str(folder)!r}"
    if disk_full(err):
        free = shutil.disk_usage(_existing(folder)).free
        return CheckpointError(f"{where}: no space left writing {what} (needs ~{fmt_bytes(need)}, {fmt_bytes(free)} "
                               "free after removing the partial write); earlier checkpoints are intact")
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"{where}: not writable ({err.strerror}) writing {what}")
    return CheckpointError(f"{where}: writing {what} failed: {err}")


def _existing(path: Path) -> Path:
    return next(p for p in [path, *path.parents] if p.exists())


def _swap_in(tmp: Path, final: Path) -> None:
    """Put the complete `tmp` folder at `final`; an older `final` is moved aside first and removed only after."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _normal_modes(folder: Path) -> None:
    """Give every file under `folder` the mode a file created there normally gets (0666 & ~umask, as `open()` and so
    `save_pretrained` give), every folder that of a new folder. safetensors creates its files owner-only (0600), so
    the weights alone would be unreadable to another user serving the export (`vllm serve` under its own account).
    The modes are read from a probe file and folder, never by setting the process umask (other threads create
    files meanwhile)."""
    import os

    probe = folder / ".mode-probe"
    probe.mkdir()
    dir_mode = probe.stat().st_mode & 0o7777
    probe.rmdir()
    probe.touch()
    file_mode = probe.stat().st_mode & 0o7777
    probe.unlink()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)


def _param_count(actor: Actor) -> int:
    return sum(p.numel() for p in actor.policy.parameters())  # global sizes, also for FSDP2 DTensors


def save_checkpoint(
    actor: Actor, cfg: CheckpointConfig, step: int, extra: dict[str, Any] | None = None
) -> Path:
    """Write `<cfg.dir>/step_<step>` with cfg.contents; every rank calls it. Returns the folder.

    Raises CheckpointError naming learner.checkpoint.dir on a full or unwritable disk, on every rank, after removing
    the partial folder; the earlier checkpoints are untouched."""
    root = Path(cfg.dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    ctx = actor.ctx
    writes = _Writes()
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        writes(lambda: tmp.mkdir(parents=True))
    if writes.first_failure(actor) is None:
        if "model" in cfg.contents:
            model_sd = trained_state(actor)
            if ctx.is_main:
                writes(lambda: torch.save(model_sd, tmp / "model.pt"))
            del model_sd
        if "optimizer" in cfg.contents:
            optim_sd = get_optimizer_state_dict(actor.policy, actor.optimizer, options=_save_options(actor))
            if ctx.is_main:
                writes(lambda: torch.save(optim_sd, tmp / "optimizer.pt"))
                writes(lambda: torch.save(actor.scheduler.state_dict(), tmp / "scheduler.pt"))
            del optim_sd
        if "extra" in cfg.contents:
            writes(lambda: torch.save(_rng_state(ctx.device), tmp / f"rng_{ctx.rank}.pt"))
            if ctx.is_main:
                writes(lambda: torch.save({"step": actor.step, "extra": extra or {}}, tmp / "extra.pt"))
        if ctx.is_main:
            meta = {"step": step, "contents": list(cfg.contents), "world_size": ctx.world_size,
                    "lora": _lora_meta(actor)}
            writes(lambda: (tmp / "meta.json").write_text(json.dumps(meta, indent=1)))
    failure = writes.first_failure(actor)
    if failure is not None:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(failure, "learner.checkpoint.dir", root, checkpoint_bytes(_param_count(actor),
                                                                                      cfg.contents), final.name)
    if ctx.is_main:
        _swap_in(tmp, final)
        if cfg.keep_last is not None:
            for old in list_checkpoints(root)[: -cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(actor)
    return final


def resume_path(cfg: CheckpointConfig) -> Path | None:
    """The checkpoint `cfg.resume` asks for: auto -> the newest complete one (or None), never -> None, or a path."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        found = list_checkpoints(cfg.dir)
        return found[-1] if found else None
    path = Path(cfg.resume)
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"checkpoint.resume={cfg.resume!r} is not a complete checkpoint folder (no meta.json)")
    return path


def _check_fits(path: Path, state: dict[str, torch.Tensor], actor: Actor) -> None:
    """A checkpoint of another model (a leftover in checkpoint.dir) fails here, named, not as 600 lines of torch
    size-mismatch errors."""
    for name, param in actor.policy.named_parameters():
        shape = tuple(param.shape)  # the full shape, also for FSDP2 DTensors
        saved = state.get(name)
        if saved is not None and tuple(saved.shape) != shape:
            raise CheckpointError(
                f"{path} was saved from another model: {name} is {list(saved.shape)} there, {list(shape)} here. "
                "Point learner.checkpoint.dir elsewhere or set learner.checkpoint.resume=never"
            )


def load_checkpoint(actor: Actor, path: str | Path) -> dict[str, Any]:
    """Restore what the checkpoint holds into `actor` (and the RNGs); return the loop's `extra` dict."""
    path, ctx = Path(path), actor.ctx
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    contents = meta["contents"]
    if meta.get("lora") != _lora_meta(actor):
        raise CheckpointError(
            f"{path} was saved with learner.lora {meta.get('lora') or 'off'}, this run has "
            f"{_lora_meta(actor) or 'off'}: resume with the same learner.lora, or point learner.checkpoint.dir "
            "elsewhere")
    if "model" in contents:
        sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True) if ctx.is_main else {}
        _check_fits(path, sd, actor)
        if actor.lora is not None and ctx.is_main:
            missing = [n for n, p in actor.policy.named_parameters() if p.requires_grad and n not in sd]
            if missing:
                raise CheckpointError(f"{path} lacks {len(missing)} adapter weights, e.g. {missing[0]}")
        set_model_state_dict(actor.policy, sd, options=_load_options(actor))
        actor.masters_loaded()
        del sd
    if "optimizer" in contents:
        osd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False) if ctx.is_main else {}
        set_optimizer_state_dict(actor.policy, actor.optimizer, osd, options=_load_options(actor))
        del osd
        actor.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    extra: dict[str, Any] = {}
    if "extra" in contents:
        blob = torch.load(path / "extra.pt", map_location="cpu", weights_only=False)
        actor.step, extra = blob["step"], blob["extra"]
        rng_file = path / f"rng_{ctx.rank}.pt"
        if not rng_file.is_file():  # resumed on more ranks than saved: reuse rank 0's streams
            rng_file = path / "rng_0.pt"
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False), ctx.device)
    else:
        actor.step = meta["step"]
    _barrier(actor)
    return extra


def export_hf(actor: Actor, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the policy as a Hugging Face folder (config, tokenizer + chat template, generation config,
    safetensors in `dtype`) that `AutoModelForCausalLM.from_pretrained` and `vllm serve` load. Collective.

    LoRA: the PEFT adapter folder (adapter_model.safetensors, adapter_config.json naming the base model, the
    tokenizer) that `PeftModel.from_pretrained` and `vllm serve --enable-lora --lora-modules` load; with
    learner.lora.export_merged also the merged model under `<out_dir>/merged`."""
    if actor.lora is not None:
        return _export_adapter(actor, Path(out_dir), dtype)
    return _export_full(actor, Path(out_dir), dtype, full_model_state(actor))


def _export_adapter(actor: Actor, out: Path, dtype: str) -> Path:
    from transformers import AutoTokenizer

    from dgrpo.learner.update import lora as peft_lora

    tmp = out.with_name(out.name + ".tmp")
    check_replaceable("learner.checkpoint.export_dir", out, "adapter_config.json")
    merged = None
    if actor.lora.export_merged:  # (merged on one device: every rank computes it alike, rank 0 writes it)
        merged = dict(peft_lora.merged_tensors(actor.policy, dtype=torch.float32))

    def write() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        actor.policy.save_pretrained(tmp)  # PEFT: the adapter alone, base_model_name_or_path = the model folder
        AutoTokenizer.from_pretrained(actor.model_path).save_pretrained(tmp)
        if merged is not None:
            _write_hf_folder(actor.policy.get_base_model(), merged, tmp / "merged", dtype, actor.model_path)
        _normal_modes(tmp)
        _swap_in(tmp, out)

    return _write_export(actor, write, tmp, out, dtype)


def _write_export(actor: Actor, write, tmp: Path, out: Path, dtype: str) -> Path:
    """Rank 0 runs `write` (into `tmp`, then swapped in as `out`); a failure on rank 0 fails every rank, naming the
    key, with the partial write removed."""
    writes = _Writes()
    if actor.ctx.is_main:
        writes(write)
    failure = writes.first_failure(actor)
    if failure is not None:
        if actor.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(failure, "learner.checkpoint.export_dir", out, export_bytes(_param_count(actor), dtype),
                            "the export")
    return out


def _write_hf_folder(policy, sd: dict[str, torch.Tensor], folder: Path, dtype: str, model_path: Path) -> None:
    """`sd` (checkpoint names) as safetensors in `dtype`, with the policy's config, generation config and the
    tokenizer: a folder `from_pretrained` and `vllm serve` load. No collectives: rank 0 alone calls it."""
    from transformers import AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    config = copy.deepcopy(policy.config)
    tied = getattr(policy, "all_tied_weights_keys", None) or {}
    state = {k: v for k, v in sd.items() if k not in tied} if getattr(config, "tie_word_embeddings", False) \
        else sd  # tied weights are written once, under the source's name
    folder.mkdir(parents=True)
    save_file({k: v.to(torch_dtype).contiguous() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    config.dtype = torch_dtype
    config.save_pretrained(folder)
    if policy.generation_config is not None:
        policy.generation_config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)


def _export_full(actor: Actor, out: Path, dtype: str, sd: dict[str, torch.Tensor]) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    check_replaceable("learner.checkpoint.export_dir", out, "config.json")  # it is replaced whole

    def write() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        _write_hf_folder(actor.policy, sd, tmp, dtype, actor.model_path)
        _normal_modes(tmp)
        _swap_in(tmp, out)  # a previous export stays whole until this one is

    return _write_export(actor, write, tmp, out, dtype)
