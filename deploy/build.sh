#!/usr/bin/env bash
# Build dgrpo's images: deploy/Dockerfile.<variant> -> dgrpo:<variant>, with BuildKit.
#
#   bash deploy/build.sh [--base IMAGE] [--tag TAG] [--no-cache] [--no-host-pip] [cpu|cuda|npu ...]   (default: cpu)
#
# - Base: the Dockerfile's default `ARG BASE_IMAGE` (python:3.12-slim-bookworm, vLLM's image, vllm-ascend's)
#   when it is present or can be pulled; else, for cpu, a local Debian bookworm base (mmdebstrap + docker import,
#   cached as dgrpo-base:bookworm-<hash>, its tarball in $DGRPO_BUILD_CACHE). CUDA and Ascend bases carry vLLM,
#   torch and the device toolkit, so no Debian stand-in exists: pass --base with a reachable copy (a mirror).
# - pip: the host's pip configuration (index, extra indexes, local wheel folders, constraints, CA bundle) is
#   used inside the build through BuildKit secrets and a loopback HTTP server (deploy/pip_context.py), so nothing
#   of it lands in a layer. --no-host-pip builds with the Dockerfile's own defaults (PyPI + PyTorch's CPU index).
# - Prints each image's build time and size. Rebuilds are incremental: dependency layers depend on
#   pyproject.toml alone, and pip's download cache is a BuildKit cache mount. The image a rebuild replaces is
#   removed, and build cache unused for a week is pruned, so CI rebuilding on one machine does not fill its disk.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="" TAG="" NO_CACHE=() HOST_PIP=1 VARIANTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --no-host-pip) HOST_PIP=0; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    cpu|cuda|npu) VARIANTS+=("$1"); shift ;;
    *) echo "build.sh: unknown argument '$1' (variants: cpu, cuda, npu; see --help)" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(cpu)
