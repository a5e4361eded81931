"""Multi-turn rollouts with the real engine (vLLM CPU, the bundled SmolLM2-135M-Instruct in fp32) and the real tool
sandbox: one engine for the module, run in-process on its own event loop thread so the tests can read what the engine
consumed (SteeredEngine.turn_log) and reach it over real gRPC too.

The 135M model does not call a tool on its own at greedy, so the tests force the first turn(s) to be a call with
vLLM's structured outputs (SteeredEngine.turn_regex, a regex over the turn's text); the turns after the tool result are
the model's own."""

from __future__ import annotations

import os

import grpc
import pytest
import torch
import yaml
from support import LoopThread

from dgrpo.sampler.config import SamplerConfig
from dgrpo.sampler.convert import completion_to_pb, multi_turn_from_pb
from dgrpo.sampler.engine import SamplerEngine
from dgrpo.sampler.multi_turn import ToolsUnavailable
from dgrpo.sampler.requests import MultiTurnRequest, PromptInput, SamplingRequest
from dgrpo.sampler.results import CompletionResult, Message, TurnStats
from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc

MAX_MODEL_LEN = 1024
CALL = r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "4821 \* 3977"\}\}\n</tool_call>'
SLEEP = r'<tool_call>\n\{"name": "sleepy", "arguments": \{\}\}\n</tool_call>'
QUESTION = [("user", "What is 4821 * 3977? Use the calculator.")]


def test_completion_holds_what_the_learner_reads(tools_file):
    c = CompletionResult([5, 6, 7, 8], [-0.5, 0.0, 0.0, -1.25], "408", "stop", 3, 2, mask=[1, 0, 0, 1],
                         messages=[Message("assistant", "", [("calculator", '{"expression": "12*34"}')]),
                                   Message("tool", "408", name="calculator"), Message("assistant", "408")],
                         turn_stats=TurnStats(2, 1, 0, 0, 0.25, "answer"))
    sent = completion_to_pb(c)
    assert (list(sent.token_ids), list(sent.logprobs), list(sent.mask)) == (c.token_ids, c.logprobs, c.mask)
    assert [(m.role, m.content, m.name, [(t.name, t.arguments) for t in m.tool_calls]) for m in sent.messages] == \
        [(m.role, m.content, m.name, m.tool_calls) for m in c.messages]
    s = sent.turn_stats
    assert TurnStats(s.turns, s.tool_calls, s.tool_errors, s.tool_timeouts, s.tool_seconds, s.ended_by) == c.turn_stats
    plain = completion_to_pb(CompletionResult([1], [-1.0], "x", "length", 0, 0))  # single-turn: nothing new sent
    assert not plain.HasField("turn_stats") and not plain.mask and not plain.messages
    # The learner's request (learner/rollout/client.py, the builder that ships) reads back as the engine's limits.
    from dgrpo.learner.rollout.client import multi_turn_request
    from dgrpo.tools.config import MultiTurnConfig
    from dgrpo.tools.spec import load_tool_config

    cfg = MultiTurnConfig(enable=True, max_assistant_turns=3, max_tool_calls=2, max_response_length=100,
                          max_tool_response_length=50, tool_config_path=str(tools_file))
    assert multi_turn_from_pb(pb.GenerateRequest(multi_turn=multi_turn_request(cfg))) == \
        MultiTurnRequest(3, 2, 100, 50, load_tool_config(tools_file).digest)
    assert multi_turn_from_pb(pb.GenerateRequest()) is None
    assert multi_turn_from_pb(pb.GenerateRequest(multi_turn=pb.MultiTurn(enable=False))) is None


