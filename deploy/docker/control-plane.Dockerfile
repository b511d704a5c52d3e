# pdgate control plane: pdgate-metaserver, pdgate-router, pdgate-ranktable and pdgate-sim in one image.
#
#   docker build -f deploy/docker/control-plane.Dockerfile -t pdgate/control-plane .
#
# Slim Python base, no compiler in the final image, runs as an unprivileged user. The same image runs
# the metaserver (default command), the router (command: pdgate-router) and simulated engines
# (entrypoint: pdgate-engine with PDGATE_ENGINE_FLAVOUR=sim).
ARG PYTHON_VERSION=3.12

# ---- stage 1: wheels for pdgate and every dependency (a compiler is available here if one is needed)
FROM python:${PYTHON_VERSION}-slim-bookworm AS wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY metaserver/ metaserver/
COPY router/ router/
COPY sim/ sim/
COPY connector/ connector/
COPY deploy/ deploy/
RUN pip wheel --wheel-dir /wheels .

# ---- stage 2: runtime
FROM python:${PYTHON_VERSION}-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-index --find-links /tmp/wheels pdgate \
    && rm -rf /tmp/wheels
COPY deploy/docker/healthcheck.py /usr/local/bin/pdgate-healthcheck
COPY deploy/docker/engine_cmd.py /usr/local/bin/pdgate-engine
RUN chmod 0755 /usr/local/bin/pdgate-healthcheck /usr/local/bin/pdgate-engine \
    && groupadd --system --gid 10001 pdgate \
    && useradd --system --uid 10001 --gid pdgate --no-create-home --shell /usr/sbin/nologin pdgate
USER pdgate:pdgate
WORKDIR /tmp
# The metaserver's default port; the router's is 8000 (compose sets both explicitly).
EXPOSE 8300 8000
ENV PDGATE_HOST=0.0.0.0 PDGATE_PORT=8300
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["pdgate-healthcheck"]
CMD ["pdgate-metaserver"]
