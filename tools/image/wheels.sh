#!/usr/bin/env bash
# Download every wheel the image needs (project deps + build backend) once into $WHEEL_DIR, so the
# image build installs offline from there (PIP_NO_INDEX=1) and the ~800 MB mindspore wheel is fetched
# at most once per CI run (pip's own HTTP cache, when the venv install filled it, makes it free).
#   tools/image/wheels.sh [PYTHON]        # env: WHEEL_DIR (default build/wheels)
set -Eeuo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${1:-python3}"
WHEEL_DIR="${WHEEL_DIR:-build/wheels}"
mkdir -p "$WHEEL_DIR"
mapfile -t reqs < <("$PY" tools/image/deps.py pyproject.toml)
# The MindSpore wheel for the image (Python 3.11, this machine): on aarch64 MindSpore's release repository's
# (tools/image/mindspore_wheel.py), which the build then finds here; MINDSPORE_WHEEL overrides it.
arch="$(uname -m)"
ms=(tools/image/mindspore_wheel.py pyproject.toml "${MINDSPORE_WHEEL:-}" --python cp311 --arch "$arch")
ms_url="$("$PY" "${ms[@]}")"
[[ "$ms_url" == *://* ]] && reqs_ms="$ms_url" || reqs_ms=""
stamp="$WHEEL_DIR/.requirements"  # what the directory was filled for: skip pip when unchanged
if [[ -f "$stamp" && "$(cat "$stamp")" == "${reqs[*]} $reqs_ms" ]]; then
    printf '[wheels %s] %s is up to date\n' "$(date +%H:%M:%S)" "$WHEEL_DIR"
    exit 0
fi
printf '[wheels %s] pip download -> %s: %s\n' "$(date +%H:%M:%S)" "$WHEEL_DIR" "${reqs[*]}"
# Wheels for the image's Python (3.11, glibc 2.36 in bookworm), whatever Python runs this script.
platforms=(--platform "manylinux1_$arch" --platform "manylinux2010_$arch" --platform "manylinux2014_$arch")
for minor in $(seq 5 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.11 "${platforms[@]}" \
    --dest "$WHEEL_DIR" "${reqs[@]}" "setuptools>=64" wheel
if [[ -n "$reqs_ms" ]]; then
    "$PY" -m pip download --quiet --no-deps --dest "$WHEEL_DIR" "$reqs_ms" || { "$PY" "${ms[@]}" --failed; exit 1; }
fi
printf '%s' "${reqs[*]} $reqs_ms" > "$stamp"
printf '[wheels %s] %s files, %s\n' "$(date +%H:%M:%S)" "$(find "$WHEEL_DIR" -name '*.whl' | wc -l)" \
    "$(du -sh "$WHEEL_DIR" | cut -f1)"
