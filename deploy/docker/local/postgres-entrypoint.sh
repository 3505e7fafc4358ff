# initdb on first start (POSTGRES_USER/POSTGRES_PASSWORD/POSTGRES_DB), then PostgreSQL as PID 1.
set -euo pipefail
: "${POSTGRES_USER:=postgres}" "${POSTGRES_PASSWORD:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${PGPORT:=5432}"
if [[ ! -s $PGDATA/PG_VERSION ]]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
  if [[ $POSTGRES_DB != postgres ]]; then
    postgres --single -D "$PGDATA" -c port="$PGPORT" postgres <<<"CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c port="$PGPORT" -c max_connections=300 \
  -c fsync=off -c synchronous_commit=off -c full_page_writes=off "$@"
