"""Checkpoints: resuming gives exactly the uninterrupted run's next update; pruning, resume choice, export."""

from __future__ import annotations

import json

import pytest
import torch

from dgrpo.learner.records.checkpoint import (
    CheckpointError,
    export_hf,
    list_checkpoints,
    load_checkpoint,
    resume_path,
    save_checkpoint,
)
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, CheckpointConfig, OptimConfig


def batch(seed: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence(torch.randint(5, 900, (3,), generator=g).tolist(), torch.randint(5, 900, (2 + i % 3,), generator=g)
                 .tolist(), (-1.0) ** i)
        for i in range(8)
    ]


def make_actor(path) -> Actor:
    return Actor(
        path,
        ActorConfig(ppo_mini_batch_size=1, dtype="float32"),  # 2 AdamW updates per step
        OptimConfig(lr=1e-3, warmup_steps=3, schedule="cosine"),
        AlgorithmConfig(beta=0.05),
        total_steps=5,
        max_response_length=4,
    )


def weights(actor: Actor) -> dict[str, torch.Tensor]:
    return dict(actor.named_weights(torch.float32))


def test_resume_continues_exactly(tiny_model, tmp_path):
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"))
    run = make_actor(tiny_model)
    run.update(batch(1), group_size=4)
    save_checkpoint(run, cfg, step=1, extra={"data_position": 8})
    rng_after_save = torch.rand(3)
    metrics = run.update(batch(2), group_size=4)  # the uninterrupted run's step 2

    resumed = make_actor(tiny_model)
    extra = load_checkpoint(resumed, resume_path(cfg))
    assert extra == {"data_position": 8} and resumed.step == 1
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored to the moment of saving
    resumed_metrics = resumed.update(batch(2), group_size=4)
    assert resumed_metrics["actor/lr"] == metrics["actor/lr"] == pytest.approx(2e-3 / 3)  # the schedule continued
    assert resumed_metrics["actor/loss"] == metrics["actor/loss"]
    for (name, a), b in zip(weights(run).items(), weights(resumed).values(), strict=True):
        assert torch.equal(a, b), name


def test_model_only_checkpoint_restarts_the_optimizer(tiny_model, tmp_path):
    cfg = CheckpointConfig(dir=str(tmp_path), contents=["model"])
    actor = make_actor(tiny_model)
    actor.update(batch(1), group_size=4)
    path = save_checkpoint(actor, cfg, step=3)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.pt"]
    fresh = make_actor(tiny_model)
    assert load_checkpoint(fresh, path) == {}
    assert fresh.step == 3 and fresh.optimizer.state_dict()["state"] == {}
    for (name, a), b in zip(weights(actor).items(), weights(fresh).values(), strict=True):
        assert torch.equal(a, b), name


def test_keep_last_and_resume_choice(tiny_model, tmp_path):
    actor = make_actor(tiny_model)
    cfg = CheckpointConfig(dir=str(tmp_path), keep_last=2, contents=["extra"])
    for step in (1, 2, 3):
        save_checkpoint(actor, cfg, step=step)
    (tmp_path / "step_9").mkdir()  # no meta.json: an interrupted save is never resumed from
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    assert resume_path(cfg) == tmp_path / "step_3"
    assert resume_path(cfg.model_copy(update={"resume": "never"})) is None
    assert resume_path(CheckpointConfig(dir=str(tmp_path / "empty"))) is None
    assert resume_path(cfg.model_copy(update={"resume": str(tmp_path / "step_2")})) == tmp_path / "step_2"
    with pytest.raises(CheckpointError, match="step_9"):
        resume_path(cfg.model_copy(update={"resume": str(tmp_path / "step_9")}))
    assert json.loads((tmp_path / "step_3" / "meta.json").read_text())["world_size"] == 1


