"""Adapter-only weight sync into a real vLLM engine with LoRA (CPU, tiny fp32 model) from a real PEFT learner.

The learner trains real GRPO steps on completions the engine sampled, publishes only its adapter through the shared
memory channel, and the engine loads each version in place: its logprobs then equal the learner's for the same
tokens, differ from the base model's, and a later version replaces the earlier one under the same LoRA id.
"""

from __future__ import annotations

import time

import pytest
import torch

from dgrpo.weights.config import LoraConfig
from dgrpo.weights.publisher import WeightPublisher

pytestmark = pytest.mark.slow
pytest.importorskip("peft")
PROMPTS = [[1, 504, 3094, 28, 2730, 314, 253, 1345, 30, 378, 2093, 314, 216, 33, 32, 4138, 17, 2],
           [1, 504, 3094, 28, 4138, 17, 2, 216, 35, 33]]
LORA = LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                  merge_on_sync=False)  # adapter-only sync (auto merges on CPU)
FP32_ATOL = 2e-3
"""Sampler vs learner logprobs, both in fp32 (test_engine_sync.py's bound for completions under a version)."""


@pytest.fixture(scope="module")
def engine(weights_model, start_engine):
    eng = start_engine(weights_model, max_num_seqs=8, lora=LORA)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def synced(engine, aio, weights_model, sync_cfg_module):
    """A publisher (fp32, like the engine) and a started adapter-following subscriber."""
    from dgrpo.sampler.lora_target import LoraWeightTarget
    from dgrpo.weights.subscriber import WeightSubscriber, checkpoint_shapes

    cfg = sync_cfg_module
    pub = WeightPublisher(cfg, "lora-test", dtype="float32")
    target = LoraWeightTarget(engine, cfg)
    subscriber = WeightSubscriber(cfg, target, checkpoint_shapes(weights_model), adapters=True)
    aio.run(subscriber.start())
    yield pub, subscriber
    aio.run(subscriber.stop())
    pub.close()


@pytest.fixture(scope="module")
def sync_cfg_module():
    from support import free_port

    from dgrpo.weights.config import WeightSyncConfig

    return WeightSyncConfig(host="127.0.0.1", bind_host="127.0.0.1", announce_port=free_port(),
                            control_port=free_port())


@pytest.fixture(scope="module")
def actor(weights_model):
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig

    torch.manual_seed(0)
    return Actor(weights_model, ActorConfig(ppo_mini_batch_size=2, micro_batch_size_per_device=8, dtype="float32"),
                 OptimConfig(lr=3e-2), AlgorithmConfig(beta=0.05), total_steps=20, max_response_length=16,
                 lora=LORA)


async def sample(engine, seed: int, n: int = 4):
    from dgrpo.sampler.requests import PromptInput, SamplingRequest

    prompts = [PromptInput(id=f"p{seed}-{i}", token_ids=ids) for i, ids in enumerate(PROMPTS)]
    groups = [g async for g in engine.generate(prompts, SamplingRequest(n=n, max_tokens=16, seed=seed))]
    return sorted(groups, key=lambda g: g.prompt_id)


def sequences(groups):
    """Learner sequences of sampled groups, rewarded for even token ids (any fixed reward moves the policy)."""
    from dgrpo.learner.update import grpo
    from dgrpo.learner.update.batch import Sequence

    comps = [(g, c) for g in groups for c in g.completions]
    rewards = torch.tensor([sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1) for _, c in comps])
    adv = grpo.group_advantages(rewards, len(groups[0].completions), "group", 1e-6)
    return [Sequence(list(g.prompt_token_ids), list(c.token_ids), a, list(c.logprobs), truncated=False)
            for (g, c), a in zip(comps, adv.tolist(), strict=True)]


def train_and_publish(aio, engine, actor, pub, subscriber, version: int, steps: int = 2) -> None:
    for step in range(steps):
        actor.update(sequences(aio.run(sample(engine, seed=100 * version + step))), group_size=4)
    named = list(actor.named_weights(torch.float32))
    pub.publish(named, version, layout=actor.weight_layout(), adapter_config=actor.adapter_config())
    aio.run(engine.wait_for_version(version, 60), timeout=90)
    deadline = time.monotonic() + 30  # the load's bookkeeping (resume, stats) ends just after the version is set
    while (subscriber.last_stats is None or subscriber.last_stats.version != version) and time.monotonic() < deadline:
        time.sleep(0.01)


def gap(engine_seqs, learner_logps) -> float:
    return max((torch.tensor(s.sampler_logprobs) - lp).abs().max().item()
               for s, lp in zip(engine_seqs, learner_logps, strict=True))


def test_adapter_versions_serve_the_learners_policy_and_replace_in_place(engine, aio, synced, actor):
    pub, subscriber = synced
    assert engine.weight_version == 0 and engine.lora_request is None  # version 0: the base model

    base_seqs = sequences(aio.run(sample(engine, seed=1)))
    assert gap(base_seqs, actor.compute_logprobs(base_seqs)) < FP32_ATOL  # a fresh adapter (B = 0) is the base

    adapters = {}
    for version in (1, 2):
        train_and_publish(aio, engine, actor, pub, subscriber, version)
        assert engine.weight_version == version and subscriber.last_stats.version == version
        assert set(aio.run(engine.llm.list_loras())) == {1}  # one adapter, replaced in place under the same id
        seqs = sequences(aio.run(sample(engine, seed=version)))
        policy, base = actor.compute_logprobs(seqs), actor.compute_logprobs(seqs, reference=True)
        # The sampler's logprobs under adapter v are the learner's, and far from the base model's.
        assert gap(seqs, policy) < FP32_ATOL, f"version {version}: sampler and learner disagree"
        assert gap(seqs, base) > 50 * FP32_ATOL, f"version {version}: the adapter changes nothing"
        adapters[version] = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
    # Version 2 replaced version 1: what the engine samples now is far from version 1's adapter.
    actor.policy.load_state_dict(adapters[1], strict=False)
    try:
        assert gap(seqs, actor.compute_logprobs(seqs)) > 50 * FP32_ATOL
    finally:
        actor.policy.load_state_dict(adapters[2], strict=False)
    assert len(list(subscriber.target.root.iterdir())) == 1  # the adapter folder of version 1 is gone


def test_full_weights_are_refused_by_an_adapter_replica(engine, aio, synced, weights_model):
    """A learner publishing full weights (LoRA off, or merge_on_sync) to a replica serving adapters: refused, named,
    and the replica keeps its adapter."""
    from dgrpo.weights.subscriber import checkpoint_shapes

    pub, subscriber = synced
    before = engine.weight_version
    shapes = checkpoint_shapes(weights_model)
    pub.publish([(n, torch.zeros(s)) for n, s in shapes.items() if n != "lm_head.weight"], before + 1)
    assert not aio.run(subscriber.load(pub.latest))
    assert engine.weight_version == before
    assert "is full weights; this replica serves LoRA adapters" in subscriber.rejected[-1]
