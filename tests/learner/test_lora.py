"""LoRA on the learner (tiny model, CPU): what trains, the reference for free, what each version publishes, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dgrpo.common.config import ConfigError
from dgrpo.learner.records import checkpoint as ckpt
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, CheckpointConfig, OptimConfig
from dgrpo.weights.config import LoraConfig
from dgrpo.weights.lora import check_adapter

pytest.importorskip("peft")
LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], merge_on_sync=False)


def make_seqs(n: int = 8, seed: int = 0) -> list[Sequence]:
    """n sequences of varied lengths (groups of 4), advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p, c = 3 + i % 3, 2 + (i * 3) % 5
        ids = torch.randint(5, 1000, (p + c,), generator=g).tolist()
        seqs.append(Sequence(ids[:p], ids[p:], 1.0 if i % 2 else -1.0, [-7.0] * c))
    return seqs


def make_actor(path, **kw) -> Actor:
    return Actor(path, ActorConfig(ppo_mini_batch_size=2, micro_batch_size_per_device=4, dtype="float32"),
                 OptimConfig(**{"lr": 1e-3, **kw.pop("optim", {})}), AlgorithmConfig(**kw.pop("algorithm", {})),
                 total_steps=10, max_response_length=8, **kw)


def lora_actor(path, lora: LoraConfig = LORA, **kw):
    """A LoRA actor; the adapter's random init (lora_A) drawn from seed 0, as the loop seeds torch first."""
    torch.manual_seed(0)
    kw.setdefault("optim", {"lr": 1e-2})
    return make_actor(path, lora=lora, **kw)


def test_only_the_adapter_trains_and_sits_in_adamw(tiny_model):
    actor = lora_actor(tiny_model, algorithm={"beta": 0.1})
    trainable = {n for n, p in actor.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in actor.policy.parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in actor.policy.parameters() if p.requires_grad)
    assert actor.reference is None  # the reference is the policy without its adapter, no second model
    frozen = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
    seqs = make_seqs(8)
    metrics = actor.update(seqs, group_size=4)
    assert metrics["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # a fresh adapter (B = 0) is the base model
    for n, p in actor.policy.named_parameters():
        if p.requires_grad:
            if ".lora_B." in n:  # B starts at 0 and moves; A moves once B is nonzero
                assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, frozen[n]), f"frozen base weight {n} changed"
    actor.update(seqs, group_size=4)
    assert actor.update(seqs, group_size=4)["actor/kl"] > 0  # the policy left the base: KL to it is positive


def test_reference_is_the_base_model(tiny_model):
    """Reference logprobs with the adapter switched off equal a plain model's from the same checkpoint, while the
    trained policy's differ."""
    actor = lora_actor(tiny_model, algorithm={"beta": 0.1})
    plain = make_actor(tiny_model)
    seqs = make_seqs(8)
    for _ in range(2):
        actor.update(seqs, group_size=4)
    ref, base = actor.compute_logprobs(seqs, reference=True), plain.compute_logprobs(seqs)
    policy = actor.compute_logprobs(seqs)
    for r, b, p in zip(ref, base, policy, strict=True):
        torch.testing.assert_close(r, b, atol=1e-5, rtol=1e-5)
    assert max((p - b).abs().max().item() for p, b in zip(policy, base, strict=True)) > 1e-3


def test_adapter_publish_names_shapes_and_config(tiny_model):
    """The adapter alone: PEFT's saved names, lora_A [r, in] / lora_B [out, r] of checkpoint weights, its
    adapter_config.json; check_adapter (the samplers' check) accepts it and refuses a wrong rank."""
    from dgrpo.weights.subscriber import checkpoint_shapes

    actor = lora_actor(tiny_model)
    named = list(actor.named_weights(torch.bfloat16))
    assert [(n, list(t.shape)) for n, t in named] == actor.weight_layout()
    assert all(t.dtype == torch.bfloat16 for _, t in named)
    config = actor.adapter_config()
    assert json.loads(config)["r"] == 4 and sorted(json.loads(config)["target_modules"]) == ["down_proj", "q_proj",
                                                                                             "v_proj"]
    shapes = checkpoint_shapes(tiny_model)
    layers = sum(1 for n in shapes if n.endswith("self_attn.q_proj.weight"))
    assert len(named) == layers * 3 * 2
    assert check_adapter([(n, list(t.shape)) for n, t in named], config, shapes) is None
    wrong = json.dumps({**json.loads(config), "r": 8})
    assert "needs" in check_adapter([(n, list(t.shape)) for n, t in named], wrong, shapes)
    assert "not a LoRA factor" in check_adapter([("model.norm.weight", [64])], config, shapes)
    # Adapter bytes vs full weights: the point of adapter-only sync.
    adapter_bytes = sum(t.numel() * 2 for _, t in named)
    full_bytes = sum(t.numel() * 2 for _, t in make_actor(tiny_model).named_weights(torch.bfloat16))
    assert full_bytes > 20 * adapter_bytes


