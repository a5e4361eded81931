"""dgrpo plan: the memory model against exact tensor bytes of the real Actor (parameters, AdamW states, the bytes
autograd saves for backward, counted with saved_tensors_hooks: deterministic, not RSS), the KV formula against the
figures the example configs quote, and the knob order when something does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dgrpo.cli.doctor import memory as plan
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
QWEN7B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
          "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def llama_folder(tmp_path: Path, **shape) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                         "tie_word_embeddings": True, "pad_token_id": 0, **shape})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_from_config_json_equals_the_model(tmp_path, tied):
    folder = llama_folder(tmp_path, tie_word_embeddings=tied)
    from transformers import AutoModelForCausalLM

    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert plan.read_shape(folder).params == real and plan.read_shape(folder).params_from == "safetensors headers"
    for f in folder.glob("*.safetensors"):
        f.unlink()
    shape = plan.read_shape(folder)
    assert shape.params_from == "config.json shapes" and shape.params == real


def test_kv_cache_per_token_matches_the_example_configs_budgets(tmp_path):
    smol = plan._bundled_shape()
    assert plan.kv_bytes_per_token(smol, "bfloat16") == 23040  # cpu-demo.yaml: "23 KB/token"
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    qwen = plan.read_shape(tmp_path)
    assert plan.kv_bytes_per_token(qwen, "bfloat16") == 57344  # npu-node.yaml: "57 KB/token"
    assert plan.kv_bytes_per_token(qwen, "bfloat16", tp=2) == 57344 // 2
    assert 7.5e9 < qwen.params < 7.7e9  # Qwen2.5-7B: 7.6B (biases of q, k, v are not counted: 0.01%)


def _stack(folder: Path, *overrides: str) -> StackConfig:
    return load_config(StackConfig, ROOT / "configs" / "cpu-demo.yaml", [f"model.path={folder}", *overrides])


@pytest.mark.parametrize(("dtype", "bf16_weights"),
                         [("float32", "autocast"), ("bfloat16", "autocast"), ("bfloat16", "published")])
def test_learner_terms_match_the_real_actors_tensors(tmp_path, dtype, bf16_weights):
    """Weights and AdamW states exactly; activations + logits within 15% of what autograd really saves for one
    packed micro-batch at the config's longest lengths (the bytes benchmarks/bench_plan.py sees on the big model)."""
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.batch import Sequence

    folder = llama_folder(tmp_path)
    cfg = _stack(folder, f"learner.actor.dtype={dtype}", f"learner.actor.bf16_weights={bf16_weights}",
                 "learner.actor.max_tokens_per_micro_batch=1024", "learner.data.train_batch_size=2",
                 "learner.actor.ppo_mini_batch_size=2")
    lc = cfg.learner
    p, r, n = lc.data.max_prompt_length, lc.rollout.max_response_length, lc.rollout.n
    actor = Actor(folder, lc.actor, lc.optim, lc.algorithm, total_steps=2, max_response_length=r)
    seqs = []
    for _ in range(2):
        prompt = torch.randint(5, 1000, (p,)).tolist()
        seqs += [Sequence(prompt, torch.randint(5, 1000, (r,)).tolist(), float(i % 2), [-5.0] * r) for i in range(n)]
    own = {q.untyped_storage().data_ptr() for q in actor.policy.parameters()}
    shapes = {tuple(q.shape) for q in actor.policy.parameters()}
    saved: dict[int, int] = {}
    casts: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            (casts if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes else saved)[st.data_ptr()] = st.nbytes()
        return t

    mb = actor._train_batches(seqs)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor._forward(actor._trained_model(), mb)
    actor.update(seqs, n)
    terms = {t.name: t.bytes for t in plan.learner_terms(plan.read_shape(folder), cfg, 1, "cpu")}
    assert mb.input_ids.numel() == plan.micro_batch_tokens(cfg)[0]
    params = sum(q.numel() * q.element_size() for q in actor.policy.parameters())
    adam = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values() if v.dim())
    assert terms["weights fp32"] == params and terms["gradients fp32"] == params and terms["AdamW moments fp32"] == adam
    ratio = sum(saved.values()) / (terms["activations"] + terms["logits"])
    assert 0.85 < ratio < 1.15, ratio
    if bf16_weights == "published":  # the copy's own parameters are what backward keeps: no per-op casts
        copy = sum(q.numel() * q.element_size() for q in actor._trained_model().parameters())
        assert terms["bf16 compute copy"] == copy == terms["bf16 copy gradients"]
        assert "autocast bf16 weights" not in terms and sum(casts.values()) <= copy
        fsdp = {t.name for t in plan.learner_terms(plan.read_shape(folder), cfg, 2, "cpu")}
        assert "autocast bf16 weights" in fsdp and "bf16 compute copy" not in fsdp  # torchrun: autocast, no copy
    elif dtype == "bfloat16":
        assert 0.85 < sum(casts.values()) / terms["autocast bf16 weights"] <= 1.0 + 1e-9
        assert "bf16 compute copy" not in terms
    else:
        assert "autocast bf16 weights" not in terms and not casts


