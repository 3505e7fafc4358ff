# shellcheck shell=bash
# Writes server.properties from KAFKA_* variables, formats the storage once, then the broker as
# PID 1. KAFKA_HOST (127.0.0.1), KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093),
# KAFKA_ADVERTISED_HOST (KAFKA_HOST), KAFKA_LISTEN_HOST (KAFKA_HOST; 0.0.0.0 on a network).
# server.properties is the local services' (deploy/local/lib/kafka-props.sh, copied beside this
# file by deploy/docker/image.sh).
set -euo pipefail
# shellcheck source=SCRIPTDIR/../../local/lib/kafka-props.sh
. "$(dirname -- "${BASH_SOURCE[0]}")/kafka-props.sh"
host=${KAFKA_HOST:-127.0.0.1}
listen=${KAFKA_LISTEN_HOST:-$host}
advertised=${KAFKA_ADVERTISED_HOST:-$host}
port=${KAFKA_PORT:-9092}
controller=${KAFKA_CONTROLLER_PORT:-9093}
data=/var/lib/kafka/data
props=/var/lib/kafka/server.properties
cp="/opt/kafka/libs/*"
log4j=-Dlog4j2.configurationFile=/opt/kafka/log4j2.properties
kafka_properties node_id=1 "quorum=controller.quorum.bootstrap.servers=$advertised:$controller" \
  "listeners=PLAINTEXT://$listen:$port,CONTROLLER://$listen:$controller" \
  "advertised=PLAINTEXT://$advertised:$port,CONTROLLER://$advertised:$controller" \
  "data=$data" "auto_create=${KAFKA_AUTO_CREATE_TOPICS_ENABLE:-true}" >"$props"
if [[ ! -f $data/meta.properties ]]; then
  rm -rf "$data"
  id=$(java -cp "$cp" "$log4j" kafka.tools.StorageTool random-uuid | tail -n1)
  java -cp "$cp" "$log4j" kafka.tools.StorageTool format --standalone -t "$id" -c "$props" >/dev/null
fi
exec java -Xms256m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
  "$log4j" -Dkafka.logs.dir=/var/lib/kafka -cp "$cp" kafka.Kafka "$props"
