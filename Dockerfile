# The one kvrelay image. Entrypoint `kvrelay`; the role is the first argument:
#   kvrelay operator | prefill | decode | gateway | serve | generate
# CPU build by default. For NVIDIA GPUs build with the matching torch wheel index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t kvrelay:gpu .
# The bundled stories260K model is linked at /opt/kvrelay/models/stories260K (see examples/).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its own index, so the project's dependency range is already satisfied.
RUN pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"
WORKDIR /src
# The locked runtime dependencies, exact versions checked against their sha256 hashes
# (requirements.lock, written by scripts/lock.sh from pyproject.toml's ranges; torch is above).
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps -r requirements.lock
# Only what the package needs (the build context may hold a .venv and caches).
COPY pyproject.toml README.md ./
COPY src ./src
COPY services ./services
COPY kernels ./kernels
COPY operator ./operator
COPY protos ./protos
RUN pip install --no-deps . \
 && pip check \
 && python -c "import kvrelay.operator.handlers, kvrelay.engine; from kvrelay.models import BUNDLED_MODEL; assert BUNDLED_MODEL.is_dir()"

FROM ${PYTHON_IMAGE}
# What the image holds, for `docker inspect` (scripts/docker-build.sh fills these in; `kvrelay env`
# inside a container prints the rest: every library's version, CUDA, CPU flags, native kernels, plugins).
ARG PYTHON_IMAGE
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG KVRELAY_VERSION=0.1.0
ARG LOCK_SHA256=unknown
ARG GIT_COMMIT=unknown
LABEL org.opencontainers.image.title="kvrelay" \
      org.opencontainers.image.version="${KVRELAY_VERSION}" \
      org.opencontainers.image.revision="${GIT_COMMIT}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      io.kvrelay.torch.version="${TORCH_VERSION}" \
      io.kvrelay.torch.index="${TORCH_INDEX_URL}" \
      io.kvrelay.requirements-lock.sha256="${LOCK_SHA256}"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
# A C compiler: on CPU the native kernels are compiled at first start for the node's own CPU
# (-march=native), into ~/.cache/kvrelay/kernels or $KVRELAY_KERNEL_CACHE. Without one, kvrelay
# falls back to the slower torch kernels and logs why.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/kvrelay kvrelay \
 && mkdir -p /opt/kvrelay/models \
 && ln -s "$(python -c 'from kvrelay.models import BUNDLED_MODEL; print(BUNDLED_MODEL)')" /opt/kvrelay/models/stories260K
USER 10001:10001
WORKDIR /home/kvrelay
# Worker gRPC, worker metrics, gateway HTTP, operator health.
EXPOSE 50051 9090 8000 8080
ENTRYPOINT ["kvrelay"]
CMD ["--help"]