def test_merge_on_sync_auto_merges_on_cpu_only(tiny_model):
    """The default (auto) follows the engine's LoRA speed: merged full weights on CPU, the adapter on CUDA / NPU;
    a sampler asked before it is decided refuses rather than guess."""
    auto = LoraConfig(rank=4)
    assert auto.merge_on_sync == "auto"
    with pytest.raises(RuntimeError, match="still auto"):
        _ = auto.serves_adapters
    assert [auto.on_device(d).serves_adapters for d in ("cpu", "cuda", "npu")] == [False, True, True]
    assert LORA.on_device("cpu").serves_adapters  # an explicit false stays false on CPU
    actor = lora_actor(tiny_model, lora=LoraConfig(rank=4, target_modules=LORA.target_modules))
    assert actor.adapter_config() is None  # on this CPU: full weights travel
    assert not any(".lora_" in name for name, _ in actor.weight_layout())


def test_merged_weights_equal_peft_merge_and_leave_the_base_alone(tiny_model):
    actor = lora_actor(tiny_model, lora=LORA.model_copy(update={"merge_on_sync": True}))
    actor.update(make_seqs(8), group_size=4)
    actor.update(make_seqs(8, seed=1), group_size=4)
    frozen = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if not p.requires_grad}
    merged = dict(actor.named_weights(torch.float32))
    assert [(n, list(t.shape)) for n, t in merged.items()] == actor.weight_layout()
    assert actor.adapter_config() is None
    for n, p in actor.policy.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n])
    import copy

    want = copy.deepcopy(actor.policy).merge_and_unload().state_dict()
    base = make_actor(tiny_model).policy.state_dict()
    assert set(merged) <= set(want) and set(want) - set(merged) <= {"lm_head.weight"}  # tied: once
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name].float(), atol=1e-6, rtol=1e-6)
    changed = {n.rsplit(".", 2)[-2] for n, t in merged.items() if not torch.equal(t, base[n])}
    assert changed == {"q_proj", "v_proj", "down_proj"}  # the adapter's modules moved, nothing else


def test_target_modules_matching_nothing_is_named(tiny_model):
    with pytest.raises(ConfigError, match=r"learner.lora.target_modules: \['qkv_proj'\] match no linear layer"):
        lora_actor(tiny_model, lora=LoraConfig(rank=4, target_modules=["q_proj", "qkv_proj"]))


def test_all_linear_targets_every_linear_but_the_head(tiny_model):
    actor = lora_actor(tiny_model, lora=LoraConfig(rank=2, merge_on_sync=False))
    targets = set(json.loads(actor.adapter_config())["target_modules"])
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_resume_is_bit_identical_for_the_adapter(tiny_model, tmp_path):
    """Checkpoints hold the adapter and its AdamW state only; a resumed actor continues exactly."""
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"))
    batches = [make_seqs(8, seed=s) for s in range(4)]
    straight = lora_actor(tiny_model)
    for b in batches:
        straight.update(b, group_size=4)
    first = lora_actor(tiny_model)
    for b in batches[:2]:
        first.update(b, group_size=4)
    path = ckpt.save_checkpoint(first, cfg, 2, {"k": 1})
    saved = torch.load(path / "model.pt", weights_only=True)
    assert saved and all(".lora_" in n for n in saved)  # the frozen base is not copied into checkpoints
    resumed = lora_actor(tiny_model)
    assert ckpt.load_checkpoint(resumed, path) == {"k": 1}
    for b in batches[2:]:
        resumed.update(b, group_size=4)
    for (n, a), (_, b) in zip(straight.policy.named_parameters(), resumed.policy.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_a_full_checkpoint_does_not_resume_a_lora_run(tiny_model, tmp_path):
    cfg = CheckpointConfig(dir=str(tmp_path / "ckpt"))
    full = make_actor(tiny_model)
    path = ckpt.save_checkpoint(full, cfg, 1)
    with pytest.raises(ckpt.CheckpointError, match="learner.lora"):
        ckpt.load_checkpoint(lora_actor(tiny_model), path)


def test_export_writes_the_peft_adapter_and_the_merged_model(tiny_model, tmp_path):
    """The adapter folder loads with PEFT onto the base model, the merged folder with transformers alone; both give
    the trained policy's logits. Under umask 0022 every file is 0644 and every folder 0755, adapter_model.safetensors
    and merged/model.safetensors too (safetensors alone writes 0600: `vllm serve` under another user could not read
    them)."""
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor = lora_actor(tiny_model, lora=LORA.model_copy(update={"export_merged": True}))
    for s in range(2):
        actor.update(make_seqs(8, seed=s), group_size=4)
    before = os.umask(0o022)
    try:
        out = ckpt.export_hf(actor, tmp_path / "export", dtype="float32")
    finally:
        os.umask(before)
    modes = {p.relative_to(out): p.stat().st_mode & 0o7777 for p in [out, *out.rglob("*")]}
    assert {p for p, m in modes.items() if m != (0o755 if (out / p).is_dir() else 0o644)} == set(), modes
    assert {Path("adapter_model.safetensors"), Path("merged/model.safetensors")} <= set(modes)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)
    ids = torch.tensor([[1, 17, 42, 99, 5, 7]])
    with torch.no_grad():
        want = actor.policy(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        adapter = PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(adapter, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, want, atol=1e-4, rtol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapter is really in both
