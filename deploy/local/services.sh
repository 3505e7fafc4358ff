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
# Output convention: progress goes to stderr; the only stdout output is the
# KEY=value lines of `start`/`env`, so `set -a; . <(services.sh start); set +a` works.
set -Eeuo pipefail

# ---------------------------------------------------------------------------
# Layout and constants
# ---------------------------------------------------------------------------
# Everything is derived from this file's location so the script works from any
# clone path (CI uses a fresh clone in an arbitrary folder).
SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
REPO_ROOT=$(cd -- "$SCRIPT_DIR/../.." && pwd -P)
STATE_DIR="$REPO_ROOT/.services"
# Short, stable per-clone id, used for state kept outside the repo.
REPO_HASH=$(printf '%s' "$REPO_ROOT" | sha256sum | cut -c1-12)

PG_HOST=127.0.0.1
PG_PORT=${OUTBOX_SERVICES_PG_PORT:-5432}
PG_APP_USER=outbox
PG_APP_PASSWORD=outbox
PG_APP_DB=outbox
PG_FALLBACK_ROOT=/var/lib/outbox-dispatcher-services
PG_IN_REPO="$STATE_DIR/pg"

KAFKA_HOST=127.0.0.1
KAFKA_PORT=${OUTBOX_SERVICES_KAFKA_PORT:-9092}
KAFKA_CONTROLLER_PORT=${OUTBOX_SERVICES_KAFKA_CONTROLLER_PORT:-9093}
# +100: other clones' main ports are commonly 10 apart (9092, 9102, ...).
KAFKA_SASL_PORT=${OUTBOX_SERVICES_KAFKA_SASL_PORT:-$((KAFKA_PORT + 100))}
KAFKA_SASL_SSL_PORT=${OUTBOX_SERVICES_KAFKA_SASL_SSL_PORT:-$((KAFKA_PORT + 101))}
KAFKA_MTLS_PORT=${OUTBOX_SERVICES_KAFKA_MTLS_PORT:-$((KAFKA_PORT + 102))}
KAFKA_PLAIN_USER=outbox_plain
KAFKA_SCRAM256_USER=outbox_scram256
KAFKA_SCRAM512_USER=outbox_scram512
# Marks storage that holds the SCRAM users (formatted with them, or added to an older storage).
KAFKA_SCRAM_STAMP_NAME=outbox-scram-users
KAFKA_PROXIED_PORT=${OUTBOX_SERVICES_KAFKA_PROXIED_PORT:-$((KAFKA_PORT + 10002))}
KAFKA_PROXY_PORT=${OUTBOX_SERVICES_KAFKA_PROXY_PORT:-$((KAFKA_PORT + 10003))}
KAFKA_POM="$SCRIPT_DIR/kafka/pom.xml"
KAFKA_LOG4J="$SCRIPT_DIR/kafka/log4j2.properties"
KAFKA_DIR="$STATE_DIR/kafka"
KAFKA_LIBS="$KAFKA_DIR/libs"
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_LOGS="$KAFKA_DIR/logs"
KAFKA_LOG="$KAFKA_LOGS/kafka.log"
KAFKA_PROPS="$KAFKA_DIR/server.properties"
KAFKA_PIDFILE="$KAFKA_DIR/kafka.pid"
KAFKA_START_TIMEOUT=90
KAFKA_STOP_TIMEOUT=30
TLS_DIR="$STATE_DIR/tls"
TLS_DAYS=3650
TLS_CLIENT_KEY_PASSWORD=outbox-key-secret
TLS_KEYSTORE_PASSWORD=outbox-keystore-secret
PG_SSL=${OUTBOX_SERVICES_PG_SSL:-on}
# Heap sized for a 2-core CI box that also runs PostgreSQL and the test suite.
# G1 flags are the ones Kafka's own kafka-run-class.sh uses.
KAFKA_JVM_OPTS=(
  -Xms256m -Xmx768m
  -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35
  -XX:+ExplicitGCInvokesConcurrent
  -Djava.awt.headless=true
  "-Dlog4j2.configurationFile=$KAFKA_LOG4J"
  "-Dkafka.logs.dir=$KAFKA_LOGS"
)

# Keep the real stdout on fd 3 for the env lines; everything else goes to stderr.
exec 3>&1 1>&2

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }
# -E makes this fire inside functions too; report once (not again from every
# enclosing subshell) with the call chain, which says which step failed.
trap 'rc=$?; [[ $BASH_SUBSHELL -eq 0 ]] && log "failed (exit $rc) at line $LINENO in ${FUNCNAME[*]:-main}: $BASH_COMMAND"' ERR

is_root() { [[ $EUID -eq 0 ]]; }

