# ascend-finetune: full-parameter Qwen2.5 fine-tune on Atlas 800T A2 (8 x Ascend 910B),
# MindSpore 2.10 PyNative, launched with msrun. With no NPU it runs the embedded tiny CPU default.
#
#   make image                                     # docker if an engine answers, else buildah
#   docker run --rm IMAGE plan                     # see docs/running.md for the NPU flags
#
# BASE_IMAGE: a CANN 910B image with Python 3.11 (MindSpore 2.10 ships cp39-cp311 wheels). The default is
# jobspec/cann.py's DEFAULT, CANN 8.5.0, which every Ascend HDK 25.x driver runs (CANN 8.5.0 release notes:
# HDK 25.0.X-25.5.X), so it matches the drivers 800T A2 hosts run today; CANN 9.x is a build argument away
# (make image BASE_IMAGE=ascendai/cann:9.1.0-beta.3-910b-ubuntu22.04-py3.11: driver 25.2+). jobspec/cann.py
# holds each CANN line's oldest driver with its source; the build records the base's CANN version
# (/etc/ascend-finetune/cann-version) and preflight compares it with the host driver, naming the rebuild
# command when they do not match. No version table searched held a MindSpore 2.10 row (MindFormers pairs
# MindSpore 2.7.2 with CANN 8.5.0 and 2.9.0 with CANN 9.0.0): confirm against mindspore.cn/install. Tags
# <cann>-910b-<os>-py<ver> as Ascend/cann-container-image publishes them (Docker Hub ascendai/cann,
# quay.io/ascend/cann). Those images put Python in /usr/local/python3.11.x (on PATH, no /usr/bin/python3)
# and their entrypoint sources the CANN scripts, as entrypoint.sh does.
# `make image-test` builds this file on a local CANN-shaped base (tools/image/base.sh).
ARG BASE_IMAGE=ascendai/cann:8.5.0-910b-ubuntu22.04-py3.11
FROM ${BASE_IMAGE}

# Build-time only, never stored in a layer: PIP_CERT is the path of a CA bundle the builder mounts
# for the RUN steps (buildah bud --volume /etc/ssl/certs/ca-certificates.crt:/run/pip-ca.crt:ro
# --build-arg PIP_CERT=/run/pip-ca.crt); PIP_FIND_LINKS / PIP_NO_INDEX point pip at a mounted
# wheel directory (tools/image/wheels.sh) to install offline. Empty values are unset before pip runs.
# MINDSPORE_WHEEL: the MindSpore wheel for the target architecture, a URL or a path inside the
# build (tools/image/build.sh mounts a local file). PyPI's mindspore 2.10.0 is tagged py3-none-any
# but holds x86-64 libraries: without MINDSPORE_WHEEL an aarch64 build (Atlas 800T A2) takes the
# linux_aarch64 wheel for the image's Python from MindSpore's release repository
# (tools/image/mindspore_wheel.py); when that cannot be fetched the build stops naming the file to supply.
ARG BASE_IMAGE
ARG PIP_CERT=""
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX=""
ARG MINDSPORE_WHEEL=""

# PATH extends the base's: the CANN images reach Python (/usr/local/python3.11.x/bin) and the
# toolkit's tools only through it, and have no /usr/bin/python3.
ENV APP_DIR=/opt/ascend-finetune \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    OUTPUT_DIR=/output

# Metadata first: with vfs storage (buildah, CI) every step after the big layers copies them again.
WORKDIR ${APP_DIR}
ENTRYPOINT ["/opt/ascend-finetune/entrypoint.sh"]
CMD ["train"]

# msrun finds the local node with `ip -j addr` (iproute2); NUMA binding uses numactl; MindSpore's
# CPU kernels need libgomp: installed only where the base lacks them. The venv sees the base
# image's site-packages, where CANN's Python parts (te, hccl and their deps) live.
RUN missing=""; \
    command -v ip >/dev/null 2>&1 || missing="$missing iproute2"; \
    command -v numactl >/dev/null 2>&1 || missing="$missing numactl"; \
    ldconfig -p | grep -q 'libgomp\.so\.1' || missing="$missing libgomp1"; \
    if [ -n "$missing" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv --system-site-packages "$VIRTUAL_ENV" \
    && mkdir -p /output

# Pinned dependencies first: this layer (the ~800 MB mindspore wheel) is rebuilt only when
# pyproject.toml changes.
COPY pyproject.toml tools/image/deps.py tools/image/mindspore_wheel.py /tmp/deps/
RUN [ -n "$PIP_CERT" ] || unset PIP_CERT; [ -n "$PIP_FIND_LINKS" ] || unset PIP_FIND_LINKS; \
    [ -n "$PIP_NO_INDEX" ] || unset PIP_NO_INDEX; \
    python /tmp/deps/deps.py /tmp/deps/pyproject.toml > /tmp/deps/requirements.txt \
    && ms="$(python /tmp/deps/mindspore_wheel.py /tmp/deps/pyproject.toml "$MINDSPORE_WHEEL")" \
    && { python -m pip install --quiet ${ms:+"$ms"} -r /tmp/deps/requirements.txt \
         || python /tmp/deps/mindspore_wheel.py /tmp/deps/pyproject.toml "$MINDSPORE_WHEEL" --failed; } \
    && rm -rf /tmp/deps

# The project itself, editable so that recipes/ and assets/ resolve next to the code.
COPY . ${APP_DIR}
RUN [ -n "$PIP_CERT" ] || unset PIP_CERT; [ -n "$PIP_FIND_LINKS" ] || unset PIP_FIND_LINKS; \
    [ -n "$PIP_NO_INDEX" ] || unset PIP_NO_INDEX; \
    python -m pip install --quiet --no-deps -e "$APP_DIR" \
    && chmod 0755 "$APP_DIR/entrypoint.sh" \
    && python -m jobspec.native \
    && python -m jobspec.cann record "$BASE_IMAGE" \
    && python -c "import mindspore, jobspec.config, launcher; print('mindspore', mindspore.__version__)"
