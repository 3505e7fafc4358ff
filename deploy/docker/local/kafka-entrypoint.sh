# Writes server.properties from KAFKA_* variables, formats the storage once, then the broker as
# PID 1. KAFKA_HOST (127.0.0.1), KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093),
# KAFKA_ADVERTISED_HOST (KAFKA_HOST), KAFKA_LISTEN_HOST (KAFKA_HOST; 0.0.0.0 on a network).
set -euo pipefail
host=${KAFKA_HOST:-127.0.0.1}
listen=${KAFKA_LISTEN_HOST:-$host}
advertised=${KAFKA_ADVERTISED_HOST:-$host}
port=${KAFKA_PORT:-9092}
controller=${KAFKA_CONTROLLER_PORT:-9093}
data=/var/lib/kafka/data
props=/var/lib/kafka/server.properties
cp="/opt/kafka/libs/*"
log4j=-Dlog4j2.configurationFile=/opt/kafka/log4j2.properties
cat >"$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$advertised:$controller
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$listen:$port,CONTROLLER://$listen:$controller
advertised.listeners=PLAINTEXT://$advertised:$port,CONTROLLER://$advertised:$controller
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$data
num.partitions=3
auto.create.topics.enable=${KAFKA_AUTO_CREATE_TOPICS_ENABLE:-true}
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
offsets.topic.num.partitions=10
transaction.state.log.num.partitions=10
group.initial.rebalance.delay.ms=0
PROPS
if [[ ! -f $data/meta.properties ]]; then
  rm -rf "$data"
  id=$(java -cp "$cp" "$log4j" kafka.tools.StorageTool random-uuid | tail -n1)
  java -cp "$cp" "$log4j" kafka.tools.StorageTool format --standalone -t "$id" -c "$props" >/dev/null
fi
exec java -Xms256m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
  "$log4j" -Dkafka.logs.dir=/var/lib/kafka -cp "$cp" kafka.Kafka "$props"
