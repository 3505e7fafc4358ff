# PostgreSQL 15 from Debian's package, for compose and the testcontainers path where the public
# postgres:15 image cannot be pulled. Takes the official image's POSTGRES_USER, POSTGRES_PASSWORD,
# POSTGRES_DB and PGPORT; the user is a superuser, as there.
ARG DEBIAN_IMAGE=localhost/outbox-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
 && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["bash", "/usr/local/bin/postgres-entrypoint.sh"]
