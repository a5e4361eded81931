#!/usr/bin/env bash
# The main job: builds the environment if needed, then runs dgrpo (default: the CPU demo).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
exec dgrpo up "$@"
