#!/usr/bin/env bash
# Local backing services for outbox-dispatcher development and CI:
#   * PostgreSQL (our own cluster, 127.0.0.1:5432, role/database "outbox")
#   * Kafka 4.x, single KRaft node (broker+controller), 127.0.0.1:9092
#   * PgBouncer (transaction pooling in front of that PostgreSQL), 127.0.0.1:6432
#
# Usage: deploy/local/services.sh COMMAND
#   start        start PostgreSQL, Kafka and PgBouncer (installing/fetching what is missing)
#   stop         stop PgBouncer, Kafka (with the cluster and the Kafka 3 broker), then PostgreSQL
#   status       report whether each service is up (exit 0 only if all are)
#   pg-start     | pg-stop      only PostgreSQL
#   pg-crash     PostgreSQL stopped immediately, as a crash (unflushed commits are lost)
#   kafka-start  | kafka-stop   only Kafka (tests use these to simulate an outage;
#                               kafka-start never reformats existing storage)
#   env          print the environment variables a test run needs
#   pgbouncer-start | pgbouncer-stop   only PgBouncer (transaction pooling in front of
#                               our PostgreSQL; `start` and `stop` include it)
#
# Multi-broker and Kafka 3.x tests (not part of `start`; the test suite starts them once per
# run when a test needs them):
#   cluster-start | cluster-stop | cluster-status
#                a three-node KRaft cluster (each node broker+controller, a 3-voter quorum,
#                default.replication.factor=3, min.insync.replicas=2), same jars as the single broker;
#                started with no node running, it starts empty (a test fixture: test topics only)
#   broker-stop N | broker-start N | broker-kill N
#                one node of that cluster (N = 1..3; kill = SIGKILL, no controlled shutdown)
#   broker-pause N | broker-resume N
#                SIGSTOP / SIGCONT one node: it stops answering and fetching, keeps its state
#   quorum-leader
#                the node id of the cluster's active controller (the KRaft quorum leader)
#   dump-log N TOPIC PARTITION
#                the record batches of a partition's log on node N as its broker wrote them
#                (kafka.tools.DumpLogSegments: offsets, producer id, epoch, base sequence)
#   cluster-env  print OUTBOX_CLUSTER_BOOTSTRAP_SERVERS=... for it, and OUTBOX_CLUSTER_PROXIED=
#                node:proxied_port:proxy_port,... (each node's PROXIED listener and its proxy)
#   kafka3-start | kafka3-stop   a single Kafka 3.x broker (deploy/local/kafka3/pom.xml)
#   kafka3-env   print OUTBOX_KAFKA3_BOOTSTRAP_SERVERS=... for it
#
# Every command is idempotent. Designed for a fresh Debian 12 machine, run as root
# (CI: from a fresh clone in any folder); no Docker involved.
#
# Environment:
#   OUTBOX_KAFKA_AUTO_CREATE=true|false  broker auto.create.topics.enable (default true)
#   OUTBOX_SERVICES_PG_PORT, OUTBOX_SERVICES_KAFKA_PORT, OUTBOX_SERVICES_KAFKA_CONTROLLER_PORT
#                                        ports (defaults 5432, 9092, 9093): a second clone can
#                                        run its own services beside the first
#   OUTBOX_SERVICES_KAFKA_SASL_PORT      SASL_PLAINTEXT listener (default Kafka port + 100)
#   OUTBOX_SERVICES_KAFKA_SASL_SSL_PORT  SASL_SSL listener (default Kafka port + 101)
#   OUTBOX_SERVICES_KAFKA_MTLS_PORT      SSL listener that requires a client certificate
#                                        (default Kafka port + 102)
#   OUTBOX_SERVICES_PG_SSL=on|off        TLS on the PostgreSQL cluster (default on; plain
#                                        connections keep working either way)
#   OUTBOX_SERVICES_PGBOUNCER_PORT       PgBouncer's port (default 6432)
#   OUTBOX_SERVICES_CLUSTER_PORT         the cluster's node 1 client port; node N uses +N-1
#                                        (default 29092, so 29092-29094)
#   OUTBOX_SERVICES_CLUSTER_CONTROLLER_PORT  node 1's controller port, node N +N-1
#                                        (default cluster port + 10, so 29102-29104)
#   OUTBOX_SERVICES_CLUSTER_PROXIED_PORT, OUTBOX_SERVICES_CLUSTER_PROXY_PORT
#                                        as KAFKA_PROXIED/PROXY_PORT, for each cluster node
#                                        (node N: +N-1; defaults cluster port + 30 and + 40,
#                                        so 29122-29124 and 29132-29134; PROXY_PORT=0 turns
#                                        the listeners off): a test runs one fault proxy per
#                                        node and can cut the client's path to one broker
#   OUTBOX_SERVICES_KAFKA3_PORT          the Kafka 3.x broker's client port (default 29112;
#                                        its controller uses +1)
#   OUTBOX_SERVICES_KAFKA_PROXIED_PORT, OUTBOX_SERVICES_KAFKA_PROXY_PORT
#                                        a second broker listener on PROXIED_PORT that
#                                        advertises 127.0.0.1:PROXY_PORT, where network-fault
#                                        tests run their proxy, so that every connection of a
#                                        client bootstrapped there goes through the proxy
#                                        (defaults KAFKA_PORT+10002 and +10003; PROXY_PORT=0
#                                        turns the listener off)
#
# Security test fixtures (docs/security.md), local development only:
#   Kafka SASL users: outbox_plain (PLAIN, JAAS), outbox_scram256 (SCRAM-SHA-256 only) and
#   outbox_scram512 (SCRAM-SHA-512 only); each password is the user name + "-secret".
#   TLS material in .services/tls/: ca.crt (the CA), server.crt/.key (127.0.0.1 and localhost;
#   the broker's SSL listeners and PostgreSQL), client.crt/.key (mutual TLS; also
#   client-encrypted.key, password outbox-key-secret), other-ca.crt (a CA that signed nothing
#   here, for "wrong CA" tests).
#
# State lives in <repo>/.services/ (git-ignored):
#   .services/pg/data         PostgreSQL data directory (server log in data/log/)
#   .services/pg/run          its unix socket directory
#   .services/kafka/libs      broker jars fetched by Maven from deploy/local/kafka/pom.xml
#   .services/kafka/data      Kafka log.dirs (KRaft metadata included)
#   .services/kafka/logs      broker log (kafka.log, previous run in kafka.log.1)
#   .services/tls             CA, server and client certificates (generated once)
#   .services/pgbouncer       PgBouncer's config, auth file, log and pid file
#   .services/cluster/nodeN   the cluster's node N: server.properties, data/, logs/kafka.log, pid
#                             (the jars are the single broker's, .services/kafka/libs)
#   .services/kafka3          the Kafka 3.x broker: libs/, data/, logs/kafka.log, pid
# If the postgres system user cannot reach <repo> (e.g. a clone under /root or in
# a 0700 temp dir), the PostgreSQL files live in
#   /var/lib/outbox-dispatcher-services/<hash of repo path>/pg/
# instead, and .services/pg/data is a symlink to it. We do not chmod the user's
# parent directories: that would silently widen access to e.g. /root.
#
# Output convention: progress goes to stderr; the only stdout output is the KEY=value lines of
# `start`/`env`/`cluster-env`/`kafka3-env` (so `set -a; . <(services.sh start); set +a` works),
# the status lines of `status`/`cluster-status` and the batches `dump-log` prints.
#
# Each service is a file of deploy/local/lib/, sourced here: common.sh (layout, output, process
# and port checks, lock, apt), tls.sh, postgres.sh, pgbouncer.sh, kafka-props.sh (server.properties
# of every Kafka node, the local Kafka image's too), broker.sh (a Kafka node: jars, start, wait,
# stop), kafka.sh (the single broker), cluster.sh and kafka3.sh.
set -Eeuo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
# shellcheck source=SCRIPTDIR/lib/common.sh
. "$SCRIPT_DIR/lib/common.sh"
# shellcheck source=SCRIPTDIR/lib/tls.sh
. "$SCRIPT_DIR/lib/tls.sh"
# shellcheck source=SCRIPTDIR/lib/postgres.sh
. "$SCRIPT_DIR/lib/postgres.sh"
# shellcheck source=SCRIPTDIR/lib/pgbouncer.sh
. "$SCRIPT_DIR/lib/pgbouncer.sh"
# shellcheck source=SCRIPTDIR/lib/kafka-props.sh
. "$SCRIPT_DIR/lib/kafka-props.sh"
# shellcheck source=SCRIPTDIR/lib/broker.sh
. "$SCRIPT_DIR/lib/broker.sh"
# shellcheck source=SCRIPTDIR/lib/kafka.sh
. "$SCRIPT_DIR/lib/kafka.sh"
# shellcheck source=SCRIPTDIR/lib/cluster.sh
. "$SCRIPT_DIR/lib/cluster.sh"
# shellcheck source=SCRIPTDIR/lib/kafka3.sh
. "$SCRIPT_DIR/lib/kafka3.sh"

