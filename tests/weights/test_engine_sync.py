"""Weight sync into a real vLLM engine (CPU, tiny fp32 model) in this process, against transformers.

One engine serves the whole module (engine start dominates the cost); tests publish increasing versions.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from dgrpo.weights.protocol import Announcement
from dgrpo.weights.publisher import WeightPublisher

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3094, 28, 2730, 314, 253, 1345, 30, 378, 2093, 314, 216, 33, 32, 4138, 17, 2]


@pytest.fixture(scope="module")
def engine(weights_model, start_engine):
    eng = start_engine(weights_model, max_num_seqs=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(weights_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(weights_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def original(hf_model):
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def versions():
    """Versions published into the module's engine only increase: take the next one."""
    counter = iter(range(1, 1000))
    return lambda: next(counter)


async def prompt_logprobs(engine, ids=PROMPT) -> torch.Tensor:
    """vLLM's logprob of every prompt token given the tokens before it."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    final = None
    async for out in engine.llm.generate({"prompt_token_ids": ids}, params, f"plp-{os.urandom(4).hex()}"):
        final = out
    return torch.tensor([pos[t].logprob for pos, t in zip(final.prompt_logprobs[1:], ids[1:], strict=True)])


def reference_logprobs(model, weights: dict[str, torch.Tensor], ids=PROMPT) -> torch.Tensor:
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


def follow(aio, engine, cfg, weights_model):
    """A started subscriber loading into `engine` through vLLM's weight-transfer contract."""
    from dgrpo.sampler.weight_target import EngineWeightTarget
    from dgrpo.weights.subscriber import WeightSubscriber, checkpoint_shapes

    target = EngineWeightTarget(engine, cfg)
    aio.run(target.start())
    subscriber = WeightSubscriber(cfg, target, checkpoint_shapes(weights_model))
    aio.run(subscriber.start())
    return subscriber


@pytest.fixture(scope="module")
def synced(engine, aio, weights_model):
    """A publisher (fp32, like the engine) and a started subscriber following it."""
    from support import free_port

    from dgrpo.weights.config import WeightSyncConfig

    cfg = WeightSyncConfig(host="127.0.0.1", bind_host="127.0.0.1", announce_port=free_port(),
                           control_port=free_port())
    pub = WeightPublisher(cfg, "engine-test", dtype="float32")
    loader = follow(aio, engine, cfg, weights_model)
    yield pub, loader
    aio.run(loader.stop())
    pub.close()


def publish_and_wait(aio, engine, pub, weights: dict, version: int):
    pub.publish(weights.items(), version)
    aio.run(engine.wait_for_version(version, 60), timeout=90)


def test_logprobs_match_transformers_after_publish_and_restore_exactly(engine, aio, synced, hf_model, original,
                                                                       versions):
    pub, loader = synced
    before = aio.run(prompt_logprobs(engine))
    torch.testing.assert_close(before, reference_logprobs(hf_model, original), atol=1e-4, rtol=0)

    changed = perturbed(original, seed=1)
    v = versions()
    publish_and_wait(aio, engine, pub, changed, v)
    after = aio.run(prompt_logprobs(engine))
    assert engine.weight_version == v and loader.last_stats.version == v
    assert loader.last_stats.streamed  # shm + a sized publish: loaded while the learner wrote it
    assert (after - before).abs().max() > 0.05  # the new weights are really in use
    torch.testing.assert_close(after, reference_logprobs(hf_model, changed), atol=1e-4, rtol=0)

    publish_and_wait(aio, engine, pub, original, versions())
    assert torch.equal(aio.run(prompt_logprobs(engine)), before)  # bit-exact restore


