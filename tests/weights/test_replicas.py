"""Weight sync across real `dgrpo sampler` processes: two replicas (shm and tcp) that start after the first
publish, follow later ones, fence on versions over gRPC, agree with transformers in bf16, and leave no segments."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import torch
from support import ServiceProcess, free_port

from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import WeightPublisher

pytestmark = pytest.mark.slow
PROMPT = [1, 504, 3458, 281, 253, 1346, 30]


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


@pytest.fixture(scope="module")
def hf_model(weights_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(weights_model, dtype=torch.float32).eval()


class Learners:
    """The learner side for both replicas: a learner serves shm samplers (same host) or tcp ones, never the bytes of
    shared-memory slots over the network; these two publish the same versions."""

    def __init__(self):
        self.cfgs = {t: WeightSyncConfig(transport=t, host="127.0.0.1", bind_host="127.0.0.1",
                                         announce_port=free_port(), control_port=free_port()) for t in ("shm", "tcp")}
        self.pubs = {t: WeightPublisher(cfg, "replicas", dtype="bfloat16") for t, cfg in self.cfgs.items()}

    def segment_paths(self):
        return self.pubs["shm"].segment_paths

    def publish(self, named_tensors, version: int) -> None:
        for pub in self.pubs.values():
            pub.publish(named_tensors, version)

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()


@pytest.fixture(scope="module")
def stack(child_processes, weights_model, hf_model):
    """Learner-side publishers that have published v1, then two replicas started after it (shm and tcp)."""
    pub = Learners()
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    pub.publish(list(perturbed(base, 1).items()), 1)
    replicas = []
    for transport in ("shm", "tcp"):
        cfg = pub.cfgs[transport]
        port = free_port()
        replicas.append(ServiceProcess("sampler", [
            f"model.path={weights_model}", "model.dtype=bfloat16", f"sampler.port={port}", "sampler.host=127.0.0.1",
            "sampler.enforce_eager=true", "sampler.max_model_len=128", "sampler.max_num_seqs=4",
            "sampler.kv_cache_space_gib=1", f"sampler.replica_id={transport}", "sampler.shutdown_grace_s=1",
            f"weights.transport={transport}", "weights.host=127.0.0.1", f"weights.announce_port={cfg.announce_port}",
            f"weights.control_port={cfg.control_port}", "weights.catch_up_timeout_s=30",
            # shm: the direct reload (weights.reload=auto on vLLM-CPU); tcp: vLLM's layerwise reload
            f"weights.reload={'auto' if transport == 'shm' else 'layerwise'}",
        ], port))
    try:
        for r in replicas:
            r.wait_ready(timeout=400)
        channels = [grpc.insecure_channel(r.address) for r in replicas]
        yield pub, base, replicas, [sampler_pb2_grpc.SamplerStub(c) for c in channels]
        for c in channels:
            c.close()
    finally:
        for r in replicas:
            r.stop(timeout=60)
        pub.close()


def versions(stubs) -> list[int]:
    return [s.Info(pb.InfoRequest(), timeout=10).weight_version for s in stubs]


def test_replicas_started_after_a_publish_serve_it_from_the_start(stack):
    _, _, replicas, stubs = stack
    assert versions(stubs) == [1, 1]  # SERVING only after catching up
    assert "loaded weight version 1" in replicas[1].logs()  # the tcp replica fetched it


def test_each_replica_loads_with_the_reload_method_it_was_given(stack):
    _, _, replicas, _ = stack
    assert "load directly into kept checkpoint-format tensors" in replicas[0].logs()
    assert "layerwise reload (weights.reload=layerwise)" in replicas[1].logs()


def test_every_replica_reaches_a_new_version_and_matches_transformers_in_bf16(stack, hf_model):
    pub, base, _, stubs = stack
    weights = perturbed(base, 2)
    pub.publish(list(weights.items()), 2)
    deadline = time.monotonic() + 60
    while versions(stubs) != [2, 2] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert versions(stubs) == [2, 2]

    hf_model.load_state_dict(weights)  # the learner's fp32 weights; the replicas run their bf16 cast
    for stub in stubs:
        request = pb.GenerateRequest(prompts=[pb.Prompt(id="p", token_ids=pb.TokenIds(ids=PROMPT))],
                                     sampling=pb.SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=0))
        (group,) = list(stub.Generate(request, timeout=120))
        for c in group.completions:
            assert c.weight_version == 2
            ids = torch.tensor([PROMPT + list(c.token_ids)])
            with torch.no_grad():
                logits = hf_model(ids).logits[0, len(PROMPT) - 1:-1].float()
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(list(c.token_ids))[:, None])[:, 0]
            assert (torch.tensor(list(c.logprobs)) - expected).abs().mean() <= 0.02


def test_min_weight_version_not_reached_answers_deadline_exceeded(stack):
    _, _, _, stubs = stack
    request = pb.GenerateRequest(prompts=[pb.Prompt(id="p", token_ids=pb.TokenIds(ids=PROMPT))],
                                 sampling=pb.SamplingParams(n=1, max_tokens=2), min_weight_version=99,
                                 weight_wait_timeout_s=0.3)
    with pytest.raises(grpc.RpcError) as err:
        list(stubs[0].Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "min_weight_version=99" in err.value.details()


def test_no_shared_memory_left_after_shutdown(stack, segments_of):
    pub, _, replicas, _ = stack
    assert len(segments_of(replicas[1].proc.pid)) == 1  # the tcp replica's staging copy
    for r in replicas:  # SIGTERM both first: their shutdowns overlap
        r.proc.send_signal(signal.SIGTERM)
    for r in replicas:
        r.stop(timeout=60)
        assert segments_of(r.proc.pid) == [], r.logs()[-3000:]
    paths = pub.segment_paths()
    assert all(p.exists() for p in paths)
    pub.close()
    assert not any(p.exists() for p in paths)
