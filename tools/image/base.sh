#!/usr/bin/env bash
# Build (once) a local CANN-shaped base image and import it into buildah's vfs storage as $BASE_TAG:
# the stand-in for the CANN image (Ascend/cann-container-image, cann/8.5.0-910b-ubuntu22.04-
# py3.11/Dockerfile) where no NPU/registry is at hand. Shaped as that image is where our Dockerfile
# and entrypoint depend on it:
#   - Python only under /usr/local/python3.11.<patch>/bin, reached through PATH (image ENV); no
#     /usr/bin/python3; its lib/ on LD_LIBRARY_PATH; ATB_CXX_ABI=1 in the environment;
#   - no iproute2 / numactl (the Dockerfile installs them), libgomp present (gcc is installed there);
#   - /usr/local/Ascend/ascend-toolkit/set_env.sh, the AscendNPU IR script under ASCEND_TOOLKIT_HOME
#     and /usr/local/Ascend/nnal/atb/set_env.sh as stubs that set variables; like ATB's own script,
#     the ATB stub fails without --cxx_abi=<0|1>; the toolkit's ascend_toolkit_install.info (version=8.5.0);
# Debian bookworm comes from debootstrap (cached as a tarball in $CACHE_DIR; a second run only
# re-imports it); its Python 3.11 is moved under /usr/local (CPython finds its prefix from the
# executable's location).
#   tools/image/base.sh            # env: CACHE_DIR, DEBIAN_MIRROR
#   tools/image/base.sh --tag      # print the tag only (it changes with this script)
set -Eeuo pipefail

CACHE_DIR="${CACHE_DIR:-/var/tmp/ascend-finetune-image}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-venv,libgomp1,ca-certificates,procps"
DEB_KEY="$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-8)"
BASE_TAG="localhost/ascend-finetune-base:cann-shaped-$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-8)"
STORAGE=(--storage-driver vfs)
if [[ "${1:-}" == --tag ]]; then
    echo "$BASE_TAG"
    exit 0
fi

log() { printf '[base-image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# Run inside the imported rootfs: move Python, write the CANN stubs. $1: the Python prefix.
# shellcheck disable=SC2016  # the stubs' $VARS expand when they are sourced, not here
SHAPE='set -eu
prefix="$1"
mkdir -p "$prefix/bin" "$prefix/lib"
mv /usr/lib/python3.11 "$prefix/lib/python3.11"
mv /usr/bin/python3.11 "$prefix/bin/python3.11"
ln -s python3.11 "$prefix/bin/python3"
ln -s python3 "$prefix/bin/python"
rm -f /usr/bin/python3 /usr/bin/python
home=/usr/local/Ascend/cann-8.5.0-stub
mkdir -p /usr/local/Ascend/ascend-toolkit "$home/bin" "$home/lib64" "$home/share/info/ascendnpu-ir/bin" \
    /usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_0/lib /usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_1/lib
ln -s "$home" /usr/local/Ascend/ascend-toolkit/latest
mkdir -p "$home/$(uname -m)-linux"  # the version CANN records (jobspec/cann.py reads it at build and preflight)
printf "package_name=Ascend-cann-toolkit\nversion=8.5.0\n" > "$home/$(uname -m)-linux/ascend_toolkit_install.info"
cat > /usr/local/Ascend/ascend-toolkit/set_env.sh <<EOF
export ASCEND_TOOLKIT_HOME=$home
export ASCEND_HOME_PATH=$home
export ASCEND_OPP_PATH=$home/opp
export LD_LIBRARY_PATH=$home/lib64:\${LD_LIBRARY_PATH}
export PATH=$home/bin:\$PATH
EOF
cat > "$home/share/info/ascendnpu-ir/bin/set_env.sh" <<EOF
export BISHENG_IR_STUB=1
EOF
cat > /usr/local/Ascend/nnal/atb/set_env.sh <<"EOF"
case "${1:-}" in
    --cxx_abi=0|--cxx_abi=1) abi="${1#--cxx_abi=}" ;;
    *) echo "nnal/atb/set_env.sh (stub): pass --cxx_abi=0|1 (the real script would probe torch)" >&2; return 1 ;;
esac
export ATB_HOME_PATH=/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_$abi
export LD_LIBRARY_PATH=$ATB_HOME_PATH/lib:${LD_LIBRARY_PATH}
EOF
'

tarball="$CACHE_DIR/bookworm-$DEB_KEY.tar"
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
log "buildah: $tarball -> $BASE_TAG (CANN-shaped)"
ctr=$(buildah "${STORAGE[@]}" from scratch)
trap 'buildah "${STORAGE[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah "${STORAGE[@]}" add --quiet "$ctr" "$tarball" / >/dev/null
pyver=$(buildah "${STORAGE[@]}" run --isolation chroot "$ctr" -- /usr/bin/python3 -c \
    'import platform; print(platform.python_version())')
prefix="/usr/local/python$pyver"
buildah "${STORAGE[@]}" run --isolation chroot "$ctr" -- /bin/sh -c "$SHAPE" shape "$prefix"
buildah "${STORAGE[@]}" config \
    --env PATH="$prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --env LD_LIBRARY_PATH="$prefix/lib" --env ATB_CXX_ABI=1 \
    --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
buildah "${STORAGE[@]}" commit --quiet "$ctr" "$BASE_TAG" >/dev/null
log "done: Python $pyver in $prefix"
