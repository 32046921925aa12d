#!/usr/bin/env bash
# `make image-test`: build the image on a local CANN-shaped base (tools/image/base.sh: Python only
# under /usr/local/python3.11.x on PATH, stub CANN set_env.sh scripts; debootstrap, buildah with
# chroot isolation and vfs storage: no Docker engine, no cgroups needed), then run the entrypoint
# inside it: the environment it gives programs, `plan`, and the embedded default training end to end.
#   tools/image/test.sh [PYTHON]     # env: CACHE_DIR (debootstrap cache), TRAIN_TIMEOUT (seconds),
#                                    #      TRAIN_OVERRIDES (the training run's OVERRIDES; "" = the full default),
#                                    #      KEEP_IMAGE=1 (keep the tested image; default: removed at the end),
#                                    #      MIN_FREE_GB (free disk asked for before the build; default 13)
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY="${1:-python3}"
IMAGE=localhost/ascend-finetune:image-test
export CACHE_DIR="${CACHE_DIR:-/var/tmp/ascend-finetune-image}"
OUT="$PWD/build/image-test"
TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-1800}"
# 20 of the default's 80 steps: the same path (train, eval, checkpoint, export, inference check), a
# quarter of the time in `make test`
TRAIN_OVERRIDES="${TRAIN_OVERRIDES-train.max_steps=20 train.save_every=10}"
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
# Disk: with vfs storage, committing the ~3.4 GB image holds the build container, the layer written
# under TMPDIR (/var/tmp) and the new image's own copy at once: 12.9 GB at the peak, measured on
# 2026-12-04 (a CI machine ran out of space there). Said before the build, not deep inside buildah.
"${BUILDAH[@]}" rmi "$IMAGE" >/dev/null 2>&1 && log "removed the previous $IMAGE"
graph="$("${BUILDAH[@]}" info --format '{{.store.GraphRoot}}')"
tmp_dir="${TMPDIR:-/var/tmp}"
free_gb() { df -P -B1G "$1" | awk 'NR == 2 { print $4 }'; }
need="${MIN_FREE_GB:-13}"
if [[ "$(stat -c %d "$graph")" == "$(stat -c %d "$tmp_dir")" ]]; then
    have="$(free_gb "$graph")"
    where="$graph and $tmp_dir (one filesystem)"
else
    have="$(( $(free_gb "$graph") + $(free_gb "$tmp_dir") ))"
    where="$graph plus $tmp_dir"
fi
(( have >= need )) || fail "the image build needs ${need} GB free in $where; ${have} GB are free." \
    "Free some (buildah --storage-driver vfs images; buildah --storage-driver vfs rmi IMAGE)" \
    "or skip this test with SKIP_IMAGE_TEST=1"
log "3/5 buildah bud $IMAGE (${have} GB free in $where)"
IMAGE="$IMAGE" BASE_IMAGE="$BASE_TAG" ENGINE=buildah LAYERS="${LAYERS:-false}" PIP_CA=/etc/ssl/certs/ca-certificates.crt \
    WHEEL_DIR=build/wheels tools/image/build.sh

ctr=$("${BUILDAH[@]}" from --pull-never "$IMAGE")
cleanup() {  # the test's container always; its image (3.4 GB) unless KEEP_IMAGE=1
    "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
    if [[ "${KEEP_IMAGE:-0}" == 1 ]]; then
        log "kept $IMAGE (KEEP_IMAGE=1)"
    else
        "${BUILDAH[@]}" rmi "$IMAGE" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT
rm -rf "$OUT" && mkdir -p "$OUT/plan" "$OUT/train"
in_image() {  # in_image <host output dir> <timeout> <entrypoint args...>; env OVERRIDES passes through
    local dir="$1" limit="$2"
    shift 2
    timeout "$limit" "${BUILDAH[@]}" run --isolation chroot --volume "$dir:/output" --env "OVERRIDES=${OVERRIDES:-}" \
        "$ctr" -- /opt/ascend-finetune/entrypoint.sh "$@"
}

log "4/5 entrypoint: the CANN environment and PATH, then plan"
# shellcheck disable=SC2016  # expanded inside the image
probe='set -u; printf "%s\n" "$(python --version)" "$(command -v python)" "$PATH" "$ASCEND_TOOLKIT_HOME" \
    "$ATB_HOME_PATH" "${BISHENG_IR_STUB:-}"; test ! -e /usr/bin/python3 && echo no-usr-bin-python3'
mapfile -t seen < <(in_image "$OUT/plan" 120 bash -c "$probe") || fail "entrypoint bash -c did not run"
printf '  %s\n' "${seen[@]}"
[[ "${seen[0]:-}" == "Python 3.11"* && "${seen[1]:-}" == /opt/venv/bin/python ]] || fail "python is not the venv's"
[[ ":${seen[2]:-}:" == *:/usr/local/python3.11.*/bin:* && ":${seen[2]:-}:" == *":${seen[3]:-?}/bin:"* ]] \
    || fail "PATH lost the base's Python or the toolkit's bin: ${seen[2]:-}"
[[ "${seen[4]:-}" == */cxx_abi_1 && "${seen[5]:-}" == 1 ]] \
    || fail "entrypoint did not source nnal/atb/set_env.sh --cxx_abi=1 and the AscendNPU IR script"
[[ "${seen[6]:-}" == no-usr-bin-python3 ]] || fail "the base has /usr/bin/python3: not CANN-shaped"
in_image "$OUT/plan" 120 python -m jobspec.native || fail "MindSpore's native code does not match this machine"
in_image "$OUT/plan" 300 plan 2>&1 | tee "$OUT/plan.log" || fail "entrypoint plan exited non-zero (see $OUT/plan.log)"
[[ -s "$OUT/plan.log" ]] || fail "plan printed nothing"

log "5/5 entrypoint (default: train, the embedded tiny CPU recipe) end to end (OVERRIDES: ${TRAIN_OVERRIDES:-none})"
OVERRIDES="$TRAIN_OVERRIDES" in_image "$OUT/train" "$TRAIN_TIMEOUT" 2>&1 | tee "$OUT/train.log" \
    || fail "training in the image exited non-zero (see $OUT/train.log)"
"$PY" tools/image/check_train.py "$OUT/train" "$OUT/train.log" || fail "training output check"
log "PASS in ${SECONDS}s"
