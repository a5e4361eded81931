"""The GRPO loop with learner.lora against real services in their own processes: a vLLM sampler serving adapters
(tiny fp32 model, CPU), a rewarder, a LoRA learner, the shared-memory weight channel.

Each step publishes only the adapter; the sampler's logprobs of the tokens the learner trains on equal the learner's
own (`actor/sampler_logp_diff`, both fp32), so the replica really serves the learner's adapter version.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from loop_support import fixed_port, read_jsonl, sampler_info, start_rewarder
from support import ServiceProcess, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("peft")
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"],
        "merge_on_sync": False}  # adapter-only sync: auto merges on CPU (test_merge_on_sync_auto_merges_on_cpu_only)


def test_lora_run_publishes_adapters_the_sampler_serves(child_processes, tiny_model, tmp_path):
    announce, control = fixed_port(), fixed_port()
    port = free_port()
    root = tmp_path
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "sampler": {"addresses": [f"127.0.0.1:{port}"], "max_model_len": 512, "enforce_eager": True,
                    "host": "127.0.0.1", "port": port, "shutdown_grace_s": 1},
        "weights": {"announce_port": announce, "control_port": control},
        "learner": {
            "data": {"train_files": [str(root / "train.jsonl")], "train_batch_size": 2, "max_prompt_length": 64},
            "rollout": {"n": 4, "max_response_length": 16, "seed": 3},
            "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 8, "dtype": "float32"},
            "optim": {"lr": 5e-2},
            "algorithm": {"beta": 0.05},
            "lora": LORA,
            "checkpoint": {"dir": str(root / "ckpt"), "save_freq": 3, "export_dir": str(root / "export")},
            "trainer": {"total_training_steps": 3, "control_port": 0, "log_dir": str(root / "runs"), "run_name": "l"},
        },
    }
    (root / "stack.yaml").write_text(yaml.safe_dump(config))
    # The sampler reads learner.lora from the same stack file: it starts vLLM with LoRA (max_lora_rank 8).
    sampler = ServiceProcess("sampler", ["--config", str(root / "stack.yaml")], port)
    rewarder = start_rewarder(free_port())
    try:
        for svc in (rewarder, sampler):
            svc.wait_ready(timeout=400)
        cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(root / "stack.yaml"),
               f"learner.rollout.rewarder_address={rewarder.address}"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert sampler_info(sampler.address).weight_version == 3
        logs = sampler.logs()
    finally:
        for svc in (rewarder, sampler):
            svc.stop(timeout=30)
    steps = [r for r in read_jsonl(root / "runs" / "l" / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # Only the adapter travels: 4 modules x 2 layers x (A + B) at rank 8, fp32, about 50 kB, not the model's MBs.
    checkpointed = torch.load(root / "ckpt" / "step_3" / "model.pt", weights_only=True)  # the adapter alone too
    assert all(".lora_" in name for name in checkpointed)
    adapter_bytes = sum(t.numel() * 4 for t in checkpointed.values())
    assert all(r["weights/publish_bytes"] < adapter_bytes + 20_000 for r in steps)  # + header and manifest
    # Steps 2 and 3 sampled from adapter versions 1 and 2: the sampler's logprobs are the learner's.
    assert all(r["actor/sampler_logp_diff"] < 2e-3 for r in steps), [r["actor/sampler_logp_diff"] for r in steps]
    assert all(r["rollout/stale_completions"] == 0 for r in steps)
    assert steps[-1]["actor/kl"] > 0  # the policy left the base model, which the reference (adapter off) still is
    assert "loaded weight version 3" in logs
    assert (root / "export" / "adapter_config.json").is_file()
