#!/usr/bin/env bash
# The test command: builds the environment if needed, then runs the whole suite (real vLLM, real gRPC).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
exec python -m pytest tests "$@"