def _qwen(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    return tmp_path


def test_learner_that_does_not_fit_names_the_micro_batch_first_then_checkpointing_then_ranks(tmp_path):
    cfg = load_config(StackConfig, ROOT / "configs" / "npu-node.yaml",
                      [f"model.path={_qwen(tmp_path)}", "learner.actor.gradient_checkpointing=false"])
    m = plan.read_shape(tmp_path)
    fits = plan.plan_learner(m, cfg, 4, "npu", 200 * 2**30)
    assert fits.fits and not fits.fix
    first = plan.plan_learner(m, cfg, 4, "npu", 90 * 2**30)
    assert not first.fits and first.fix.startswith("learner.actor.max_tokens_per_micro_batch=")
    budget = int(first.fix.split("=")[1].split()[0])
    smaller = load_config(StackConfig, ROOT / "configs" / "npu-node.yaml",
                          [f"model.path={tmp_path}", "learner.actor.gradient_checkpointing=false",
                           f"learner.actor.max_tokens_per_micro_batch={budget}"])
    assert plan.plan_learner(m, smaller, 4, "npu", 90 * 2**30).fits  # the named value really fits
    second = plan.plan_learner(m, cfg, 4, "npu", 60 * 2**30)
    assert second.fix.startswith("learner.actor.gradient_checkpointing=true")
    third = plan.plan_learner(m, cfg, 4, "npu", 16 * 2**30)
    assert "learner ranks" in third.fix


def test_sampler_kv_cache_smaller_than_one_sequence_is_a_problem_with_its_knob(tmp_path):
    cfg = load_config(StackConfig, ROOT / "configs" / "npu-node.yaml",
                      [f"model.path={_qwen(tmp_path)}", "sampler.gpu_memory_utilization=0.25"])
    m = plan.read_shape(tmp_path)
    low = plan.plan_sampler(m, cfg, "npu", 64 * 2**30)
    assert not low.fits and "gpu_memory_utilization" in low.fix
    ok = plan.plan_sampler(m, load_config(StackConfig, ROOT / "configs" / "npu-node.yaml", [f"model.path={tmp_path}"]),
                           "npu", 64 * 2**30)
    assert ok.fits and "sequences of 2560" in ok.notes[0]
    long = load_config(StackConfig, ROOT / "configs" / "npu-node.yaml",
                       [f"model.path={tmp_path}", "sampler.max_model_len=32768"])
    cpu = plan.plan_sampler(m, long, "cpu", None)
    assert not cpu.fits and cpu.fix == "sampler.kv_cache_space_gib=3"  # 1 GiB < 32768 x 57 KB = 1.9 GB


def test_dgrpo_plan_command_exits_1_when_it_does_not_fit(child_processes, tmp_path):
    args = [sys.executable, "-m", "dgrpo.cli", "plan", "--config", str(ROOT / "configs" / "npu-node.yaml"),
            "--device", "npu", "--learner-ranks", "4", f"model.path={_qwen(tmp_path)}"]
    ok = subprocess.run([*args, "--device-memory-gb", "68.7"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "AdamW moments fp32" in ok.stdout and "dgrpo plan: fits" in ok.stdout
    bad = subprocess.run([*args, "--device-memory-gb", "20", "--json"], capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    out = json.loads(bad.stdout)
    assert not out["fits"] and out["learner"]["fix"] and out["sampler"]["problem"]


@pytest.mark.parametrize(("transport", "slots", "where"), [("shm", 2, "in /dev/shm"),
                                                            ("collective", 2, "of each sampler host"),
                                                            ("tcp", 1, "of each replica")])
def test_shared_memory_counts_the_slots_each_transport_keeps(tmp_path, transport, slots, where):
    """The shm term sizes /dev/shm (compose's shm_size, the Kubernetes emptyDirs): the learner's two slots, a sampler
    host relay's two, or one staging copy per tcp replica; bf16 weights are 2 bytes per parameter."""
    cfg = load_config(StackConfig, ROOT / "configs" / "npu-node.yaml",
                      [f"model.path={_qwen(tmp_path)}", f"weights.transport={transport}"])
    p = plan.plan_stack(cfg, device="npu", device_bytes=64 * 2**30)
    assert p.shm.bytes == slots * p.model.params * 2 and where in p.shm.formula
    assert p.as_dict()["shm"]["bytes"] == p.shm.bytes


@pytest.mark.parametrize(("dtype", "targets"), [("float32", ["q_proj", "v_proj", "down_proj"]),
                                                ("bfloat16", "all-linear")])
def test_lora_terms_match_the_real_peft_actor(tmp_path, dtype, targets):
    """learner.lora: the frozen base, the adapter, its gradients and AdamW moments equal the PEFT actor's tensors
    after an update; no reference copy with beta > 0; the shared-memory slots hold the adapter, not the model."""
    pytest.importorskip("peft")
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.batch import Sequence

    folder = llama_folder(tmp_path)
    cfg = _stack(folder, f"learner.actor.dtype={dtype}", "learner.data.train_batch_size=2",
                 "learner.actor.ppo_mini_batch_size=2", "learner.lora.rank=4", f"learner.lora.target_modules={targets}",
                 "learner.algorithm.beta=0.04")
    lc = cfg.learner
    actor = Actor(folder, lc.actor, lc.optim, lc.algorithm, total_steps=2, max_response_length=8, lora=lc.lora)
    seqs = [Sequence([5, 6, 7], [8 + i, 9], float(i % 2), [-5.0, -5.0]) for i in range(2 * lc.rollout.n)]
    grad_bytes: list[int] = []  # read as the optimizer steps: zero_grad(set_to_none) frees them right after

    def count_grads(optimizer, *_):
        grad_bytes.append(sum(q.grad.numel() * q.grad.element_size() for g in optimizer.param_groups
                              for q in g["params"] if q.grad is not None))

    actor.optimizer.register_step_pre_hook(count_grads)
    actor.update(seqs, lc.rollout.n)
    terms = {t.name: t.bytes for t in plan.learner_terms(plan.read_shape(folder), cfg, 1, "cpu")}
    frozen = sum(q.numel() * q.element_size() for q in actor.policy.parameters() if not q.requires_grad)
    adapter = sum(q.numel() * q.element_size() for q in actor.policy.parameters() if q.requires_grad)
    grads = max(grad_bytes)
    assert all(q.grad is None for q in actor.policy.parameters() if not q.requires_grad)  # the base has none
    adam = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values() if v.dim())
    base = "frozen base fp32" if dtype == "float32" else "frozen base bf16"
    assert terms[base] == frozen
    assert terms["LoRA adapter fp32"] == adapter == grads == terms["adapter gradients fp32"]
    assert terms["adapter AdamW moments fp32"] == adam
    assert not {"reference fp32", "weights fp32", "autocast bf16 weights"} & set(terms)
    size = plan.DTYPE_BYTES[cfg.model.dtype]  # the demo's auto: bf16 or fp32, as this host computes
    stack = plan.plan_stack(cfg, device="cuda", device_bytes=80 * 2**30)
    assert stack.shm.bytes == 2 * adapter // 4 * size  # two slots of the adapter in model.dtype
    assert any(t.name == "LoRA slot" for t in stack.sampler.terms)
    # merge_on_sync auto merges on CPU: full weights travel and vLLM runs without LoRA.
    stack = plan.plan_stack(cfg, device="cpu", device_bytes=None)
    assert stack.shm.bytes == 2 * size * stack.model.params
    assert not any(t.name == "LoRA slot" for t in stack.sampler.terms)
