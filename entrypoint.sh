#!/usr/bin/env bash
# Image entrypoint: the CANN environment, then the first argument picks what runs.
#
#   (none) | train        python -m launcher train        (the default)
#   plan | preflight | prepare-data | selftest | generate | render | export
#                         python -m launcher <cmd> [args...]
#   --opt ... | key=value python -m launcher train <args...>
#   bash | sh | <program> that program, e.g. `docker run IMAGE bash -c 'npu-smi info'`
#
# Settings are the launcher's to check (it reports every missing one with the `-e VAR=...` that
# fixes it); arguments and variables are passed on as data, never evaluated. `exec` replaces this
# shell so that SIGTERM/SIGINT from docker or Kubernetes reach the launcher.
set -Eeuo pipefail

APP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ASCEND_BASE="${ASCEND_BASE:-/usr/local/Ascend}"
LAUNCHER_COMMANDS=(train plan preflight prepare-data selftest generate render export eval)  # launcher/__main__.py COMMANDS

# A Kubernetes `command:` or this image's ENTRYPOINT replaces the CANN image's own entrypoint, so
# source what it sources, in its order (Ascend/cann-container-image, cann/<ver>-910b-*/Dockerfile):
# the toolkit, the AscendNPU IR compiler's script under ASCEND_TOOLKIT_HOME, and ATB with an explicit
# C++ ABI (without --cxx_abi ATB's script probes torch). The scripts read unset variables and may
# end on a failing test: -e/-u are off while they run.
source_cann_env() {
    set +eu
    # shellcheck source=/dev/null
    [[ -f "$ASCEND_BASE/ascend-toolkit/set_env.sh" ]] && source "$ASCEND_BASE/ascend-toolkit/set_env.sh"
    local ir="${ASCEND_TOOLKIT_HOME:-/nonexistent}/share/info/ascendnpu-ir/bin/set_env.sh"
    # shellcheck source=/dev/null
    [[ -f "$ir" ]] && source "$ir"
    # shellcheck source=/dev/null
    [[ -f "$ASCEND_BASE/nnal/atb/set_env.sh" ]] && source "$ASCEND_BASE/nnal/atb/set_env.sh" "--cxx_abi=${ATB_CXX_ABI:-1}"
    set -eu
}

launcher() {
    export PYTHONPATH="$APP_DIR${PYTHONPATH:+:$PYTHONPATH}"
    exec python -m launcher "$@"
}

source_cann_env
cmd="${1:-train}"
if [[ "$cmd" == -* || "$cmd" == *=* ]]; then  # options/overrides only: train with them
    launcher train "$@"
fi
(( $# )) && shift
for c in "${LAUNCHER_COMMANDS[@]}"; do
    [[ "$cmd" == "$c" ]] && launcher "$cmd" "$@"
done
command -v -- "$cmd" >/dev/null 2>&1 \
    || { printf 'entrypoint: unknown command %q: use one of %s, or a program such as bash\n' \
              "$cmd" "${LAUNCHER_COMMANDS[*]}" >&2; exit 2; }
exec "$cmd" "$@"