def test_tied_output_layer_follows_every_version(engine, aio, synced, hf_model, original, versions):
    """A tied model's embedding is published once (the learner's named_parameters drops the lm_head alias): the
    sampler's output layer must follow it on every version, not keep the weights it started with."""
    pub, _ = synced
    names = [n for n, _ in hf_model.named_parameters()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    for seed in (11, 12):  # the second reload too: the first one may still find the tie intact
        changed = perturbed({k: original[k] for k in names}, seed=seed)
        publish_and_wait(aio, engine, pub, changed, versions())
        full = {**changed, "lm_head.weight": changed["model.embed_tokens.weight"]}
        torch.testing.assert_close(aio.run(prompt_logprobs(engine)), reference_logprobs(hf_model, full),
                                   atol=1e-4, rtol=0)
    publish_and_wait(aio, engine, pub, original, versions())


def test_direct_and_layerwise_reloads_load_the_same_weights_bit_for_bit(engine, aio, synced, hf_model, original,
                                                                        versions):
    """weights.reload=auto takes the direct reload on vLLM-CPU (sampler/cpu_reload.py); layerwise is vLLM's own.
    The same version through either gives the same logprobs to the last bit, and both follow transformers. (Which
    method a worker took is in its log: test_replicas.py checks it on real sampler processes.)"""
    pub, loader = synced
    changed = perturbed(original, seed=21)
    got = {}
    try:
        for method in ("layerwise", "auto"):
            loader.target.reload = method  # init_weight_transfer_engine again: the workers switch their method
            aio.run(loader.target.start())
            publish_and_wait(aio, engine, pub, original, versions())
            publish_and_wait(aio, engine, pub, changed, versions())
            got[method] = aio.run(prompt_logprobs(engine))
    finally:
        loader.target.reload = "auto"
        aio.run(loader.target.start())
    assert torch.equal(got["auto"], got["layerwise"])
    torch.testing.assert_close(got["auto"], reference_logprobs(hf_model, changed), atol=1e-4, rtol=0)
    publish_and_wait(aio, engine, pub, original, versions())


def test_torn_version_is_rejected_and_the_old_one_keeps_serving(engine, aio, synced, original, versions):
    """Force the race end to end: a lagging replica is told to load a slot the learner is rewriting."""
    pub, loader = synced
    stale_weights, current = perturbed(original, seed=2), perturbed(original, seed=3)
    v_stale, v_current = versions(), versions()
    pub.publish(stale_weights.items(), v_stale)
    stale = pub.latest
    publish_and_wait(aio, engine, pub, current, v_current)
    serving = aio.run(prompt_logprobs(engine))

    half_written, release = threading.Event(), threading.Event()

    def slow():
        for i, item in enumerate(perturbed(original, seed=4).items()):
            if i == 3:
                half_written.set()
                release.wait(30)
            yield item

    v_next = versions()
    writer = threading.Thread(target=pub.publish, args=(slow(), v_next))  # rewrites the stale version's slot
    writer.start()
    try:
        assert half_written.wait(30)
        stale_again = Announcement()
        stale_again.CopyFrom(stale)
        stale_again.version = v_current + 1000  # looks newer than what the replica has
        assert aio.run(loader.load(stale_again)) is False
        assert "torn read" in loader.rejected[-1] or "overwritten" in loader.rejected[-1]
        assert engine.weight_version == v_current
        assert torch.equal(aio.run(prompt_logprobs(engine)), serving)
    finally:
        release.set()
        writer.join(30)
    aio.run(engine.wait_for_version(v_next, 60), timeout=90)  # the completed write is announced and loads


def test_checksum_mismatch_is_rejected(engine, aio, synced, original, versions):
    pub, loader = synced
    v_good = versions()
    publish_and_wait(aio, engine, pub, perturbed(original, seed=5), v_good)
    serving = aio.run(prompt_logprobs(engine))
    path = pub.segment_paths[1 - pub.latest.slot]  # the slot the next version goes to
    corrupt = list(perturbed(original, seed=6).items())

    def corrupted_after_checksum():  # bytes change after their checksum was taken (a stray write, bad DMA)
        yield corrupt[0]
        with open(path, "r+b") as f:  # the first tensor starts right after the header
            f.seek(4096 + 8)
            f.write(b"\xff\xff\xff\x7f")
        yield from corrupt[1:]

    v_bad = versions()
    pub.publish(corrupted_after_checksum(), v_bad)
    aio.run(loader.load(pub.latest))  # waits for the loader's own attempt (same lock), then tries again
    assert engine.weight_version == v_good
    assert f"checksum mismatch in {corrupt[0][0]}" in loader.rejected[-1]
    assert torch.equal(aio.run(prompt_logprobs(engine)), serving)


def test_min_weight_version_fences_generation(engine, aio, synced, original, versions):
    from dgrpo.sampler.engine import WeightVersionTimeout
    from dgrpo.sampler.requests import PromptInput, SamplingRequest

    pub, _ = synced
    target = versions()

    async def fenced(timeout_s: float):
        groups = []
        async for g in engine.generate([PromptInput(id="p", token_ids=PROMPT)], SamplingRequest(n=2, max_tokens=4),
                                       min_weight_version=target, weight_wait_timeout_s=timeout_s):
            groups.append(g)
        return groups

    with pytest.raises(WeightVersionTimeout):
        aio.run(fenced(0.5))
    waiting = asyncio.run_coroutine_threadsafe(fenced(60), aio.loop)
    assert not waiting.done()
    pub.publish(perturbed(original, seed=7).items(), target)
    groups = waiting.result(90)
    assert [c.weight_version for c in groups[0].completions] == [target, target]


def completion_logprobs(model, weights: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """transformers' logprob of each completion token after PROMPT, under `weights`."""
    ids = PROMPT + token_ids
    return reference_logprobs(model, weights, ids)[len(PROMPT) - 1:]


def test_wait_mode_completions_come_from_the_version_they_name(engine, aio, synced, hf_model, original, versions):
    """weights.pause_mode=wait (the default): requests running when a version is published finish on the old
    weights during the pause, and every completion's weight_version is the version that produced each of its
    tokens (its logprobs checked against transformers under that version)."""
    from dgrpo.sampler.requests import PromptInput, SamplingRequest

    pub, _ = synced
    old, new = versions(), versions()
    weights = {old: perturbed(original, seed=31), new: perturbed(original, seed=32)}
    publish_and_wait(aio, engine, pub, weights[old], old)

    async def sample(tag: str, max_tokens: int) -> list[tuple[float, object]]:
        prompts = [PromptInput(id=f"{tag}-{i}", token_ids=PROMPT) for i in range(2)]
        groups = engine.generate(prompts, SamplingRequest(max_tokens=max_tokens))
        return [(time.perf_counter(), c) async for group in groups for c in group.completions]

    in_flight = asyncio.run_coroutine_threadsafe(sample("long", 100), aio.loop)  # 18 + 100 of 128 tokens
    def running() -> bool:  # both scheduled and past their prefill: each has its first token, far from its 100th
        states = list(engine.llm.output_processor.request_states.values())
        return len(states) >= 2 and not any(state.is_prefilling for state in states)

    deadline = time.monotonic() + 60
    while not running():
        assert time.monotonic() < deadline, "the two long requests never started generating"
        time.sleep(0.002)
    published_at = time.perf_counter()
    publish_and_wait(aio, engine, pub, weights[new], new)
    long_ones = in_flight.result(60)
    after = aio.run(sample("after", 24))

    # A request already running when the pause began finishes on the old weights; one the scheduler had not
    # started yet waits for the new ones. Either way its weight_version is the one that produced its tokens.
    assert all((c.first_weight_version, c.finish_reason) == (old, "length") for _, c in long_ones)
    assert any(c.weight_version == old and when > published_at for when, c in long_ones)
    assert [c.weight_version for _, c in after] == [new, new]
    for _, c in long_ones + after:
        torch.testing.assert_close(torch.tensor(c.logprobs), completion_logprobs(hf_model, weights[c.weight_version],
                                                                                 c.token_ids), atol=2e-3, rtol=0)
    publish_and_wait(aio, engine, pub, original, versions())


def test_manifest_not_matching_the_checkpoint_is_rejected(engine, aio, synced, original, versions):
    pub, loader = synced
    version_before = engine.weight_version
    pub.publish([("model.layers.0.mlp.gate_proj.weight", torch.zeros(3, 3))], versions())
    aio.run(loader.load(pub.latest))
    assert engine.weight_version == version_before
    assert "shape [3, 3]" in loader.rejected[-1]


def test_tcp_transport_loads_through_the_same_path(engine, aio, weights_model, hf_model, original, versions,
                                                   sync_cfg, segments_of):
    cfg = sync_cfg(transport="tcp")
    with WeightPublisher(cfg, "engine-tcp", dtype="float32") as pub:
        weights = perturbed(original, seed=8)
        v = versions()
        pub.publish(weights.items(), v)
        assert pub.segment_paths == []  # tcp: the learner's slots live in its own memory
        loader = follow(aio, engine, cfg, weights_model)  # catches up over tcp: fetch -> staging segment -> workers
        try:
            assert engine.weight_version == v and loader.last_stats.fetch_s > 0
            staging = [n for n in segments_of(os.getpid()) if n.startswith("dgrpo-r-")]
            assert len(staging) == 1  # the sampler's local copy of the fetched slot
            torch.testing.assert_close(aio.run(prompt_logprobs(engine)), reference_logprobs(hf_model, weights),
                                       atol=1e-4, rtol=0)
        finally:
            aio.run(loader.stop())
        assert [n for n in segments_of(os.getpid()) if n.startswith("dgrpo-r-")] == []