class SteeredEngine(SamplerEngine):
    """The real engine, with what only tests need: `turn_regex` (turn index -> a regex the turn's text must match,
    through vLLM's structured outputs) and `turn_log` (every turn's output, in order)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn_regex: dict[int, str] = {}
        self.turn_log: list = []
        self._turn: int | None = None

    async def run_turn(self, request_id, ids, sampling, max_tokens, seed, turn):
        self._turn = turn  # read by _vllm_params, which run_turn calls before its first await
        out = await super().run_turn(request_id, ids, sampling, max_tokens, seed, turn)
        self.turn_log.append(out)
        return out

    def _vllm_params(self, s, **kwargs):
        params = super()._vllm_params(s, **kwargs)
        turn, self._turn = self._turn, None
        if turn in self.turn_regex:
            from vllm.sampling_params import StructuredOutputsParams

            params.structured_outputs = StructuredOutputsParams(regex=self.turn_regex[turn])
        return params


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "slow.py").write_text("import time\n\ndef sleepy():\n    time.sleep(1e9)\n")
    (folder / "tools.yaml").write_text(yaml.safe_dump({"tools": [
        {"class_name": "calculator"},
        {"class_name": "file:slow.py:sleepy", "tool_schema": {"type": "function", "function": {
            "name": "sleepy", "description": "never returns", "parameters": {"type": "object", "properties": {}}}}},
    ]}))
    return folder / "tools.yaml"


@pytest.fixture(scope="module")
def rig(child_processes, bundled_model, tools_file):
    from dgrpo.common import devices
    from dgrpo.common.model_config import ModelConfig
    from dgrpo.tools.config import MultiTurnConfig

    os.environ.update({**devices.sampler_env("cpu"), "VLLM_CPU_KVCACHE_SPACE": "1",
                       **devices.cpu_thread_binding("all")})
    from dgrpo.sampler.metrics import SamplerMetrics
    from dgrpo.sampler.server import create_server

    lt = LoopThread(timeout=300)
    cfg = SamplerConfig(port=0, max_model_len=MAX_MODEL_LEN, enforce_eager=True, max_num_seqs=16)
    mt = MultiTurnConfig(enable=True, tool_config_path=str(tools_file), tool_timeout_s=1.0, max_tool_response_length=64)

    async def start():
        engine = SteeredEngine.create(ModelConfig(path=str(bundled_model), dtype="float32"), cfg, str(bundled_model),
                                      "cpu")
        engine.enable_tools(mt)
        server, servicer = create_server(cfg)
        await server.start()
        servicer.attach(engine, "mt-test", SamplerMetrics("mt-test"))
        await server.set_serving(True)
        return engine, server

    engine, server = lt.run(start(), timeout=600)
    lt.engine, lt.server = engine, server
    yield lt

    async def stop():
        await server.stop(0)
        engine.shutdown()

    lt.run(stop(), timeout=60)
    lt.close()


def sample(rig, prompts, sampling: SamplingRequest, req: MultiTurnRequest, regex: dict[int, str]):
    async def go():
        rig.engine.turn_regex = regex
        rig.engine.turn_log.clear()
        try:
            return [g async for g in rig.engine.generate(prompts, sampling, multi_turn=req)]
        finally:
            rig.engine.turn_regex = {}

    groups = rig.run(go())
    return groups, list(rig.engine.turn_log)


def request(rig, **kw) -> MultiTurnRequest:
    kw.setdefault("max_assistant_turns", 3)
    kw.setdefault("max_tool_calls", 4)
    return MultiTurnRequest(tool_config_digest=rig.engine.tools.digest, **kw)


def test_a_call_is_run_and_its_result_is_the_next_turns_input(rig, bundled_model):
    greedy = SamplingRequest(n=1, temperature=0.0, max_tokens=200)
    (group,), turns = sample(rig, [PromptInput("q", chat=QUESTION)], greedy, request(rig), {0: CALL})
    c = group.completions[0]
    tok = rig.engine.tokenizer
    # the tools reached the first prompt (Hermes system message: SmolLM2's template ignores tools=)
    assert not rig.engine.tools.template.native_tools
    assert '"name": "calculator"' in tok.decode(group.prompt_token_ids)
    assert c.turn_stats.turns == len(turns) >= 2 and c.turn_stats.tool_calls == 1 and c.turn_stats.tool_errors == 0
    assert c.messages[0].tool_calls == [("calculator", '{"expression": "4821 * 3977"}')]
    assert c.messages[1] == Message("tool", str(4821 * 3977), name="calculator")
    assert c.turn_stats.tool_seconds > 0
    # Token in, token out: every turn's engine input is the prompt + everything before it, and the trajectory is the
    # concatenation of the model's turns (mask 1, verbatim) and the tool blocks (mask 0) — no re-tokenization.
    assert len(c.mask) == len(c.token_ids) == len(c.logprobs)
    pos = 0
    for t in turns:
        assert t.prompt_token_ids == group.prompt_token_ids + c.token_ids[:pos]
        assert c.token_ids[pos:pos + len(t.token_ids)] == t.token_ids
        assert c.mask[pos:pos + len(t.token_ids)] == [1] * len(t.token_ids)
        pos += len(t.token_ids)
        block = []
        while pos < len(c.mask) and c.mask[pos] == 0:
            block.append(c.token_ids[pos])
            pos += 1
        if block:
            assert all(lp == 0.0 for lp in c.logprobs[pos - len(block):pos])
            assert tok.decode(block) == f"\n<|im_start|>tool\n{4821 * 3977}<|im_end|>\n<|im_start|>assistant\n"
    assert pos == len(c.token_ids) and sum(c.mask) == sum(len(t.token_ids) for t in turns)
    assert turns[0].token_ids[-1] == tok.eos_token_id  # the forced call ended its turn with EOS
    assert c.text == c.messages[-1].content and c.messages[-1].role == "assistant"
    # The engine's logprobs of the model's own (unconstrained) turn match the learner-side model on the same ids.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_model, torch_dtype=torch.float32)
    ids = torch.tensor([group.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [L, V]
    p = len(group.prompt_token_ids)
    start = c.mask.index(1, len(turns[0].token_ids))  # first token of the second (unconstrained) turn
    mine = [logp[p + k - 1, c.token_ids[k]].item() for k in range(start, len(c.token_ids)) if c.mask[k]]
    theirs = [c.logprobs[k] for k in range(start, len(c.token_ids)) if c.mask[k]]
    assert len(mine) >= 1
    assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) < 0.05, list(zip(mine, theirs, strict=True))


def test_limits_hold(rig):
    greedy = SamplingRequest(n=1, temperature=0.0, max_tokens=200)
    prompt = [PromptInput("q", chat=QUESTION)]
    # One assistant turn: the call is not run.
    (g,), turns = sample(rig, prompt, greedy, request(rig, max_assistant_turns=1), {0: CALL})
    s = g.completions[0].turn_stats
    assert (s.turns, s.tool_calls, s.ended_by, len(turns)) == (1, 0, "max_assistant_turns", 1)
    assert g.completions[0].mask == [1] * len(g.completions[0].token_ids)
    # One tool call per sample: a second forced call ends the conversation unrun.
    (g,), turns = sample(rig, prompt, greedy, request(rig, max_tool_calls=1), {0: CALL, 1: CALL})
    s = g.completions[0].turn_stats
    assert (s.turns, s.tool_calls, s.ended_by) == (2, 1, "max_tool_calls")
    # A total token budget across turns, tool tokens included.
    (g,), _ = sample(rig, prompt, greedy, request(rig, max_response_length=48), {0: CALL})
    c = g.completions[0]
    assert len(c.token_ids) <= 48 and c.turn_stats.ended_by == "max_response_length" and c.finish_reason == "length"


def test_a_hung_tool_times_out_into_the_conversation_and_samples_run_concurrently(rig):
    """A tool that sleeps forever (limit 1 s) becomes an error tool message; four samples of a group run their hung
    calls at once (well under 4 s in tools' wall time, though their summed tool time is >= 4 s)."""
    import time

    sampling = SamplingRequest(n=4, temperature=1.0, max_tokens=64, seed=3)
    t0 = time.monotonic()
    (g,), _ = sample(rig, [PromptInput("q", chat=QUESTION)], sampling,
                     request(rig, max_assistant_turns=2), {0: SLEEP})
    wall = time.monotonic() - t0
    for c in g.completions:
        assert (c.turn_stats.tool_calls, c.turn_stats.tool_timeouts, c.turn_stats.tool_errors) == (1, 1, 1)
        assert c.messages[1].role == "tool" and "time" in c.messages[1].content.lower()
        assert c.turn_stats.turns == 2
    assert sum(c.turn_stats.tool_seconds for c in g.completions) >= 4.0
    assert wall < 4.0 + 30, wall  # not four timeouts in a row plus generation (generous: a loaded 2-core machine)


def test_grpc_multi_turn_and_refusals(rig):
    stub_channel = grpc.insecure_channel(f"127.0.0.1:{rig.server.port}")
    stub = sampler_pb2_grpc.SamplerStub(stub_channel)
    prompt = pb.Prompt(id="a", chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")]))
    sampling = pb.SamplingParams(n=2, max_tokens=16, temperature=1.0)
    good = pb.MultiTurn(enable=True, max_assistant_turns=2, max_tool_calls=1,
                        tool_config_digest=rig.engine.tools.digest)
    request = pb.GenerateRequest(prompts=[prompt], sampling=sampling, multi_turn=good)
    (group,) = list(stub.Generate(request, timeout=300))
    for c in group.completions:
        assert c.HasField("turn_stats") and len(c.mask) == len(c.token_ids) and c.messages[0].role == "assistant"
    bad = pb.MultiTurn(enable=True, max_assistant_turns=2, max_tool_calls=1, tool_config_digest="0" * 64)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompts=[prompt], sampling=sampling, multi_turn=bad), timeout=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "tool_config_digest" in e.value.details()
    stub_channel.close()
    # A replica without tools refuses too.
    tools, rig.engine.tools = rig.engine.tools, None
    try:
        with pytest.raises(ToolsUnavailable, match="no tools"):
            sample(rig, [PromptInput("q", chat=QUESTION)], SamplingRequest(), MultiTurnRequest(), {})
    finally:
        rig.engine.tools = tools
