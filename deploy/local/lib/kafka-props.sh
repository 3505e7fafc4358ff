# shellcheck shell=bash
# The server.properties of a KRaft node that is both broker and controller, written once for the
# single broker (lib/kafka.sh), the cluster's nodes (lib/cluster.sh), the Kafka 3.x broker
# (lib/kafka3.sh) and the local Kafka image (deploy/docker/local/kafka-entrypoint.sh, which
# sources this file alone: it uses nothing else of services.sh).

# kafka_properties NAME=VALUE...: print it. Names, with their defaults:
#   node_id (1)
#   quorum               the whole controller.quorum.* line: bootstrap.servers for a dynamic
#                        quorum (storage formatted with --standalone), voters for a static one
#   listeners, advertised  listeners and advertised.listeners
#   protocols            listener.security.protocol.map (CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT)
#   data                 log.dirs
#   auto_create          auto.create.topics.enable (true)
#   replicas             replication factor of every topic, the internal ones included (1)
#   min_isr              (replicas - 1, at least 1)
#   internal_partitions  partitions of the offsets and transaction state topics (10)
#   share_groups         true: also size the share coordinator's topic (Kafka 4.x; false for 3.x)
#   extra                more lines, written last
kafka_properties() {
  local arg
  for arg; do
    case ${arg%%=*} in
      node_id|quorum|listeners|advertised|protocols|data|auto_create|replicas|min_isr) ;;
      internal_partitions|share_groups|extra) ;;
      *) printf 'kafka_properties: unknown name in %s\n' "$arg" >&2; return 2 ;;
    esac
  done
  local node_id=1 quorum='' listeners='' advertised='' data='' auto_create=true replicas=1
  local protocols=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT min_isr='' internal_partitions=10
  local share_groups=true extra=''
  local "$@"
  for arg in quorum listeners advertised data; do
    [[ -n ${!arg} ]] || { printf 'kafka_properties: %s is required\n' "$arg" >&2; return 2; }
  done
  [[ -n $min_isr ]] || min_isr=$(( replicas > 1 ? replicas - 1 : 1 ))
  cat <<EOF
process.roles=broker,controller
node.id=$node_id
$quorum
controller.listener.names=CONTROLLER
listeners=$listeners
advertised.listeners=$advertised
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols

log.dirs=$data
num.partitions=3
auto.create.topics.enable=$auto_create

default.replication.factor=$replicas
min.insync.replicas=$min_isr
offsets.topic.replication.factor=$replicas
transaction.state.log.replication.factor=$replicas
transaction.state.log.min.isr=$min_isr
EOF
  if [[ $share_groups == true ]]; then
    printf 'share.coordinator.state.topic.replication.factor=%s\n' "$replicas"
    printf 'share.coordinator.state.topic.min.isr=%s\n' "$min_isr"
  fi
  cat <<EOF
# Fewer internal partitions than the default 50: the first consumer group or transaction on a
# fresh broker comes up noticeably faster on a 2-core box.
offsets.topic.num.partitions=$internal_partitions
transaction.state.log.num.partitions=$internal_partitions
# Tests start consumer groups constantly; don't wait 3 s for more members.
group.initial.rebalance.delay.ms=0
EOF
  [[ -z $extra ]] || printf '%s\n' "$extra"
}