print_env() {
  printf 'OUTBOX_DATABASE_URL=postgresql://%s:%s@%s:%s/%s\n' \
    "$PG_APP_USER" "$PG_APP_PASSWORD" "$PG_HOST" "$PG_PORT" "$PG_APP_DB" >&3
  printf 'OUTBOX_KAFKA_BOOTSTRAP_SERVERS=%s:%s\n' "$KAFKA_HOST" "$KAFKA_PORT" >&3
  printf 'OUTBOX_PGBOUNCER_DATABASE_URL=postgresql://%s:%s@%s:%s/%s\n' \
    "$PG_APP_USER" "$PG_APP_PASSWORD" "$PG_HOST" "$PGB_PORT" "$PG_APP_DB" >&3
}

usage() {
  sed -n '2,/^set -Eeuo/{/^set -Eeuo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
}

main() {
  local cmd=${1:-} rc=0
  case $cmd in
    start)       take_lock; pg_start; kafka_start; pgbouncer_start; print_env ;;
    stop)        take_lock; pgbouncer_stop; cluster_stop; kafka3_stop; kafka_stop; pg_stop ;;
    status)      pg_status || rc=1; kafka_status || rc=1; pgbouncer_status || rc=1; exit $rc ;;
    pgbouncer-start) take_lock; pgbouncer_start ;;
    pgbouncer-stop)  take_lock; pgbouncer_stop ;;
    pg-start)    take_lock; pg_start ;;
    pg-stop)     take_lock; pg_stop ;;
    pg-crash)    take_lock; pg_crash ;;
    kafka-start) take_lock; kafka_start ;;
    kafka-stop)  take_lock; kafka_stop ;;
    env)         print_env ;;
    cluster-start)  take_lock; cluster_start ;;
    cluster-stop)   take_lock; cluster_stop ;;
    cluster-status) cluster_status || rc=1; exit $rc ;;
    cluster-env)    cluster_env ;;
    broker-start)   take_lock; broker_start "${2:-}" ;;
    broker-stop)    take_lock; broker_stop "${2:-}" TERM ;;
    broker-kill)    take_lock; broker_stop "${2:-}" KILL ;;
    broker-pause)   broker_signal "${2:-}" STOP ;;
    broker-resume)  broker_signal "${2:-}" CONT ;;
    quorum-leader)  quorum_leader ;;
    dump-log)       dump_log "${2:-}" "${3:-}" "${4:-}" ;;
    kafka3-start)   take_lock; kafka3_start ;;
    kafka3-stop)    take_lock; kafka3_stop ;;
    kafka3-env)     kafka3_env ;;
    -h|--help|help) usage ;;
    *)           usage; exit 2 ;;
  esac
}

main "$@"
