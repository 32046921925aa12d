#!/usr/bin/env bash
# Image entrypoint: CANN environment, then the first argument picks what runs.
#
#   (none) | train        python -m launcher train        (the default)
#   plan | preflight | prepare-data | generate | render
#                         python -m launcher <cmd> [args...]
#   --opt ... | key=value python -m launcher train <args...>
#   bash | sh | <program> that program, e.g. `docker run IMAGE bash -c 'npu-smi info'`
#
# Settings come from the environment (RECIPE, MODEL_DIR, DATA, OUTPUT_DIR, NNODES, NODE_RANK,
# MASTER_ADDR, OVERRIDES, ...; the table is in the launcher's docstring and the README). Values are
# only ever passed on as data, never evaluated. `exec` replaces this shell so that SIGTERM/SIGINT
# from docker or Kubernetes reach the launcher, which forwards them to the workers.
set -Eeuo pipefail

APP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ASCEND_BASE="${ASCEND_BASE:-/usr/local/Ascend}"
LAUNCHER_COMMANDS=(train plan preflight prepare-data generate render)

say() { printf 'entrypoint: %s\n' "$*" >&2; }

# A Kubernetes `command:` replaces the CANN image's own entrypoint, so source its environment here.
# The CANN scripts read variables that may be unset and may end on a failing test: relax -e/-u.
source_cann_env() {
    local f
    for f in "$ASCEND_BASE/ascend-toolkit/set_env.sh" "$ASCEND_BASE/nnal/atb/set_env.sh"; do
        if [[ -f "$f" ]]; then
            set +eu
            # shellcheck source=/dev/null
            source "$f"
            set -eu
        fi
    done
}

# True when a key=value override for $1 (e.g. model.dir) is in OVERRIDES or the arguments.
has_override() {
    local key="$1" item
    shift
    local -a over=()
    read -r -a over <<<"${OVERRIDES:-}"
    for item in "${over[@]}" "$@"; do
        [[ "$item" == "$key="?* ]] && return 0
    done
    return 1
}

# Stop with every missing/invalid setting at once, each with the `-e VAR=...` that fixes it.
check_env() {
    local -a missing=()
    local nnodes="${NNODES:-1}"
    if [[ ! "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
        missing+=("NNODES=${nnodes@Q} is not a positive whole number: add  -e NNODES=2")
        nnodes=1
    fi
    if (( nnodes > 1 )) && [[ -z "${MASTER_ADDR:-}${HOSTFILE:-}${VC_TASK_INDEX:-}${MS_SCHED_HOST:-}" ]]; then
        missing+=("MASTER_ADDR: NNODES=$nnodes needs node 0's address: add  -e MASTER_ADDR=<node-0 IP> -e NODE_RANK=<0..$((nnodes - 1))>  (or -e HOSTFILE=/path/hostfile)")
    fi
    if (( nnodes > 1 )) && [[ -n "${MASTER_ADDR:-}" && -z "${NODE_RANK:-}${RANK:-}${PET_NODE_RANK:-}${VC_TASK_INDEX:-}${HOSTFILE:-}" ]]; then
        missing+=("NODE_RANK: NNODES=$nnodes with MASTER_ADDR needs this node's rank: add  -e NODE_RANK=<0..$((nnodes - 1))>")
    fi
    case "${RECIPE:-}" in
        qwen*)  # the built-in NPU recipes ship without a model or data
            if [[ -z "${MODEL_DIR:-}" ]] && ! has_override model.dir "$@"; then
                missing+=("MODEL_DIR: RECIPE=$RECIPE needs a Hugging Face model directory: add  -e MODEL_DIR=/models/Qwen2.5-7B-Instruct -v /data/models:/models:ro")
            fi
            if [[ -z "${DATA:-}" ]] && ! has_override data.paths "$@"; then
                missing+=("DATA: RECIPE=$RECIPE needs training data (files or a dir, comma-separated): add  -e DATA=/data/train.jsonl -v /data:/data:ro")
            fi
            ;;
    esac
    if (( ${#missing[@]} )); then
        say "cannot start, settings are missing or invalid:"
        printf '  - %s\n' "${missing[@]}" >&2
        exit 2
    fi
}

run_launcher() {
    local cmd="$1"
    shift
    case "$cmd" in
        train | plan | preflight) check_env "$@" ;;
    esac
    export PYTHONPATH="$APP_DIR${PYTHONPATH:+:$PYTHONPATH}"
    exec python -m launcher "$cmd" "$@"
}

main() {
    source_cann_env
    if (( $# == 0 )); then
        run_launcher train
    fi
    local cmd="$1"
    if [[ "$cmd" == -* || "$cmd" == *=* ]]; then  # options/overrides only: train with them
        run_launcher train "$@"
    fi
    shift
    local c
    for c in "${LAUNCHER_COMMANDS[@]}"; do
        [[ "$cmd" == "$c" ]] && run_launcher "$cmd" "$@"
    done
    if ! command -v -- "$cmd" >/dev/null 2>&1; then
        say "unknown command ${cmd@Q}: use one of ${LAUNCHER_COMMANDS[*]}, or a program such as bash"
        exit 2
    fi
    exec "$cmd" "$@"
}

main "$@"
