# shellcheck shell=bash
# PostgreSQL: our own cluster from Debian's packages, role and database "outbox", TLS on by default.

PG_HOST=127.0.0.1
PG_PORT=${OUTBOX_SERVICES_PG_PORT:-5432}
PG_APP_USER=outbox
PG_APP_PASSWORD=outbox
PG_APP_DB=outbox
PG_FALLBACK_ROOT=/var/lib/outbox-dispatcher-services
PG_IN_REPO="$STATE_DIR/pg"
PG_SSL=${OUTBOX_SERVICES_PG_SSL:-on}

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
  PG_MAJOR=$ver
}

# plpgsql_check: the static check of the engine's PL/pgSQL (tests/integration/test_plpgsql_check.py,
# which fails on this stack without it), from Debian's package for the server's major version.
pg_plpgsql_check_installed() {
  [[ -f /usr/share/postgresql/$PG_MAJOR/extension/plpgsql_check.control ]]
}

pg_ensure_plpgsql_check() {
  pg_plpgsql_check_installed && return 0
  if ! is_root; then
    log "plpgsql_check is missing (apt-get install postgresql-$PG_MAJOR-plpgsql-check as root): test_plpgsql_check will fail"
    return 0
  fi
  apt_install "postgresql-$PG_MAJOR-plpgsql-check"
  pg_plpgsql_check_installed || die "postgresql-$PG_MAJOR-plpgsql-check installed but no plpgsql_check.control"
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
# make bench counts the dispatcher's statements, nested ones too (issue 34: statements per
# steady cycle); loading the library needs a restart (pg-stop, pg-start), not a reload.
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track = all
# a whole make test makes more distinct statements (a schema per tenant) than the default 5,000
# entries; the least-called are evicted first, which made counting tests see counts fall.
pg_stat_statements.max = 20000
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
-- The writer tests restore rows with triggers off, as pg_restore --disable-triggers and
-- logical replication's apply do (PostgreSQL 15+: a grant instead of superuser).
GRANT SET ON PARAMETER session_replication_role TO $PG_APP_USER;
SQL
  # make bench reads the dispatcher's statements from the app database (creating the extension
  # needs a superuser); the test databases are created from template1 and do not get it.
  as_pg "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCKET_DIR" -p "$PG_PORT" \
    -U "$PG_SUPERUSER" -d "$PG_APP_DB" -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements' \
    -c "GRANT EXECUTE ON FUNCTION pg_stat_statements_reset(oid, oid, bigint) TO $PG_APP_USER"
  # (the counting tests empty it before they count: over a whole make test its entries fill)
  # The static check runs from the app database too, in a schema of its own (its functions stay
  # out of public); creating it needs a superuser. It loads on use: no restart.
  pg_plpgsql_check_installed || return 0
  as_pg "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCKET_DIR" -p "$PG_PORT" \
    -U "$PG_SUPERUSER" -d "$PG_APP_DB" <<SQL
SET client_min_messages = warning;
CREATE SCHEMA IF NOT EXISTS plpgsql_check;
CREATE EXTENSION IF NOT EXISTS plpgsql_check SCHEMA plpgsql_check;
GRANT USAGE ON SCHEMA plpgsql_check TO $PG_APP_USER;
SQL
}

pg_start() {
  pg_ensure_installed
  pg_resolve_paths create
  pg_pick_bindir
  pg_ensure_plpgsql_check
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

# An immediate stop (SIGQUIT, no shutdown checkpoint): what a crash leaves. Commits whose WAL no
# process wrote out yet are gone after the restart's recovery, as after a power loss (tests of
# durability: tests/integration/test_exactly_once_durability.py).
pg_crash() {
  pg_resolve_paths
  pg_pick_bindir
  if pg_running; then
    log "stopping PostgreSQL immediately (as a crash)"
    as_pg "$PG_BIN/pg_ctl" stop -D "$PGDATA" -m immediate -w -t 60 -s
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
