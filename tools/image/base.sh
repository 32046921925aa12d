#!/usr/bin/env bash
# Build (once) a local Debian bookworm + Python 3.11 base image with debootstrap and import it
# (buildah from scratch + add + commit) into buildah's vfs storage as $BASE_TAG. Stand-in for the CANN image where no NPU/registry is at
# hand. The rootfs tarball is cached in $CACHE_DIR so a second run only re-imports it (seconds).
#   tools/image/base.sh            # env: CACHE_DIR, DEBIAN_MIRROR
#   tools/image/base.sh --tag      # print the tag only (it changes with the package list)
set -Eeuo pipefail

CACHE_DIR="${CACHE_DIR:-/var/tmp/ascend-finetune-image}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# What the CANN image provides and the project needs: Python 3.11 + venv, iproute2 (msrun's
# `ip -j addr`), numactl, libgomp1 (MindSpore's CPU kernels), CA certificates.
PACKAGES="python3,python3-venv,python3-pip,iproute2,numactl,libgomp1,ca-certificates,procps"
KEY="$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-8)"
BASE_TAG="localhost/ascend-finetune-base:bookworm-py311-$KEY"
STORAGE=(--storage-driver vfs)
if [[ "${1:-}" == --tag ]]; then
    echo "$BASE_TAG"
    exit 0
fi

log() { printf '[base-image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

tarball="$CACHE_DIR/bookworm-py311-$KEY.tar"
if buildah "${STORAGE[@]}" inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
    log "$BASE_TAG already in buildah storage"
    exit 0
fi
mkdir -p "$CACHE_DIR"
if [[ ! -s "$tarball" ]]; then
    root="$CACHE_DIR/rootfs"
    rm -rf "$root"
    log "debootstrap bookworm ($PACKAGES) into $root ..."
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$DEBIAN_MIRROR"
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
    log "packing $tarball ..."
    tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
fi
log "buildah: $tarball -> $BASE_TAG"
ctr=$(buildah "${STORAGE[@]}" from scratch)
trap 'buildah "${STORAGE[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah "${STORAGE[@]}" add --quiet "$ctr" "$tarball" / >/dev/null
buildah "${STORAGE[@]}" config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
buildah "${STORAGE[@]}" commit --quiet "$ctr" "$BASE_TAG" >/dev/null
log "done"