# Called in a subshell right before exec'ing something long-lived (postgres via
# pg_ctl, the Kafka JVM). Closes every inherited descriptor above stderr: our
# fd 3 (the caller's stdout), the lock on fd 9, and anything the caller leaked
# to us. A daemon holding the write end of a CI runner's or a test harness's
# output pipe would make it wait for EOF forever.
close_inherited_fds() {
  local fd
  for fd in "/proc/$BASHPID/fd/"*; do
    fd=${fd##*/}
    if (( fd > 2 )); then eval "exec $fd>&-"; fi
  done
}

# True if something accepts TCP connections on host:port. Pure bash so that no
# extra package (ss, nc) is needed on a fresh machine.
port_open() {
  timeout 2 bash -c "exec 7<>/dev/tcp/$1/$2" 2>/dev/null
}

# `kill -0` also succeeds for a zombie, and on container-like machines whose
# PID 1 reaps orphans lazily a dead daemon can linger as one for a while.
pid_alive() {
  local stat
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

pid_comm() {
  local comm
  { read -r comm <"/proc/$1/comm"; } 2>/dev/null || return 1
  printf '%s' "$comm"
}

# Serialise concurrent invocations (e.g. two terminals, or a test restarting
# Kafka while someone runs `start`): the steps below are check-then-act.
take_lock() {
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock 9
}

apt_updated=0
apt_install() {
  is_root || die "missing packages ($*); run as root or install them: apt-get install $*"
  export DEBIAN_FRONTEND=noninteractive
  if [[ $apt_updated -eq 0 ]]; then
    log "apt-get update"
    apt-get update -q
    apt_updated=1
  fi
  log "apt-get install $*"
  apt-get install -y -q -o Dpkg::Use-Pty=0 --no-install-recommends "$@"
}

# ---------------------------------------------------------------------------
# TLS material (local CA, server and client certificates)
# ---------------------------------------------------------------------------
# Generated once into .services/tls/ by openssl; everything is built in a temp
# directory and renamed, so an interrupted run never leaves half a set. EC P-256
# keys: quick to generate on a small CI box, accepted by Java, OpenSSL and Python.
tls_ensure() {
  [[ -f $TLS_DIR/.complete ]] && return 0
  command -v openssl >/dev/null || apt_install openssl
  local tmp="$TLS_DIR.tmp"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  log "generating TLS material in $TLS_DIR (CA, server and client certificates)"
  (
    cd "$tmp"
    umask 077
    tls_make_ca ca "outbox-dispatcher local development CA"
    tls_make_ca other-ca "outbox-dispatcher untrusted CA (signs nothing here)"
    tls_make_leaf server localhost "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
    tls_make_leaf client outbox-dispatcher "extendedKeyUsage=clientAuth"
    openssl pkcs8 -topk8 -in client.key -out client-encrypted.key \
      -passout "pass:$TLS_CLIENT_KEY_PASSWORD" 2>/dev/null
    # The broker's keystore: key, its certificate and the CA, as PKCS#12 (Java reads it natively).
    openssl pkcs12 -export -in server.crt -inkey server.key -certfile ca.crt -name broker \
      -out broker.p12 -passout "pass:$TLS_KEYSTORE_PASSWORD"
    rm -f ./*.csr ./*.srl
    # Certificates are public; keys stay 0600 (the user running the tests reads them).
    chmod 0644 ./*.crt
    touch .complete
  )
  chmod 0755 "$tmp"
  rm -rf "$TLS_DIR"
  mv "$tmp" "$TLS_DIR"
}

# tls_make_ca NAME COMMON_NAME: a self-signed CA in NAME.crt / NAME.key.
tls_make_ca() {
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.crt" -days "$TLS_DAYS" -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
}

# tls_make_leaf NAME COMMON_NAME EXTENSIONS: a key and a certificate signed by ca.
tls_make_leaf() {
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -set_serial "0x$(openssl rand -hex 16)" \
    -days "$TLS_DAYS" -sha256 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.ext"
}

# ---------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------
# PostgreSQL refuses to run as root, so as root the cluster belongs to the
# `postgres` system user created by Debian's package. As a normal user it is
# simply run as that user.
if is_root; then PG_OS_USER=postgres; else PG_OS_USER=$(id -un); fi
PG_SUPERUSER=$PG_OS_USER   # peer authentication maps OS user -> same-named role

# Run a command as the cluster owner. `cd /` because the caller's cwd (e.g. a
# clone under /root) may not be accessible to postgres.
as_pg() {
  if is_root; then
    (cd / && runuser -u "$PG_OS_USER" -- "$@")
  else
    (cd / && "$@")
  fi
}

# as_pg for commands that leave a daemon behind (pg_ctl start/reload).
as_pg_detached() {
  (close_inherited_fds; as_pg "$@")
}

pg_server_installed() { compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; }

pg_ensure_installed() {
  if ! pg_server_installed; then
    apt_install postgresql
    pg_server_installed || die "postgresql installed but no /usr/lib/postgresql/*/bin/postgres found"
  fi
}

# Pick the binaries: the version the data directory was created with, if any,
# otherwise the newest installed one.
pg_pick_bindir() {
  local ver=""
  if [[ -n ${PGDATA:-} && -f $PGDATA/PG_VERSION ]]; then
    ver=$(<"$PGDATA/PG_VERSION")
    [[ -x /usr/lib/postgresql/$ver/bin/postgres ]] \
      || die "data directory $PGDATA was created by PostgreSQL $ver, whose server binaries are not installed (apt-get install postgresql-$ver)"
  else
    ver=$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/postgres' 2>/dev/null \
          | awk -F/ '{print $5}' | sort -V | tail -n1)
    [[ -n $ver ]] || die "no PostgreSQL server binaries under /usr/lib/postgresql"
  fi
  PG_BIN="/usr/lib/postgresql/$ver/bin"
}

# Decide where the cluster lives (see header). The decision is made once, when
# the cluster is first created, and recorded by what .services/pg/data is (a
# directory, or a symlink to the fallback location), so it cannot flip later.
# With "create", missing directories are created; without, nothing is touched and
# PGDATA may not exist.
pg_resolve_paths() {
  local mode=${1:-}
  local link="$PG_IN_REPO/data" base
  if [[ -L $link ]]; then
    local target
    target=$(readlink "$link")
    base=$(dirname "$target")
  elif [[ -d $link ]]; then
    base=$PG_IN_REPO
  elif [[ $mode == create ]]; then
    mkdir -p "$PG_IN_REPO"
    # Our own directories; a umask of 077 must not lock postgres out of them.
    chmod 0755 "$STATE_DIR" "$PG_IN_REPO"
    if as_pg test -x "$PG_IN_REPO"; then
      base=$PG_IN_REPO
    else
      base="$PG_FALLBACK_ROOT/$REPO_HASH/pg"
      log "user $PG_OS_USER cannot reach $PG_IN_REPO; keeping PostgreSQL files in $base"
      mkdir -p "$base"
      chmod 0755 "$PG_FALLBACK_ROOT" "$PG_FALLBACK_ROOT/$REPO_HASH" "$base"
      printf '%s\n' "$REPO_ROOT" >"$PG_FALLBACK_ROOT/$REPO_HASH/repo-path"
      ln -sfn "$base/data" "$link"
    fi
  else
    base=$PG_IN_REPO
  fi
  PGDATA="$base/data"
  # Unix socket paths are limited to ~107 bytes; deep clone paths would exceed it.
  PG_SOCKET_DIR="$base/run"
  if (( ${#PG_SOCKET_DIR} + ${#PG_PORT} + 10 > 100 )); then
    PG_SOCKET_DIR="/tmp/outbox-dispatcher-pg-$REPO_HASH"
  fi
  if [[ $mode == create ]]; then
    mkdir -p "$PGDATA" "$PG_SOCKET_DIR"
    if is_root; then chown "$PG_OS_USER:" "$PGDATA" "$PG_SOCKET_DIR"; fi
    chmod 0700 "$PGDATA"
    chmod 0755 "$PG_SOCKET_DIR"
  fi
}

pg_postmaster_pid() {
  [[ -f $PGDATA/postmaster.pid ]] || return 1
  head -n1 "$PGDATA/postmaster.pid"
}

# Stricter than `pg_ctl status`, which trusts any live pid in postmaster.pid
# (including a zombie, or an unrelated process that reused the pid after a reboot).
pg_running() {
  local pid
  pid=$(pg_postmaster_pid 2>/dev/null) || return 1
  pid_alive "$pid" && [[ $(pid_comm "$pid") == postgres ]]
}

# Called when pg_running says no but postmaster.pid exists. PostgreSQL refuses to
# start while the recorded pid is "alive", so wait for a killed postmaster's
# zombie to be reaped, and drop the file if the pid now belongs to another program.
pg_clear_stale_pidfile() {
  local pid _
  pid=$(pg_postmaster_pid 2>/dev/null) || return 0
  for _ in {1..50}; do
    if [[ -e /proc/$pid ]] && ! pid_alive "$pid"; then sleep 0.2; else break; fi
  done
  if pid_alive "$pid" && [[ $(pid_comm "$pid") != postgres ]]; then
    log "removing stale postmaster.pid (pid $pid is now $(pid_comm "$pid"))"
    rm -f "$PGDATA/postmaster.pid"
  fi
}

# Debian's package creates a default cluster (15/main) on port 5432 and may
# start it. It would take our port, so stop it and keep it from auto-starting.
pg_disable_debian_clusters() {
  is_root || return 0
  command -v pg_lsclusters >/dev/null || return 0
  local ver name port status _rest
  while read -r ver name port status _rest; do
    [[ $port == "$PG_PORT" ]] || continue
    if [[ $status == online* ]]; then
      log "stopping Debian's PostgreSQL cluster $ver/$name (it occupies port $PG_PORT)"
      pg_ctlcluster "$ver" "$name" stop -m fast || true
    fi
    local startconf="/etc/postgresql/$ver/$name/start.conf"
    if [[ -f $startconf ]] && grep -qx 'auto' "$startconf"; then
      log "setting Debian cluster $ver/$name to manual start"
      sed -i 's/^auto$/manual/' "$startconf"
    fi
  done < <(pg_lsclusters --no-header 2>/dev/null || true)
}

pg_initdb() {
  log "initialising PostgreSQL cluster in $PGDATA"
  as_pg "$PG_BIN/initdb" -D "$PGDATA" -U "$PG_SUPERUSER" -E UTF8 --locale=C.UTF-8 \
    --auth-local=peer --auth-host=scram-sha-256 >/dev/null
  # Our settings live in a separate file (rewritten on every start) so that
  # postgresql.conf stays as initdb wrote it; the include must be last to win.
  printf "\n# Settings for local development, managed by deploy/local/services.sh\ninclude_if_exists = 'outbox-dev.conf'\n" \
    >>"$PGDATA/postgresql.conf"
}

# Write $2 to file $1 (owned by the cluster owner) only if it differs.
# Returns 0 when the file changed.
pg_write_file() {
  local file=$1 content=$2
  if [[ -f $file ]] && [[ "$(<"$file")" == "$content" ]]; then return 1; fi
  printf '%s\n' "$content" >"$file"
  if is_root; then chown "$PG_OS_USER:" "$file"; fi
  chmod 0600 "$file"
  return 0
}

# TLS for PostgreSQL: the server certificate of .services/tls/, copied into the data
# directory (the server needs its key owned by the cluster owner, mode 0600). ssl=on
# does not refuse plain connections (pg_hba has `host` lines, not `hostssl`), so
# sslmode=disable still works; clients on the default sslmode=prefer get TLS.
# Sets ssl_lines; returns 0 when a certificate file changed.
pg_ssl_config() {
  local changed=1
  case ${PG_SSL,,} in
    on|true|1)
      # tls_ensure ran in pg_start: errexit does not apply in here (called in a condition).
      pg_write_file "$PGDATA/server.crt" "$(<"$TLS_DIR/server.crt")" && changed=0
      pg_write_file "$PGDATA/server.key" "$(<"$TLS_DIR/server.key")" && changed=0
      ssl_lines=$(printf "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'") ;;
    off|false|0) ssl_lines='ssl = off' ;;
    *) die "OUTBOX_SERVICES_PG_SSL must be on or off, got '$PG_SSL'" ;;
  esac
  return $changed
}

pg_write_config() {
  local changed=1 ssl_lines=''
  pg_ssl_config && changed=0
  pg_write_file "$PGDATA/outbox-dev.conf" "\
# Managed by deploy/local/services.sh; rewritten on every pg-start.
# Tuned for a development/test box: many short-lived test connections and
# schema-heavy tests (max_locks_per_transaction). Durability settings are left
# at their defaults so behaviour matches production.
listen_addresses = '$PG_HOST'
port = $PG_PORT
unix_socket_directories = '$PG_SOCKET_DIR'
max_connections = 300
shared_buffers = 256MB
max_locks_per_transaction = 256
password_encryption = 'scram-sha-256'
logging_collector = on
log_directory = 'log'
log_filename = 'postgresql-%a.log'
log_truncate_on_rotation = on
log_rotation_age = 1d
log_rotation_size = 0
log_line_prefix = '%m [%p] %q%u@%d '
$ssl_lines" && changed=0

  pg_write_file "$PGDATA/pg_hba.conf" "\
# Managed by deploy/local/services.sh; rewritten on every pg-start.
# TYPE  DATABASE  USER           ADDRESS        METHOD
local   all       $PG_SUPERUSER                 peer
local   all       all                           scram-sha-256
host    all       all            127.0.0.1/32   scram-sha-256
host    all       all            ::1/128        scram-sha-256" && changed=0
  return $changed
}

pg_wait_ready() {
  local deadline=$((SECONDS + 60))
  until "$PG_BIN/pg_isready" -q -h "$PG_HOST" -p "$PG_PORT"; do
    (( SECONDS < deadline )) || die "PostgreSQL not ready after 60 s; see $PGDATA/log/"
    sleep 0.5
  done
}

pg_ensure_app_role_and_db() {
  # Re-applying the password/attributes keeps a known state even if a test
  # changed them. CREATEROLE: the least-privilege tests create roles (schema/roles.sql).
  as_pg "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCKET_DIR" -p "$PG_PORT" \
    -U "$PG_SUPERUSER" -d postgres <<SQL
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$PG_APP_USER') THEN
    CREATE ROLE $PG_APP_USER LOGIN PASSWORD '$PG_APP_PASSWORD' CREATEDB CREATEROLE;
  ELSE
    ALTER ROLE $PG_APP_USER LOGIN PASSWORD '$PG_APP_PASSWORD' CREATEDB CREATEROLE;
  END IF;
END
\$\$;
SELECT 'CREATE DATABASE $PG_APP_DB OWNER $PG_APP_USER'
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$PG_APP_DB') \gexec
ALTER DATABASE $PG_APP_DB OWNER TO $PG_APP_USER;
SQL
}

pg_start() {
  pg_ensure_installed
  pg_resolve_paths create
  pg_pick_bindir
  tls_ensure
  if pg_running; then
    if pg_write_config; then
      log "PostgreSQL config changed; reloading (settings needing a restart apply after pg-stop + pg-start)"
      as_pg "$PG_BIN/pg_ctl" reload -D "$PGDATA" -s
    fi
    log "PostgreSQL already running ($PGDATA)"
  else
    [[ -f $PGDATA/PG_VERSION ]] || pg_initdb
    pg_write_config || true
    pg_disable_debian_clusters
    pg_clear_stale_pidfile
    if port_open "$PG_HOST" "$PG_PORT"; then
      die "port $PG_HOST:$PG_PORT is in use by another process (not our cluster in $PGDATA); stop it first"
    fi
    log "starting PostgreSQL ($PG_BIN, data $PGDATA)"
    # -l: early startup errors, before the logging collector takes over.
    as_pg_detached "$PG_BIN/pg_ctl" start -D "$PGDATA" -l "$PGDATA/pg_ctl.log" -w -t 60 -s \
      || die "PostgreSQL failed to start; see $PGDATA/pg_ctl.log and $PGDATA/log/"
  fi
  pg_wait_ready
  pg_ensure_app_role_and_db
  log "PostgreSQL ready on $PG_HOST:$PG_PORT (database $PG_APP_DB, user $PG_APP_USER)"
}

pg_stop() {
  pg_resolve_paths
  if [[ ! -f $PGDATA/PG_VERSION ]]; then
    log "PostgreSQL: no cluster initialised ($PGDATA)"
    return 0
  fi
  pg_pick_bindir
  if pg_running; then
    log "stopping PostgreSQL"
    as_pg "$PG_BIN/pg_ctl" stop -D "$PGDATA" -m fast -w -t 60 -s
  else
    log "PostgreSQL not running"
  fi
}

pg_status() {
  pg_resolve_paths
  if [[ -f $PGDATA/PG_VERSION ]]; then
    pg_pick_bindir
    if pg_running && "$PG_BIN/pg_isready" -q -h "$PG_HOST" -p "$PG_PORT"; then
      local pid
      pid=$(pg_postmaster_pid)
      printf 'postgresql: up   (pid %s, %s:%s, data %s)\n' "$pid" "$PG_HOST" "$PG_PORT" "$PGDATA" >&3
      return 0
    fi
  fi
  printf 'postgresql: down (data %s)\n' "$PGDATA" >&3
  return 1
}

# ---------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------
# A pid is our broker if it is a JVM running kafka.Kafka with *this clone's*
# server.properties (guards against pid reuse and against other clones' brokers).
# Builtins first so that scanning /proc stays cheap.
kafka_is_our_pid() {
  local pid=$1
  [[ $(pid_comm "$pid") == java ]] || return 1
  grep -qzxF -e kafka.Kafka "/proc/$pid/cmdline" 2>/dev/null \
    && grep -qzxF -e "$KAFKA_PROPS" "/proc/$pid/cmdline" 2>/dev/null
}

# Prints the broker's pid. Falls back to scanning /proc (cheap) in case the pid
# file was lost, so `stop` never leaves an orphan broker holding the port.
kafka_pid() {
  local pid d
  if [[ -f $KAFKA_PIDFILE ]]; then
    pid=$(<"$KAFKA_PIDFILE")
    if kafka_is_our_pid "$pid"; then echo "$pid"; return 0; fi
  fi
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    if kafka_is_our_pid "$pid"; then echo "$pid"; return 0; fi
  done
  return 1
}

kafka_ensure_java() {
  command -v java >/dev/null || apt_install openjdk-17-jre-headless
}

# Fetch the broker jars with Maven unless the copy matches the current pom.xml.
# Copied into a temp dir and renamed, so an interrupted download never leaves a
# half-filled libs/ that would be mistaken for a complete one.
kafka_ensure_libs() {
  local pom=${1:-$KAFKA_POM} libs=${2:-$KAFKA_LIBS} logs=${3:-$KAFKA_LOGS}
  local stamp
  stamp=$(sha256sum "$pom" | cut -c1-64)
  if [[ -f $libs/.pom.sha256 && "$(<"$libs/.pom.sha256")" == "$stamp" ]]; then
    return 0
  fi
  command -v mvn >/dev/null || apt_install maven
  local tmp="$libs.tmp"
  rm -rf "$tmp"
  mkdir -p "$logs"
  log "fetching Kafka jars with Maven ($pom; log $logs/maven.log)"
  mvn -B -f "$pom" dependency:copy-dependencies -DoutputDirectory="$tmp" \
      >"$logs/maven.log" 2>&1 9>&- \
    || { tail -n 40 "$logs/maven.log" >&2; die "Maven could not fetch the Kafka jars; see $logs/maven.log"; }
  printf '%s\n' "$stamp" >"$tmp/.pom.sha256"
  rm -rf "$libs"
  mv "$tmp" "$libs"
}

kafka_auto_create_setting() {
  local v=${OUTBOX_KAFKA_AUTO_CREATE:-true}
  v=${v,,}
  case $v in
    true|false) printf '%s' "$v" ;;
    *) die "OUTBOX_KAFKA_AUTO_CREATE must be true or false, got '$OUTBOX_KAFKA_AUTO_CREATE'" ;;
  esac
}

# The PROXIED listener (see header): listens on one port, advertises the fault proxy's.
kafka_proxied_listener() {
  [[ $KAFKA_PROXY_PORT == 0 ]] || printf ',PROXIED://%s:%s' "$KAFKA_HOST" "$1"
}

kafka_write_props() {
  local auto_create=$1
  # Rewritten on every start so env changes (auto-create) take effect; the
  # cluster id lives in data/meta.properties, not here.
  cat >"$KAFKA_PROPS" <<EOF
# Generated by deploy/local/services.sh on every kafka-start; edit the script, not this file.
# Single-node KRaft cluster: this process is both broker and (sole) controller.
process.roles=broker,controller
node.id=1
# Kafka 4.x dynamic quorum; the storage is formatted with --standalone.
controller.quorum.bootstrap.servers=$KAFKA_HOST:$KAFKA_CONTROLLER_PORT
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT,$(kafka_secure_listeners)$(kafka_proxied_listener "$KAFKA_PROXIED_PORT")
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA_CONTROLLER_PORT,$(kafka_secure_listeners)$(kafka_proxied_listener "$KAFKA_PROXY_PORT")
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL,MTLS:SSL,PROXIED:PLAINTEXT
$(kafka_security_props)

log.dirs=$KAFKA_DATA
num.partitions=3
auto.create.topics.enable=$auto_create

# One broker: every internal topic must make do with a single replica.
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Fewer internal partitions than the default 50: the first consumer group /
# transaction on a fresh broker comes up noticeably faster on a 2-core box.
offsets.topic.num.partitions=10
transaction.state.log.num.partitions=10

# Tests start consumer groups constantly; don't wait 3 s for more members.
group.initial.rebalance.delay.ms=0
EOF
}

# The listeners for security tests, beside the PLAINTEXT one everything else uses:
# SASL_PLAINTEXT and SASL_SSL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and MTLS, an
# SSL listener that requires a client certificate signed by our CA.
kafka_secure_listeners() {
  printf 'SASL_PLAINTEXT://%s:%s,SASL_SSL://%s:%s,MTLS://%s:%s' \
    "$KAFKA_HOST" "$KAFKA_SASL_PORT" "$KAFKA_HOST" "$KAFKA_SASL_SSL_PORT" "$KAFKA_HOST" "$KAFKA_MTLS_PORT"
}

kafka_security_props() {
  local listener plain_jaas scram_jaas
  # PLAIN users live in the JAAS config; SCRAM users in the cluster metadata
  # (kafka_format_once / kafka_ensure_scram_users).
  plain_jaas="org.apache.kafka.common.security.plain.PlainLoginModule required user_$KAFKA_PLAIN_USER=\"$KAFKA_PLAIN_USER-secret\";"
  scram_jaas="org.apache.kafka.common.security.scram.ScramLoginModule required;"
  cat <<EOF2
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
EOF2
  for listener in sasl_plaintext sasl_ssl; do
    cat <<EOF2
listener.name.$listener.plain.sasl.jaas.config=$plain_jaas
listener.name.$listener.scram-sha-256.sasl.jaas.config=$scram_jaas
listener.name.$listener.scram-sha-512.sasl.jaas.config=$scram_jaas
EOF2
  done
  cat <<EOF2
ssl.keystore.type=PKCS12
ssl.keystore.location=$TLS_DIR/broker.p12
ssl.keystore.password=$TLS_KEYSTORE_PASSWORD
ssl.key.password=$TLS_KEYSTORE_PASSWORD
ssl.truststore.type=PEM
ssl.truststore.location=$TLS_DIR/ca.crt
ssl.client.auth=none
listener.name.mtls.ssl.client.auth=required
EOF2
}

kafka_scram_args() {
  printf -- '--add-scram\nSCRAM-SHA-256=[name=%s,password=%s-secret]\n' "$KAFKA_SCRAM256_USER" "$KAFKA_SCRAM256_USER"
  printf -- '--add-scram\nSCRAM-SHA-512=[name=%s,password=%s-secret]\n' "$KAFKA_SCRAM512_USER" "$KAFKA_SCRAM512_USER"
}

# Storage formatted by an older version of this script has no SCRAM users: add
# them through the running broker's admin API (AlterUserScramCredentials), once.
kafka_ensure_scram_users() {
  [[ -f $KAFKA_DATA/$KAFKA_SCRAM_STAMP_NAME ]] && return 0
  log "adding the SCRAM users to the existing Kafka storage"
  local user mech
  for user in "$KAFKA_SCRAM256_USER:SCRAM-SHA-256" "$KAFKA_SCRAM512_USER:SCRAM-SHA-512"; do
    mech=${user#*:}; user=${user%%:*}
    java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" kafka.admin.ConfigCommand \
      --bootstrap-server "$KAFKA_HOST:$KAFKA_PORT" --alter --entity-type users --entity-name "$user" \
      --add-config "$mech=[password=$user-secret]" >>"$KAFKA_LOGS/scram.log" 2>&1 9>&- \
      || { tail -n 20 "$KAFKA_LOGS/scram.log" >&2; die "adding SCRAM user $user failed; see $KAFKA_LOGS/scram.log"; }
  done
  touch "$KAFKA_DATA/$KAFKA_SCRAM_STAMP_NAME"
}

# Format the KRaft storage exactly once: reformatting would wipe topics and
# committed offsets, which outage tests (kafka-stop/kafka-start) rely on.
kafka_format_once() {
  [[ -f $KAFKA_DATA/meta.properties ]] && return 0
  # No meta.properties means an interrupted format (or none): nothing usable to keep.
  rm -rf "$KAFKA_DATA"
  mkdir -p "$KAFKA_DATA"
  local cluster_id
  cluster_id=$(java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" \
    kafka.tools.StorageTool random-uuid 9>&- | tail -n1)
  log "formatting Kafka storage (cluster id $cluster_id)"
  # The tool dumps the whole broker config at INFO; keep that out of the console.
  local scram=()
  mapfile -t scram < <(kafka_scram_args)
  java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" kafka.tools.StorageTool \
    format --standalone -t "$cluster_id" -c "$KAFKA_PROPS" "${scram[@]}" >"$KAFKA_LOGS/format.log" 2>&1 9>&- \
    || { tail -n 30 "$KAFKA_LOGS/format.log" >&2; die "formatting Kafka storage failed; see $KAFKA_LOGS/format.log"; }
  touch "$KAFKA_DATA/$KAFKA_SCRAM_STAMP_NAME"
}

kafka_start() {
  local pid auto_create
  auto_create=$(kafka_auto_create_setting)
  if pid=$(kafka_pid) && port_open "$KAFKA_HOST" "$KAFKA_PORT"; then
    log "Kafka already running (pid $pid)"
    if ! port_open "$KAFKA_HOST" "$KAFKA_SASL_PORT"; then
      log "WARNING: the running broker has no SASL/SSL listeners (started by an older script);" \
          "run kafka-stop then kafka-start to add them on ports $KAFKA_SASL_PORT-$KAFKA_MTLS_PORT"
    fi
    kafka_ensure_scram_users
    if ! grep -qx "auto.create.topics.enable=$auto_create" "$KAFKA_PROPS"; then
      log "WARNING: the running broker was started with a different auto.create.topics.enable;" \
          "run kafka-stop then kafka-start to apply OUTBOX_KAFKA_AUTO_CREATE=$auto_create"
    fi
    return 0
  fi
  if [[ -n ${pid:-} ]]; then
    # Alive but not listening: a previous start that is still coming up.
    log "Kafka (pid $pid) is starting; waiting for it"
  else
    local port
    for port in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT" "$KAFKA_SASL_PORT" "$KAFKA_SASL_SSL_PORT" "$KAFKA_MTLS_PORT"; do
      if port_open "$KAFKA_HOST" "$port"; then
        die "port $port is in use by a process other than our broker ($KAFKA_PROPS)"
      fi
    done
    kafka_ensure_java
    tls_ensure
    mkdir -p "$KAFKA_DIR" "$KAFKA_LOGS"
    kafka_ensure_libs
    kafka_write_props "$auto_create"
    kafka_format_once
    [[ -f $KAFKA_LOG ]] && mv -f "$KAFKA_LOG" "$KAFKA_LOG.1"
    log "starting Kafka broker (log $KAFKA_LOG)"
    # setsid: own session, so the broker survives the caller's terminal/process
    # group going away (CI step, test harness). nohup+setsid exec in place, so
    # $! is the JVM's pid.
    (cd "$KAFKA_DIR" && close_inherited_fds && exec setsid nohup java "${KAFKA_JVM_OPTS[@]}" \
        -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_PROPS" </dev/null >"$KAFKA_LOG" 2>&1) &
    pid=$!
    echo "$pid" >"$KAFKA_PIDFILE"
  fi
  kafka_wait_ready "$pid"
  kafka_ensure_scram_users
  log "Kafka ready on $KAFKA_HOST:$KAFKA_PORT (pid $pid; SASL_PLAINTEXT :$KAFKA_SASL_PORT," \
      "SASL_SSL :$KAFKA_SASL_SSL_PORT, mutual TLS :$KAFKA_MTLS_PORT)"
}

# Ready = the broker logged "Kafka Server started" (it does so only after it has
# caught up with the metadata log, been unfenced and enabled request processing)
# and the client port accepts connections. A bare open port is not enough: the
# socket is bound before the broker can serve requests.
kafka_wait_ready() {
  local pid=$1 deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  while :; do
    if ! pid_alive "$pid"; then
      tail -n 40 "$KAFKA_LOG" >&2 || true
      rm -f "$KAFKA_PIDFILE"
      die "Kafka exited during startup; see $KAFKA_LOG"
    fi
    if grep -q 'Kafka Server started' "$KAFKA_LOG" 2>/dev/null && port_open "$KAFKA_HOST" "$KAFKA_PORT"; then
      return 0
    fi
    if (( SECONDS >= deadline )); then
      tail -n 40 "$KAFKA_LOG" >&2 || true
      die "Kafka not ready after ${KAFKA_START_TIMEOUT} s (pid $pid still running); see $KAFKA_LOG"
    fi
    sleep 0.5
  done
}

kafka_stop() {
  local pid
  if ! pid=$(kafka_pid); then
    log "Kafka not running"
    rm -f "$KAFKA_PIDFILE"
    return 0
  fi
  log "stopping Kafka (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + KAFKA_STOP_TIMEOUT))
  while pid_alive "$pid" && (( SECONDS < deadline )); do sleep 0.3; done
  if pid_alive "$pid"; then
    log "Kafka did not stop within ${KAFKA_STOP_TIMEOUT} s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    while pid_alive "$pid"; do sleep 0.1; done
  fi
  rm -f "$KAFKA_PIDFILE"
  # Callers (outage tests) expect the port to refuse connections on return.
  local _
  for _ in {1..50}; do port_open "$KAFKA_HOST" "$KAFKA_PORT" || break; sleep 0.1; done
}

kafka_status() {
  local pid
  if pid=$(kafka_pid) && port_open "$KAFKA_HOST" "$KAFKA_PORT"; then
    printf 'kafka:      up   (pid %s, %s:%s)\n' "$pid" "$KAFKA_HOST" "$KAFKA_PORT" >&3
    return 0
  elif [[ -n ${pid:-} ]]; then
    printf 'kafka:      starting (pid %s, port %s not open yet)\n' "$pid" "$KAFKA_PORT" >&3
    return 1
  fi
  printf 'kafka:      down\n' >&3
  return 1
}

# ---------------------------------------------------------------------------
# Extra Kafka nodes: the three-node cluster and the Kafka 3.x broker
# ---------------------------------------------------------------------------
# Each node is a JVM running kafka.Kafka with its own server.properties, pid file and log;
# a node is "ours" by the same rule as the single broker (that properties file on its
# command line). Static KRaft voters (controller.quorum.voters): the storage is formatted
# without --standalone, and every node of the cluster shares one cluster id.
CLUSTER_SIZE=3
CLUSTER_PORT=${OUTBOX_SERVICES_CLUSTER_PORT:-29092}
CLUSTER_CONTROLLER_PORT=${OUTBOX_SERVICES_CLUSTER_CONTROLLER_PORT:-$((CLUSTER_PORT + 10))}
CLUSTER_PROXIED_PORT=${OUTBOX_SERVICES_CLUSTER_PROXIED_PORT:-$((CLUSTER_PORT + 30))}
CLUSTER_PROXY_PORT=${OUTBOX_SERVICES_CLUSTER_PROXY_PORT:-$((CLUSTER_PORT + 40))}
CLUSTER_DIR="$STATE_DIR/cluster"
KAFKA3_PORT=${OUTBOX_SERVICES_KAFKA3_PORT:-29112}
KAFKA3_CONTROLLER_PORT=$((KAFKA3_PORT + 1))
KAFKA3_POM="$SCRIPT_DIR/kafka3/pom.xml"
KAFKA3_LOG4J="$SCRIPT_DIR/kafka3/log4j.properties"
KAFKA3_DIR="$STATE_DIR/kafka3"
# Small heaps and few threads: three nodes run beside the single broker, PostgreSQL and the
# tests on a 2-core box.
NODE_JVM_OPTS=(
  -Xms96m -Xmx320m -XX:MaxMetaspaceSize=160m -XX:+UseSerialGC -XX:TieredStopAtLevel=1
  -Xss512k -Djava.awt.headless=true
)

# node_* helpers take a node directory holding server.properties, kafka.pid and logs/kafka.log.
node_pid() {
  local dir=$1 pid d
  if [[ -f $dir/kafka.pid ]]; then
    pid=$(<"$dir/kafka.pid")
    if node_is_ours "$pid" "$dir"; then echo "$pid"; return 0; fi
  fi
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    if node_is_ours "$pid" "$dir"; then echo "$pid"; return 0; fi
  done
  return 1
}

node_is_ours() {
  [[ $(pid_comm "$1") == java ]] || return 1
  grep -qzxF -e kafka.Kafka "/proc/$1/cmdline" 2>/dev/null \
    && grep -qzxF -e "$2/server.properties" "/proc/$1/cmdline" 2>/dev/null
}

# node_format DIR CLUSTER_ID LIBS LOG_OPT: format the node's storage once.
node_format() {
  local dir=$1 cluster_id=$2 libs=$3 log_opt=$4
  [[ -f $dir/data/meta.properties ]] && return 0
  rm -rf "$dir/data"
  mkdir -p "$dir/data"
  java -cp "$libs/*" "$log_opt" kafka.tools.StorageTool format -t "$cluster_id" \
    -c "$dir/server.properties" >"$dir/logs/format.log" 2>&1 9>&- \
    || { tail -n 30 "$dir/logs/format.log" >&2; die "formatting $dir failed; see $dir/logs/format.log"; }
}

# node_launch DIR LIBS LOG_OPT: start the JVM in the background (no wait).
node_launch() {
  local dir=$1 libs=$2 log_opt=$3 pid
  if pid=$(node_pid "$dir"); then
    return 0
  fi
  [[ -f $dir/logs/kafka.log ]] && mv -f "$dir/logs/kafka.log" "$dir/logs/kafka.log.1"
  (cd "$dir" && close_inherited_fds && exec setsid nohup java "${NODE_JVM_OPTS[@]}" "$log_opt" \
      "-Dkafka.logs.dir=$dir/logs" -cp "$libs/*" kafka.Kafka "$dir/server.properties" \
      </dev/null >"$dir/logs/kafka.log" 2>&1) &
  echo $! >"$dir/kafka.pid"
}

# node_wait DIR PORT: until the node logged "Kafka Server started" and its port is open.
node_wait() {
  local dir=$1 port=$2 pid deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  while :; do
    if ! pid=$(node_pid "$dir"); then
      tail -n 40 "$dir/logs/kafka.log" >&2 || true
      die "Kafka node $dir exited during startup; see $dir/logs/kafka.log"
    fi
    if grep -q 'Kafka Server started' "$dir/logs/kafka.log" 2>/dev/null && port_open "$KAFKA_HOST" "$port"; then
      return 0
    fi
    if (( SECONDS >= deadline )); then
      tail -n 40 "$dir/logs/kafka.log" >&2 || true
      die "Kafka node $dir not ready after ${KAFKA_START_TIMEOUT} s; see $dir/logs/kafka.log"
    fi
    sleep 0.5
  done
}

# node_stop DIR PORT SIGNAL: TERM (controlled shutdown, KILL after a bound) or KILL.
node_stop() {
  local dir=$1 port=$2 signal=$3 pid
  if ! pid=$(node_pid "$dir"); then
    rm -f "$dir/kafka.pid"
    return 0
  fi
  kill "-$signal" "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + KAFKA_STOP_TIMEOUT))
  while pid_alive "$pid" && (( SECONDS < deadline )); do sleep 0.2; done
  if pid_alive "$pid"; then
    log "Kafka node $dir did not stop within ${KAFKA_STOP_TIMEOUT} s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    while pid_alive "$pid"; do sleep 0.1; done
  fi
  rm -f "$dir/kafka.pid"
  local _
  for _ in {1..50}; do port_open "$KAFKA_HOST" "$port" || break; sleep 0.1; done
}

cluster_node_dir() { printf '%s/node%s' "$CLUSTER_DIR" "$1"; }
cluster_port() { printf '%s' $((CLUSTER_PORT + $1 - 1)); }
cluster_controller_port() { printf '%s' $((CLUSTER_CONTROLLER_PORT + $1 - 1)); }
cluster_proxied_port() { printf '%s' $((CLUSTER_PROXIED_PORT + $1 - 1)); }
cluster_proxy_port() { printf '%s' $((CLUSTER_PROXY_PORT + $1 - 1)); }

# A node's PROXIED listener: listens on its proxied port, advertises its fault proxy's port, so
# that a client bootstrapped at the proxies reaches every node only through them.
cluster_proxied_listener() {
  [[ $CLUSTER_PROXY_PORT == 0 ]] || printf ',PROXIED://%s:%s' "$KAFKA_HOST" "$2"
}

cluster_check_node() {
  [[ ${1:-} =~ ^[1-3]$ ]] || die "give a node number 1..$CLUSTER_SIZE, got '${1:-}'"
}

cluster_write_props() {
  local n=$1 dir voters="" i
  dir=$(cluster_node_dir "$n")
  for i in $(seq 1 "$CLUSTER_SIZE"); do
    voters+="${voters:+,}$i@$KAFKA_HOST:$(cluster_controller_port "$i")"
  done
  mkdir -p "$dir/logs"
  cat >"$dir/server.properties" <<EOF2
# Generated by deploy/local/services.sh on every cluster start; edit the script, not this file.
# Node $n of a three-node KRaft cluster: each node is a broker and one of three controller voters.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$KAFKA_HOST:$(cluster_port "$n"),CONTROLLER://$KAFKA_HOST:$(cluster_controller_port "$n")$(cluster_proxied_listener "$n" "$(cluster_proxied_port "$n")")
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$(cluster_port "$n")$(cluster_proxied_listener "$n" "$(cluster_proxy_port "$n")")
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,PROXIED:PLAINTEXT
log.dirs=$dir/data
num.partitions=3
auto.create.topics.enable=true
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
offsets.topic.num.partitions=3
transaction.state.log.num.partitions=3
group.initial.rebalance.delay.ms=0
# A dead node is fenced (its partitions get a new leader, it leaves the ISR) within seconds.
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=6000
replica.lag.time.max.ms=10000
# Few threads: three JVMs share two cores with everything else.
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
log.cleaner.threads=1
EOF2
}

cluster_prepare() {
  kafka_ensure_java
  mkdir -p "$CLUSTER_DIR" "$KAFKA_LOGS"
  kafka_ensure_libs
  local n cluster_id
  if [[ ! -f $CLUSTER_DIR/cluster.id ]]; then
    java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" \
      kafka.tools.StorageTool random-uuid 9>&- | tail -n1 >"$CLUSTER_DIR/cluster.id"
  fi
  cluster_id=$(<"$CLUSTER_DIR/cluster.id")
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    cluster_write_props "$n"
    node_format "$(cluster_node_dir "$n")" "$cluster_id" "$KAFKA_LIBS" "-Dlog4j2.configurationFile=$KAFKA_LOG4J"
  done
}

cluster_check_ports() {
  local n port
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_pid "$(cluster_node_dir "$n")" >/dev/null && continue
    for port in "$(cluster_port "$n")" "$(cluster_controller_port "$n")" "$(cluster_proxied_port "$n")"; do
      if port_open "$KAFKA_HOST" "$port"; then
        die "port $port is in use by a process other than cluster node $n; set OUTBOX_SERVICES_CLUSTER_PORT"
      fi
    done
  done
}

cluster_start() {
  cluster_check_ports
  local n running=0
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_pid "$(cluster_node_dir "$n")" >/dev/null && running=1
  done
  # Started with no node running, the cluster starts empty: it only holds test topics, and
  # Kafka 4.1.1's controller can keep a corrupt record of a topic deleted while a broker was out
  # of its ISR ("existed in isrMembers, but not in the topics map"), after which that broker
  # can never register again; seen on a data folder reused by a later test run.
  if (( running == 0 )); then
    rm -rf "$CLUSTER_DIR"/node*/data "$CLUSTER_DIR/cluster.id"
  fi
  cluster_prepare
  log "starting the three-node Kafka cluster (ports $(cluster_port 1)-$(cluster_port "$CLUSTER_SIZE"), logs $CLUSTER_DIR/node*/logs)"
  # All at once: a node finishes starting only once a quorum of controllers is up.
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_launch "$(cluster_node_dir "$n")" "$KAFKA_LIBS" "-Dlog4j2.configurationFile=$KAFKA_LOG4J"
  done
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_wait "$(cluster_node_dir "$n")" "$(cluster_port "$n")"
  done
  log "Kafka cluster ready: $(cluster_bootstrap)"
}

cluster_stop() {
  local n running=0
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_pid "$(cluster_node_dir "$n")" >/dev/null && running=1
  done
  if (( running == 0 )); then
    log "Kafka cluster not running"
    return 0
  fi
  # In parallel: a controlled shutdown waits for the quorum, which the others still form.
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    node_stop "$(cluster_node_dir "$n")" "$(cluster_port "$n")" TERM &
  done
  wait
  log "Kafka cluster stopped"
}

broker_start() {
  cluster_check_node "$1"
  cluster_prepare
  node_launch "$(cluster_node_dir "$1")" "$KAFKA_LIBS" "-Dlog4j2.configurationFile=$KAFKA_LOG4J"
  node_wait "$(cluster_node_dir "$1")" "$(cluster_port "$1")"
  log "cluster node $1 ready on $KAFKA_HOST:$(cluster_port "$1")"
}

broker_stop() {
  cluster_check_node "$1"
  node_stop "$(cluster_node_dir "$1")" "$(cluster_port "$1")" "$2"
  log "cluster node $1 stopped (SIG$2)"
}

# broker_signal N SIGNAL: STOP or CONT, for a node that must go silent without losing its state.
broker_signal() {
  cluster_check_node "$1"
  local pid
  pid=$(node_pid "$(cluster_node_dir "$1")") || die "cluster node $1 is not running"
  kill "-$2" "$pid"
  log "cluster node $1 sent SIG$2"
}

# dump_log N TOPIC PARTITION: every segment of the partition's log on node N, batch by batch.
dump_log() {
  cluster_check_node "$1"
  local dir files
  dir="$(cluster_node_dir "$1")/data/$2-$3"
  [[ -d $dir ]] || die "node $1 holds no replica of $2-$3 ($dir)"
  files=$(find "$dir" -name '*.log' | sort | paste -sd, -)
  [[ -n $files ]] || return 0
  kafka_ensure_java
  java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" \
    kafka.tools.DumpLogSegments --files "$files" --deep-iteration=false 9>&- >&3
}

quorum_leader() {
  kafka_ensure_java
  java -cp "$KAFKA_LIBS/*" "-Dlog4j2.configurationFile=$KAFKA_LOG4J" \
    org.apache.kafka.tools.MetadataQuorumCommand --bootstrap-server "$(cluster_bootstrap)" \
    describe --status 9>&- 2>/dev/null | awk '$1 == "LeaderId:" { print $2; found = 1 } END { exit !found }' >&3
}

cluster_bootstrap() {
  local n out=""
  for n in $(seq 1 "$CLUSTER_SIZE"); do out+="${out:+,}$KAFKA_HOST:$(cluster_port "$n")"; done
  printf '%s' "$out"
}

# node:proxied_port:proxy_port for each node (empty when the proxied listeners are off).
cluster_proxied() {
  local n out=""
  [[ $CLUSTER_PROXY_PORT == 0 ]] && return 0
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    out+="${out:+,}$n:$(cluster_proxied_port "$n"):$(cluster_proxy_port "$n")"
  done
  printf '%s' "$out"
}

cluster_status() {
  local n pid rc=0
  for n in $(seq 1 "$CLUSTER_SIZE"); do
    if pid=$(node_pid "$(cluster_node_dir "$n")") && port_open "$KAFKA_HOST" "$(cluster_port "$n")"; then
      printf 'cluster node %s: up   (pid %s, %s:%s)\n' "$n" "$pid" "$KAFKA_HOST" "$(cluster_port "$n")" >&3
    else
      printf 'cluster node %s: down\n' "$n" >&3
      rc=1
    fi
  done
  return $rc
}

kafka3_start() {
  local pid
  if pid=$(node_pid "$KAFKA3_DIR") && port_open "$KAFKA_HOST" "$KAFKA3_PORT"; then
    log "Kafka 3 already running (pid $pid)"
    return 0
  fi
  if [[ -z ${pid:-} ]]; then
    local port
    for port in "$KAFKA3_PORT" "$KAFKA3_CONTROLLER_PORT"; do
      if port_open "$KAFKA_HOST" "$port"; then
        die "port $port is in use by a process other than our Kafka 3 broker; set OUTBOX_SERVICES_KAFKA3_PORT"
      fi
    done
  fi
  kafka_ensure_java
  mkdir -p "$KAFKA3_DIR/logs"
  kafka_ensure_libs "$KAFKA3_POM" "$KAFKA3_DIR/libs" "$KAFKA3_DIR/logs"
  cat >"$KAFKA3_DIR/server.properties" <<EOF2
# Generated by deploy/local/services.sh on every kafka3-start; edit the script, not this file.
# A single-node Kafka 3.x KRaft cluster for the compatibility smoke test.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$KAFKA_HOST:$KAFKA3_CONTROLLER_PORT
controller.listener.names=CONTROLLER
listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA3_PORT,CONTROLLER://$KAFKA_HOST:$KAFKA3_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$KAFKA_HOST:$KAFKA3_PORT
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA3_DIR/data
num.partitions=3
auto.create.topics.enable=true
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
offsets.topic.num.partitions=3
transaction.state.log.num.partitions=3
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
background.threads=2
log.cleaner.threads=1
EOF2
  local log_opt="-Dlog4j.configuration=file:$KAFKA3_LOG4J"
  if [[ ! -f $KAFKA3_DIR/data/meta.properties ]]; then
    node_format "$KAFKA3_DIR" "$(java -cp "$KAFKA3_DIR/libs/*" "$log_opt" kafka.tools.StorageTool random-uuid 9>&- | tail -n1)" \
      "$KAFKA3_DIR/libs" "$log_opt"
  fi
  log "starting the Kafka 3 broker (log $KAFKA3_DIR/logs/kafka.log)"
  node_launch "$KAFKA3_DIR" "$KAFKA3_DIR/libs" "$log_opt"
  node_wait "$KAFKA3_DIR" "$KAFKA3_PORT"
  log "Kafka 3 ready on $KAFKA_HOST:$KAFKA3_PORT"
}

kafka3_stop() {
  if ! node_pid "$KAFKA3_DIR" >/dev/null; then
    log "Kafka 3 not running"
    return 0
  fi
  node_stop "$KAFKA3_DIR" "$KAFKA3_PORT" TERM
  log "Kafka 3 stopped"
}

# ---------------------------------------------------------------------------
# PgBouncer (transaction pooling in front of our PostgreSQL)
# ---------------------------------------------------------------------------
# Debian's package; its own system service (if any) is left alone: ours runs on
# its own port from .services/pgbouncer/, as the cluster owner (PgBouncer refuses
# to run as root). A wildcard database entry forwards every database name,
# including the per-test databases the test suite creates on the direct server.
PGB_PORT=${OUTBOX_SERVICES_PGBOUNCER_PORT:-6432}
PGB_IN_REPO="$STATE_DIR/pgbouncer"

pgb_resolve_dir() {
  PGB_DIR=$PGB_IN_REPO
  if [[ -L $PGB_IN_REPO ]] || ! { mkdir -p "$PGB_IN_REPO" && chmod 0755 "$STATE_DIR" && as_pg test -x "$PGB_IN_REPO"; }; then
    # Same reason as PostgreSQL's fallback: the cluster owner cannot reach the repo.
    PGB_DIR="$PG_FALLBACK_ROOT/$REPO_HASH/pgbouncer"
    mkdir -p "$PGB_DIR"
    [[ -L $PGB_IN_REPO ]] || { rmdir "$PGB_IN_REPO" 2>/dev/null || true; ln -sfn "$PGB_DIR" "$PGB_IN_REPO"; }
  fi
  PGB_PIDFILE="$PGB_DIR/pgbouncer.pid"
}

pgb_pid() {
  local pid
  [[ -f ${PGB_PIDFILE:-} ]] || return 1
  pid=$(<"$PGB_PIDFILE")
  pid_alive "$pid" && [[ $(pid_comm "$pid") == pgbouncer ]] && echo "$pid"
}

pgb_write_config() {
  # ignore_startup_parameters: session settings the dispatcher sends at connect time. A
  # transaction pooler cannot keep them per client, so it drops them; where they matter set
  # them per role instead (ALTER ROLE ... SET synchronous_commit = off).
  cat >"$PGB_DIR/pgbouncer.ini" <<EOF
; Generated by deploy/local/services.sh on every pgbouncer-start; edit the script, not this file.
[databases]
* = host=$PG_HOST port=$PG_PORT

[pgbouncer]
listen_addr = $PG_HOST
listen_port = $PGB_PORT
unix_socket_dir =
pool_mode = transaction
auth_type = scram-sha-256
auth_file = $PGB_DIR/userlist.txt
max_client_conn = 1000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,synchronous_commit,idle_in_transaction_session_timeout
logfile = $PGB_DIR/pgbouncer.log
pidfile = $PGB_PIDFILE
EOF
  printf '"%s" "%s"\n' "$PG_APP_USER" "$PG_APP_PASSWORD" >"$PGB_DIR/userlist.txt"
  chmod 0600 "$PGB_DIR/userlist.txt" "$PGB_DIR/pgbouncer.ini"
  if is_root; then chown "$PG_OS_USER:" "$PGB_DIR" "$PGB_DIR/userlist.txt" "$PGB_DIR/pgbouncer.ini"; fi
}

# Debian's package may start its own service on 6432 (systemd, or the init script). Like
# Debian's PostgreSQL cluster, it would take our port: stop it and keep it from starting.
pgb_disable_debian_service() {
  is_root || return 0
  port_open "$PG_HOST" "$PGB_PORT" || return 0
  if command -v systemctl >/dev/null && systemctl is-active --quiet pgbouncer.socket pgbouncer.service 2>/dev/null; then
    log "stopping and disabling Debian's pgbouncer service (it occupies port $PGB_PORT)"
    systemctl disable --now pgbouncer.socket pgbouncer.service >/dev/null 2>&1 || true
  elif [[ -x /etc/init.d/pgbouncer && -f /var/run/postgresql/pgbouncer.pid ]]; then
    log "stopping Debian's pgbouncer service (it occupies port $PGB_PORT)"
    /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true
  fi
  local _
  for _ in {1..50}; do port_open "$PG_HOST" "$PGB_PORT" || break; sleep 0.1; done
}

pgbouncer_start() {
  command -v pgbouncer >/dev/null || apt_install pgbouncer
  pgb_resolve_dir
  local pid
  if pid=$(pgb_pid); then
    log "PgBouncer already running (pid $pid)"
    return 0
  fi
  pgb_disable_debian_service
  if port_open "$PG_HOST" "$PGB_PORT"; then
    die "port $PG_HOST:$PGB_PORT is in use by another process (not our PgBouncer); set OUTBOX_SERVICES_PGBOUNCER_PORT"
  fi
  pgb_write_config
  log "starting PgBouncer on $PG_HOST:$PGB_PORT (transaction pooling; log $PGB_DIR/pgbouncer.log)"
  as_pg_detached pgbouncer -d "$PGB_DIR/pgbouncer.ini" \
    || die "PgBouncer failed to start; see $PGB_DIR/pgbouncer.log"
  local deadline=$((SECONDS + 30))
  until port_open "$PG_HOST" "$PGB_PORT"; do
    (( SECONDS < deadline )) || die "PgBouncer not listening after 30 s; see $PGB_DIR/pgbouncer.log"
    sleep 0.2
  done
  log "PgBouncer ready on $PG_HOST:$PGB_PORT"
}

pgbouncer_stop() {
  pgb_resolve_dir
  local pid
  if ! pid=$(pgb_pid); then
    log "PgBouncer not running"
    return 0
  fi
  log "stopping PgBouncer (pid $pid)"
  kill -INT "$pid" 2>/dev/null || true
  local _
  for _ in {1..100}; do pid_alive "$pid" || break; sleep 0.1; done
  if pid_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
}

pgbouncer_status() {
  pgb_resolve_dir
  local pid
  if pid=$(pgb_pid) && port_open "$PG_HOST" "$PGB_PORT"; then
    printf 'pgbouncer:  up   (pid %s, %s:%s)\n' "$pid" "$PG_HOST" "$PGB_PORT" >&3
    return 0
  fi
  printf 'pgbouncer:  down\n' >&3
  return 1
}

# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------
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
  local cmd=${1:-}
  case $cmd in
    start)       take_lock; pg_start; kafka_start; pgbouncer_start; print_env ;;
    stop)        take_lock; pgbouncer_stop; cluster_stop; kafka3_stop; kafka_stop; pg_stop ;;
    status)      local rc=0; pg_status || rc=1; kafka_status || rc=1; pgbouncer_status || rc=1; exit $rc ;;
    pgbouncer-start) take_lock; pgbouncer_start ;;
    pgbouncer-stop)  take_lock; pgbouncer_stop ;;
    pg-start)    take_lock; pg_start ;;
    pg-stop)     take_lock; pg_stop ;;
    kafka-start) take_lock; kafka_start ;;
    kafka-stop)  take_lock; kafka_stop ;;
    env)         print_env ;;
    cluster-start)  take_lock; cluster_start ;;
    cluster-stop)   take_lock; cluster_stop ;;
    cluster-status) local rc=0; cluster_status || rc=1; exit $rc ;;
    cluster-env)    printf 'OUTBOX_CLUSTER_BOOTSTRAP_SERVERS=%s\nOUTBOX_CLUSTER_PROXIED=%s\n' \
                      "$(cluster_bootstrap)" "$(cluster_proxied)" >&3 ;;
    broker-start)   take_lock; broker_start "${2:-}" ;;
    broker-stop)    take_lock; broker_stop "${2:-}" TERM ;;
    broker-kill)    take_lock; broker_stop "${2:-}" KILL ;;
    broker-pause)   broker_signal "${2:-}" STOP ;;
    broker-resume)  broker_signal "${2:-}" CONT ;;
    quorum-leader)  quorum_leader ;;
    dump-log)       dump_log "${2:-}" "${3:-}" "${4:-}" ;;
    kafka3-start)   take_lock; kafka3_start ;;
    kafka3-stop)    take_lock; kafka3_stop ;;
    kafka3-env)     printf 'OUTBOX_KAFKA3_BOOTSTRAP_SERVERS=%s:%s\n' "$KAFKA_HOST" "$KAFKA3_PORT" >&3 ;;
    -h|--help|help) usage ;;
    *)           usage; exit 2 ;;
  esac
}

main "$@"