[ -z "$TAG" ] || [ ${#VARIANTS[@]} -eq 1 ] || { echo "build.sh: --tag names one image: give one variant" >&2; exit 2; }
CACHE_DIR="${DGRPO_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dgrpo-build}"
log() { echo "[build] $*"; }
die() { echo "[build] error: $*" >&2; exit 1; }

# A docker CLI that builds with BuildKit: one with buildx, or a 19.03-22.x CLI (BuildKit built in). Docker 23+
# CLIs without the buildx plugin only have the legacy builder, which cannot mount secrets.
BUILD=()
for cli in docker /usr/bin/docker /usr/local/bin/docker; do
  command -v "$cli" >/dev/null 2>&1 || continue
  if "$cli" buildx version >/dev/null 2>&1; then BUILD=("$cli" buildx build --load); DOCKER="$cli"; break; fi
  major=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
  if [ -n "$major" ] && [ "$major" -ge 19 ] 2>/dev/null && [ "$major" -lt 23 ]; then
    BUILD=(env DOCKER_BUILDKIT=1 "$cli" build); DOCKER="$cli"; break
  fi
done
[ ${#BUILD[@]} -gt 0 ] || die "no docker CLI with BuildKit (install the buildx plugin, or Debian's docker.io)"
"$DOCKER" info >/dev/null 2>&1 || die "no Docker daemon answers ($DOCKER info failed; start dockerd)"

# The local stand-in for python:3.12-slim: Debian bookworm's python3 (3.11) plus the CPU image's runtime
# packages (Dockerfile.cpu's final stage), so the build needs no apt index. Tagged by the content hash of its recipe.
LOCAL_PACKAGES="python3,python3-venv,ca-certificates,libnuma1,libgomp1,libtcmalloc-minimal4,g++"
local_base() {
  local sources="" tag tar
  for s in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do [ -f "$s" ] && sources="$s" && break; done
  tag="dgrpo-base:bookworm-$(printf '%s %s' "$LOCAL_PACKAGES" "$(cat "$sources" 2>/dev/null)" | sha256sum | cut -c1-12)"
  PICKED="$tag"
  if "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then log "local base $tag (cached)"; return; fi
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
      || die "the local base needs mmdebstrap (apt-get install mmdebstrap)"
    log "installing mmdebstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  fi
  mkdir -p "$CACHE_DIR"
  tar="$CACHE_DIR/${tag#dgrpo-base:}.tar"
  local t0=$SECONDS
  log "building local base $tag with mmdebstrap (bookworm minbase + $LOCAL_PACKAGES)"
  mmdebstrap --quiet --format=tar --variant=minbase --include="$LOCAL_PACKAGES" bookworm "$tar.part" ${sources:+"$sources"}
  mv "$tar.part" "$tar"
  "$DOCKER" import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' "$tar" "$tag" >/dev/null
  log "local base $tag in $((SECONDS - t0)) s"
}

pick_base() {  # variant -> PICKED, the base image to build from
  local dockerfile="deploy/Dockerfile.$1" default err
  default=$(sed -n 's/^ARG BASE_IMAGE=//p' "$dockerfile" | head -1)
  [ -n "$default" ] || die "$dockerfile has no 'ARG BASE_IMAGE=<default>'"
  PICKED="${BASE:-$default}"
  if [ -n "$BASE" ] || "$DOCKER" image inspect "$default" >/dev/null 2>&1; then return; fi
  log "pulling $default"
  if err=$(timeout 1800 "$DOCKER" pull -q "$default" 2>&1); then return; fi
  log "cannot pull $default: $(echo "$err" | tail -1)"
  [ "$1" = cpu ] || die "no base for $1: $default cannot be pulled and has no local stand-in; pass --base IMAGE"
  local_base
}

# The host's pip configuration, served for the length of the builds.
PIP_ARGS=() PIP_DIR="" PIP_PID=""
cleanup() { [ -z "$PIP_PID" ] || kill "$PIP_PID" 2>/dev/null || true; [ -z "$PIP_DIR" ] || rm -rf "$PIP_DIR"; }
trap cleanup EXIT
if [ "$HOST_PIP" = 1 ] && python3 -m pip --version >/dev/null 2>&1; then
  PIP_DIR=$(mktemp -d)
  python3 deploy/pip_context.py "$PIP_DIR" & PIP_PID=$!
  for _ in $(seq 100); do [ -f "$PIP_DIR/ready" ] && break; sleep 0.1; done
  [ -f "$PIP_DIR/ready" ] || die "deploy/pip_context.py did not start"
  PIP_ARGS=(--network=host --secret "id=pip.conf,src=$PIP_DIR/pip.conf")
  [ ! -s "$PIP_DIR/cert" ] || PIP_ARGS+=(--secret "id=pip-cert,src=$(cat "$PIP_DIR/cert")")
  # The host's pip configuration decides where torch comes from (a local wheel folder, a mirror).
  PIP_ARGS+=(--build-arg TORCH_INDEX_URL=)
  log "host pip configuration passed as build secrets:"; sed 's/^/[build]   /' "$PIP_DIR/pip.conf"
fi

declare -A SUMMARY
for variant in "${VARIANTS[@]}"; do
  pick_base "$variant"; base="$PICKED"
  tag="${TAG:-dgrpo:$variant}"
  log "$tag from $base"
  t0=$SECONDS
  previous=$("$DOCKER" image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  "${BUILD[@]}" -f "deploy/Dockerfile.$variant" -t "$tag" --build-arg "BASE_IMAGE=$base" \
    ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} ${NO_CACHE[@]+"${NO_CACHE[@]}"} --progress=plain . 2>&1 \
    | sed -u 's/^/[docker] /'
  seconds=$((SECONDS - t0))
  size=$("$DOCKER" image inspect -f '{{.Size}}' "$tag")
  SUMMARY[$variant]="$tag: built in ${seconds} s, $((size / 1000000)) MB (base $base)"
  log "${SUMMARY[$variant]}"
  # The image this build replaced is left untagged (4-5 GB each): remove it unless a container still uses it.
  if [ -n "$previous" ] && [ "$previous" != "$("$DOCKER" image inspect -f '{{.Id}}' "$tag")" ]; then
    "$DOCKER" image rm "$previous" >/dev/null 2>&1 && log "removed the image it replaced (${previous:7:12})" || true
  fi
done
# Build cache nobody used for a week goes, so repeated builds on one machine do not fill its disk; the layers of
# the current images stay cached.
"$DOCKER" builder prune -f --filter until=168h >/dev/null 2>&1 || true
for variant in "${VARIANTS[@]}"; do log "${SUMMARY[$variant]}"; done
