# The Python base for deploy/docker/Dockerfile where the public python:3.x-slim cannot be pulled:
# Debian bookworm's python3 (3.11). deploy/docker/image.sh builds it on the local Debian base.
ARG DEBIAN_IMAGE=localhost/outbox-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python-is-python3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