def test_export_loads_in_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = make_actor(tiny_model)
    actor.update(batch(1), group_size=4)
    out = export_hf(actor, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.dtype == torch.bfloat16
    trained = weights(actor)
    for name, tensor in model.state_dict().items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(tensor, trained[source].to(torch.bfloat16), msg=name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the deployment keeps the chat format it was trained with


def export_modes(folder) -> dict[str, int]:
    """Every file's and folder's permission bits under `folder` (itself as '.')."""
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o7777 for p in [folder, *folder.rglob("*")]}


@pytest.fixture
def umask():
    """Set the process umask for a test (restored after)."""
    import os

    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


def test_the_export_has_the_modes_save_pretrained_gives(tiny_model, tmp_path, umask):
    """safetensors writes its file owner-only (0600): the weights alone would be unreadable to another user serving
    the export. Every file gets what a new file gets under the umask (tokenizer.json, from save_pretrained), every
    folder what a new folder gets; 0027 shows the umask is followed, not a fixed 0644."""
    actor = make_actor(tiny_model)
    for mask, file_mode, dir_mode in ((0o027, 0o640, 0o750), (0o022, 0o644, 0o755)):
        umask(mask)
        out = export_hf(actor, tmp_path / "export")
        modes = export_modes(out)
        assert "model.safetensors" in modes and modes["tokenizer.json"] == file_mode
        assert modes == {name: dir_mode if (out / name).is_dir() else file_mode for name in modes}, oct(mask)


def test_checkpoint_of_another_model_is_refused_by_name(tiny_model, tmp_path):
    """A leftover checkpoint of a different model in checkpoint.dir: a one-line error naming the mismatch."""
    from dgrpo.common.models import make_tiny_model

    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"))
    other = make_actor(make_tiny_model(tmp_path / "wider", hidden_size=192))
    path = save_checkpoint(other, cfg, step=1, extra={})
    with pytest.raises(CheckpointError, match=r"another model: .*\[49152, 192\] there, \[49152, 128\] here"):
        load_checkpoint(make_actor(tiny_model), path)


@pytest.fixture
def tmpfs(child_processes, tmp_path):
    """`mount(size_bytes)` -> a real filesystem that small (tmpfs; needs root), unmounted afterwards."""
    import subprocess

    mounted = []

    def mount(size: int):
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          check=False, capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_mid_run_names_the_key_and_keeps_the_previous_checkpoint(tiny_model, tmp_path, tmpfs):
    """A checkpoint that no longer fits: one CheckpointError naming learner.checkpoint.dir and the space needed (not
    torch's "unexpected pos"), the partial folder removed, the previous checkpoint whole and loadable."""
    actor = make_actor(tiny_model)
    probe = save_checkpoint(actor, CheckpointConfig(dir=str(tmp_path / "probe"), contents=["model"]), step=1)
    size = (probe / "model.pt").stat().st_size
    cfg = CheckpointConfig(dir=str(tmpfs(int(size * 1.5)) / "ck"), contents=["model"], keep_last=1)
    first = save_checkpoint(actor, cfg, step=1)
    saved = (first / "model.pt").read_bytes()
    actor.update(batch(1), group_size=4)
    with pytest.raises(CheckpointError, match=r"learner.checkpoint.dir='.*/ck': no space left writing step_2 "
                                              r"\(needs ~\d+ MB, \d+(\.\d)? MB free .*earlier checkpoints are intact"):
        save_checkpoint(actor, cfg, step=2)
    assert sorted(p.name for p in (first.parent).iterdir()) == ["step_1"]  # no step_2.tmp left taking the space
    assert (first / "model.pt").read_bytes() == saved
    load_checkpoint(make_actor(tiny_model), resume_path(cfg))


def test_rewriting_a_step_and_the_export_swap_in_whole(tiny_model, tmp_path, tmpfs):
    from dgrpo.common.config import ConfigError

    actor = make_actor(tiny_model)
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"))
    save_checkpoint(actor, cfg, step=1)
    save_checkpoint(actor, cfg, step=1)  # the same step again (a stop right after a due checkpoint)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_1"]
    out = export_hf(actor, tmp_path / "export")
    export_hf(actor, out)  # replaces the previous export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "export"]

    size = sum(p.stat().st_size for p in out.iterdir())
    small = tmpfs(int(size * 1.4)) / "export"
    export_hf(actor, small)
    before = {p.name: p.read_bytes() for p in small.iterdir()}
    with pytest.raises(CheckpointError, match=r"learner.checkpoint.export_dir='.*/export': no space left writing the "
                                              r"export \(needs ~\d+ MB"):
        export_hf(actor, small)
    assert {p.name: p.read_bytes() for p in small.iterdir()} == before  # the previous export is whole
    assert sorted(p.name for p in small.parent.iterdir()) == ["export"]

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"learner.checkpoint.export_dir=.*notes.*not an earlier output"):
        export_hf(actor, tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_resumed_trainer_keeps_one_metrics_record_per_step(tiny_model, tmp_path):
    """The loop's own setup: resumed from step 2 of a run that logged through step 4 before it crashed, the run's
    metrics.jsonl reads as one run (steps 1-2 kept, 3-4 dropped: they run again)."""
    import asyncio

    from support import free_port

    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config
    from dgrpo.learner.loop import Trainer

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1?"}) + "\n" for i in range(4)))
    cfg = load_config(StackConfig, None, [
        f"model.path={tiny_model}", "model.dtype=float32", f"learner.data.train_files=[{tmp_path / 'train.jsonl'}]",
        "learner.data.train_batch_size=2", "learner.actor.ppo_mini_batch_size=2", "learner.actor.dtype=float32",
        f"learner.checkpoint.dir={tmp_path / 'ck'}", f"learner.trainer.log_dir={tmp_path / 'runs'}",
        "learner.trainer.loggers=[jsonl]", "learner.trainer.control_port=null",
        f"weights.announce_port={free_port()}", f"weights.control_port={free_port()}",
    ]).learner_run()
    metrics = tmp_path / "runs" / "dgrpo" / "metrics.jsonl"

    crashed = Trainer(cfg)
    crashed.setup()
    for step in range(1, 5):
        crashed.step_num = crashed.actor.step = step
        crashed.metrics.log(step, 8, {"reward/mean": 0.1 * step}, "generate")
        if step == 2:
            crashed.save_checkpoint()
    asyncio.run(crashed.close())
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]

    resumed = Trainer(cfg)
    resumed.setup()
    assert resumed.step_num == 2
    resumed.metrics.log(3, 8, {"reward/mean": 0.9}, "generate")
    asyncio.run(resumed.close())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.1), (2, 0.2), (3, 0.9)]
