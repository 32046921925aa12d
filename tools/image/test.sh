#!/usr/bin/env bash
# `make image-test`: build the image on a local Debian bookworm + Python 3.11 base (debootstrap,
# buildah with chroot isolation and vfs storage: no Docker engine, no cgroups needed), then run the
# entrypoint inside it for `bash`, `plan` and the embedded default training end to end.
#   tools/image/test.sh [PYTHON]     # env: CACHE_DIR (debootstrap cache), TRAIN_TIMEOUT (seconds)
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY="${1:-python3}"
IMAGE=localhost/ascend-finetune:image-test
export CACHE_DIR="${CACHE_DIR:-/var/tmp/ascend-finetune-image}"
OUT="$PWD/build/image-test"
TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-1800}"
BUILDAH=(buildah --storage-driver vfs)
SECONDS=0

log() { printf '[image-test %s +%ss] %s\n' "$(date +%H:%M:%S)" "$SECONDS" "$*"; }
fail() { log "FAIL: $*"; exit 1; }

# The tools: installed with apt-get when missing (CI runs as root); otherwise a clear failure.
missing=()
for tool in buildah debootstrap; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if (( ${#missing[@]} )); then
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1 \
        || fail "need ${missing[*]}: run  sudo apt-get install -y ${missing[*]}"
    log "apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" \
        || fail "apt-get install ${missing[*]} failed"
fi

BASE_TAG="$(tools/image/base.sh --tag)"
log "1/5 base image $BASE_TAG (debootstrap cache: $CACHE_DIR)"
tools/image/base.sh
log "2/5 wheels (downloaded once into build/wheels)"
WHEEL_DIR=build/wheels tools/image/wheels.sh "$PY"
log "3/5 buildah bud $IMAGE"
IMAGE="$IMAGE" BASE_IMAGE="$BASE_TAG" ENGINE=buildah LAYERS="${LAYERS:-false}" PIP_CA=/etc/ssl/certs/ca-certificates.crt \
    WHEEL_DIR=build/wheels tools/image/build.sh

ctr=$("${BUILDAH[@]}" from --pull-never "$IMAGE")
trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
rm -rf "$OUT" && mkdir -p "$OUT/plan" "$OUT/train"
in_image() {  # in_image <host output dir> <timeout> <entrypoint args...>
    local dir="$1" limit="$2"
    shift 2
    timeout "$limit" "${BUILDAH[@]}" run --isolation chroot --volume "$dir:/output" "$ctr" -- \
        /opt/ascend-finetune/entrypoint.sh "$@"
}

log "4/5 entrypoint: bash, then plan"
[[ "$(in_image "$OUT/plan" 120 bash -c 'echo hi from $(python --version)')" == "hi from Python 3.11"* ]] \
    || fail "entrypoint bash -c did not run"
in_image "$OUT/plan" 300 plan 2>&1 | tee "$OUT/plan.log" || fail "entrypoint plan exited non-zero (see $OUT/plan.log)"
[[ -s "$OUT/plan.log" ]] || fail "plan printed nothing"

log "5/5 entrypoint (default: train, the embedded tiny CPU recipe) end to end"
in_image "$OUT/train" "$TRAIN_TIMEOUT" 2>&1 | tee "$OUT/train.log" \
    || fail "training in the image exited non-zero (see $OUT/train.log)"
"$PY" tools/image/check_train.py "$OUT/train" "$OUT/train.log" || fail "training output check"
log "PASS in ${SECONDS}s"
