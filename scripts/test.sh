#!/usr/bin/env bash
# The test command: builds the environment if needed, then runs the suite (real vLLM, real gRPC).
#   bash scripts/test.sh               every tier, cheapest first
#   bash scripts/test.sh unit          one tier: unit | integration | e2e (docs/testing.md says what each needs)
#   bash scripts/test.sh e2e -k compose ...  any further arguments go to pytest
#   DGRPO_COVERAGE=1 bash scripts/test.sh -m "unit or integration"   line coverage, subprocesses included
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
coverage=()
if [ -n "${DGRPO_COVERAGE:-}" ]; then  # [tool.coverage] in pyproject.toml
  coverage=(--cov --cov-report="${DGRPO_COVERAGE_REPORT:-term:skip-covered}")
fi
case "${1:-}" in
  unit|integration|e2e) tier="$1"; shift; exec python -m pytest tests -m "$tier" "${coverage[@]}" "$@" ;;
  *) exec python -m pytest tests "${coverage[@]}" "$@" ;;
esac
