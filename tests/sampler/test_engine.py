"""SamplerEngine without vLLM: size bounds before tokenization, tokenization off the event loop, vLLM's request
validation errors turned into InvalidRequest."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from dgrpo.sampler.config import SamplerConfig
from dgrpo.sampler.engine import InvalidRequest, PromptInput, SamplerEngine


class FakeTokenizer:
    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls = delay_s, 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        time.sleep(self.delay_s)  # a long tokenizer call, blocking whichever thread runs it
        return [1] * min(len(text), 10)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return self.encode("".join(m["content"] for m in messages))


class FakeLLM:
    errored = False

    def __init__(self, tokenizer, generate_error: Exception | None = None):
        self._tokenizer, self._generate_error = tokenizer, generate_error
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 100, max_model_len=64)

    def get_tokenizer(self):
        return self._tokenizer

    async def generate(self, prompt, params, request_id):
        raise self._generate_error
        yield  # an async generator, as AsyncLLM.generate is


def make_engine(tokenizer, generate_error=None, **cfg) -> SamplerEngine:
    return SamplerEngine(FakeLLM(tokenizer, generate_error), None, SamplerConfig(max_model_len=64, **cfg),
                         "fake", "cpu", None)


def test_default_char_bound_is_16_chars_per_token_of_max_model_len():
    assert SamplerConfig(max_model_len=64).prompt_char_limit == 1024
    assert SamplerConfig(max_model_len=64, max_prompt_chars=10).prompt_char_limit == 10


@pytest.mark.parametrize("prompt", [
    PromptInput(id="huge-text", text="a" * 1025),
    PromptInput(id="huge-chat", chat=[("system", "a" * 600), ("user", "b" * 600)]),
], ids=["text", "chat"])
def test_text_over_max_prompt_chars_is_refused_before_tokenization(prompt):
    tok = FakeTokenizer()
    engine = make_engine(tok)
    with pytest.raises(InvalidRequest, match=rf"prompt '{prompt.id}': 1[0-9]{{3}} characters exceeds "
                                             r"sampler.max_prompt_chars=1024"):
        asyncio.run(engine.tokenize_batch([PromptInput(id="ok", text="fine"), prompt]))
    assert tok.calls == 0, "the tokenizer ran before the size check"
    assert asyncio.run(engine.tokenize_batch([PromptInput(id="at-limit", text="a" * 1024)])) == [[1] * 10]


def test_tokenization_runs_off_the_event_loop():
    engine = make_engine(FakeTokenizer(delay_s=0.6))

    async def scenario():
        ticks = 0

        async def heartbeat():  # stands in for the health service answering on the same loop
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beat = asyncio.create_task(heartbeat())
        ids = await engine.tokenize_batch([PromptInput(id="slow", text="x" * 100)])
        beat.cancel()
        return ids, ticks

    ids, ticks = asyncio.run(scenario())
    assert ids == [[1] * 10]
    assert ticks >= 20, f"the event loop ticked only {ticks} times while tokenizing for 0.6 s"


def test_vllm_refusing_a_request_is_invalid_request_naming_the_prompt():
    error = ValueError("The decoder prompt (length 70) is longer than the maximum model length of 64.")
    engine = make_engine(FakeTokenizer(), generate_error=error)
    with pytest.raises(InvalidRequest, match=r"prompt 'p7': vLLM rejected the request: The decoder prompt"):
        asyncio.run(engine._sample_group("p7", [1, 2], params=None))


def test_other_engine_errors_are_not_turned_into_invalid_request():
    engine = make_engine(FakeTokenizer(), generate_error=RuntimeError("bug"))
    with pytest.raises(RuntimeError, match="bug"):
        asyncio.run(engine._sample_group("p7", [1, 2], params=None))
