#!/bin/sh
# Image entrypoint for every dgrpo service.
# 1. Load the Ascend toolkit environment where the image has one (CANN's set_env.sh files put the runtime libraries
#    and ASCEND_* paths in place). On CPU and CUDA images the files are absent.
# 2. `dgrpo learner ...` with DGRPO_NPROC_PER_NODE=N > 1 runs under torchrun, one rank per device (the learner's
#    data parallelism, learner/update/distributed.py), so override files change a variable instead of repeating the
#    learner's whole command line.
# 3. DGRPO_OVERRIDES (space-separated key=value) is appended to a `dgrpo <service>` command: compose passes
#    DGRPO_LEARNER_OVERRIDES / DGRPO_SAMPLER_OVERRIDES / DGRPO_REWARDER_OVERRIDES through it (docs/deploy.md), so a step
#    count or a learning rate changes with a variable. Split on spaces only: no globbing of `[a,b]` list values.
set -e
for f in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
  # shellcheck disable=SC1090
  if [ -f "$f" ]; then . "$f"; fi
done
if [ "${1:-}" = dgrpo ] && [ -n "${DGRPO_OVERRIDES:-}" ]; then
  set -f
  # shellcheck disable=SC2086
  set -- "$@" $DGRPO_OVERRIDES
  set +f
fi
if [ "${1:-}" = dgrpo ] && [ "${2:-}" = learner ] && [ "${DGRPO_NPROC_PER_NODE:-1}" -gt 1 ]; then
  shift
  exec torchrun --standalone --nproc-per-node "$DGRPO_NPROC_PER_NODE" -m dgrpo.cli "$@"
fi
exec "$@"
