#!/usr/bin/env bash
# Build the image from the Dockerfile with docker when an engine answers, else with buildah
# (chroot isolation, vfs storage: what works in unprivileged CI containers).
#   tools/image/build.sh      # env: IMAGE, BASE_IMAGE, ENGINE (auto|docker|buildah),
#                             #      PIP_CA (host CA bundle mounted for pip), WHEEL_DIR (offline wheels),
#                             #      MINDSPORE_WHEEL (the target architecture's wheel: a URL, or with
#                             #      buildah also a local file, mounted read-only),
#                             #      LAYERS (buildah: true keeps a cached layer per step; with vfs storage
#                             #      each is a full copy, so one-shot CI builds use LAYERS=false)
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

IMAGE="${IMAGE:-ascend-finetune:latest}"
BASE_IMAGE="${BASE_IMAGE:-}"
ENGINE="${ENGINE:-auto}"
PIP_CA="${PIP_CA:-}"
WHEEL_DIR="${WHEEL_DIR:-}"
LAYERS="${LAYERS:-true}"
MINDSPORE_WHEEL="${MINDSPORE_WHEEL:-}"

log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ "$ENGINE" == auto ]]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=buildah; fi
fi
args=(--tag "$IMAGE" --file Dockerfile)
[[ -n "$BASE_IMAGE" ]] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
ms_file=""
if [[ "$MINDSPORE_WHEEL" == *://* ]]; then
    args+=(--build-arg "MINDSPORE_WHEEL=$MINDSPORE_WHEEL")
elif [[ -n "$MINDSPORE_WHEEL" ]]; then
    [[ -f "$MINDSPORE_WHEEL" ]] || { log "MINDSPORE_WHEEL=$MINDSPORE_WHEEL: no such file (a .whl path or a URL)"; exit 2; }
    ms_file="$(realpath "$MINDSPORE_WHEEL")"
fi

case "$ENGINE" in
    docker)
        # docker build cannot mount host paths: PIP_CA/WHEEL_DIR/a wheel file are for buildah builds only.
        if [[ -n "$ms_file" ]]; then
            log "docker cannot mount MINDSPORE_WHEEL=$MINDSPORE_WHEEL: give its URL, or ENGINE=buildah"
            exit 2
        fi
        log "docker build $IMAGE ${BASE_IMAGE:+(BASE_IMAGE=$BASE_IMAGE)}"
        exec docker build "${args[@]}" .
        ;;
    buildah)
        command -v buildah >/dev/null 2>&1 || { log "neither a docker engine nor buildah: apt-get install buildah"; exit 1; }
        if [[ -n "$PIP_CA" ]]; then
            args+=(--volume "$(realpath "$PIP_CA"):/run/pip-ca.crt:ro" --build-arg PIP_CERT=/run/pip-ca.crt)
        fi
        if [[ -n "$WHEEL_DIR" ]]; then
            args+=(--volume "$(realpath "$WHEEL_DIR"):/run/wheels:ro"
                   --build-arg PIP_FIND_LINKS=/run/wheels --build-arg PIP_NO_INDEX=1)
        fi
        if [[ -n "$ms_file" ]]; then  # pip needs the wheel's own file name (it carries the platform tag)
            args+=(--volume "$ms_file:/run/mindspore/${ms_file##*/}:ro"
                   --build-arg "MINDSPORE_WHEEL=/run/mindspore/${ms_file##*/}")
        fi
        log "buildah bud $IMAGE ${BASE_IMAGE:+(BASE_IMAGE=$BASE_IMAGE)}"
        exec buildah --storage-driver vfs bud --isolation chroot --layers="$LAYERS" --force-rm "${args[@]}" .
        ;;
    *)
        log "ENGINE=$ENGINE: use auto, docker or buildah"
        exit 2
        ;;
esac
