# A single-node KRaft Kafka for compose and the testcontainers path where the public
# apache/kafka image cannot be pulled: Debian's JRE and the broker jars Maven resolved from
# deploy/local/kafka/pom.xml, and the local services' server.properties (deploy/local/lib/kafka-props.sh);
# deploy/docker/image.sh puts them into the build context.
ARG DEBIAN_IMAGE=localhost/outbox-debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && groupadd --system --gid 1000 kafka \
 && useradd --system --uid 1000 --gid 1000 --home-dir /var/lib/kafka --create-home kafka
COPY libs /opt/kafka/libs
COPY log4j2.properties kafka-entrypoint.sh kafka-props.sh /opt/kafka/
USER 1000:1000
EXPOSE 9092 9093
ENTRYPOINT ["bash", "/opt/kafka/kafka-entrypoint.sh"]
