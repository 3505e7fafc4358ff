# shellcheck shell=bash
# A Kafka node: a JVM running kafka.Kafka from a directory of its own (server.properties, kafka.pid,
# data/, logs/kafka.log), and the Java and the Maven jars it runs on. The single broker
# (lib/kafka.sh), each node of the cluster (lib/cluster.sh) and the Kafka 3 broker (lib/kafka3.sh)
# are one each.

KAFKA_HOST=127.0.0.1
KAFKA_START_TIMEOUT=90
KAFKA_STOP_TIMEOUT=30
# Small heaps and few threads for the extra nodes: three run beside the single broker, PostgreSQL
# and the tests on a 2-core box.
NODE_JVM_OPTS=(
  -Xms96m -Xmx320m -XX:MaxMetaspaceSize=160m -XX:+UseSerialGC -XX:TieredStopAtLevel=1
  -Xss512k -Djava.awt.headless=true
)
NODE_THREAD_PROPS="\
num.network.threads=2
num.io.threads=2
background.threads=2
log.cleaner.threads=1"

kafka_ensure_java() {
  command -v java >/dev/null || apt_install openjdk-17-jre-headless
}

# kafka_ensure_libs POM LIBS LOGS: fetch the broker jars with Maven unless the copy matches the
# pom.xml. Copied into a temp dir and renamed, so an interrupted download never leaves a
# half-filled libs/ that would be mistaken for a complete one.
kafka_ensure_libs() {
  local pom=$1 libs=$2 logs=$3
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

# kafka_random_uuid LIBS LOG_OPT: a new cluster id.
kafka_random_uuid() {
  java -cp "$1/*" "$2" kafka.tools.StorageTool random-uuid 9>&- | tail -n1
}

# A pid is the node's if it is a JVM running kafka.Kafka with *this* directory's
# server.properties (guards against pid reuse and against other clones' brokers).
# Builtins first so that scanning /proc stays cheap.
node_is_ours() {
  [[ $(pid_comm "$1") == java ]] || return 1
  grep -qzxF -e kafka.Kafka "/proc/$1/cmdline" 2>/dev/null \
    && grep -qzxF -e "$2/server.properties" "/proc/$1/cmdline" 2>/dev/null
}

# node_pid DIR: prints the node's pid. Falls back to scanning /proc (cheap) in case the pid file
# was lost, so a stop never leaves an orphan broker holding the port.
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

node_formatted() { [[ -f $1/data/meta.properties ]]; }

# node_format DIR CLUSTER_ID LIBS LOG_OPT [StorageTool format options...]: format the node's
# storage once. Reformatting would wipe topics and committed offsets, which outage tests
# (kafka-stop/kafka-start) rely on; no meta.properties means an interrupted format (or none):
# nothing usable to keep. The tool dumps the whole broker config at INFO: it goes to a log.
node_format() {
  local dir=$1 cluster_id=$2 libs=$3 log_opt=$4
  node_formatted "$dir" && return 0
  rm -rf "$dir/data"
  mkdir -p "$dir/data"
  java -cp "$libs/*" "$log_opt" kafka.tools.StorageTool format -t "$cluster_id" \
    -c "$dir/server.properties" "${@:5}" >"$dir/logs/format.log" 2>&1 9>&- \
    || { tail -n 30 "$dir/logs/format.log" >&2; die "formatting $dir failed; see $dir/logs/format.log"; }
}

# node_launch DIR LIBS JVM_OPTS...: start the JVM in the background (no wait), unless it runs.
# setsid: own session, so the broker survives the caller's terminal/process group going away (CI
# step, test harness). nohup+setsid exec in place, so $! is the JVM's pid.
node_launch() {
  local dir=$1 libs=$2
  shift 2
  node_pid "$dir" >/dev/null && return 0
  [[ -f $dir/logs/kafka.log ]] && mv -f "$dir/logs/kafka.log" "$dir/logs/kafka.log.1"
  (cd "$dir" && close_inherited_fds && exec setsid nohup java "$@" \
      "-Dkafka.logs.dir=$dir/logs" -cp "$libs/*" kafka.Kafka "$dir/server.properties" \
      </dev/null >"$dir/logs/kafka.log" 2>&1) &
  echo $! >"$dir/kafka.pid"
}

# node_launching DIR: the pid node_launch wrote is alive but not the JVM yet (the subshell is still
# on its way to exec java through setsid and nohup; on a loaded machine that takes a while, and a
# wait that took it for a dead broker failed a CI run's outage test).
node_launching() {
  local pid
  [[ -f $1/kafka.pid ]] && pid=$(<"$1/kafka.pid") && pid_alive "$pid" \
    && [[ $(pid_comm "$pid") != java ]]
}

# node_wait DIR PORT NAME: until the node logged "Kafka Server started" (it does so only after it
# has caught up with the metadata log, been unfenced and enabled request processing) and its port
# accepts connections. A bare open port is not enough: the socket is bound before the broker can
# serve requests.
node_wait() {
  local dir=$1 port=$2 name=$3 deadline=$((SECONDS + KAFKA_START_TIMEOUT))
  while :; do
    if ! node_pid "$dir" >/dev/null && ! node_launching "$dir"; then
      tail -n 40 "$dir/logs/kafka.log" >&2 || true
      rm -f "$dir/kafka.pid"
      die "$name exited during startup; see $dir/logs/kafka.log"
    fi
    if grep -q 'Kafka Server started' "$dir/logs/kafka.log" 2>/dev/null && port_open "$KAFKA_HOST" "$port"; then
      return 0
    fi
    if (( SECONDS >= deadline )); then
      tail -n 40 "$dir/logs/kafka.log" >&2 || true
      die "$name not ready after ${KAFKA_START_TIMEOUT} s (still running); see $dir/logs/kafka.log"
    fi
    sleep 0.5
  done
}

# node_stop DIR PORT SIGNAL NAME: TERM (controlled shutdown, KILL after a bound) or KILL; returns
# once the port refuses connections.
node_stop() {
  local dir=$1 port=$2 signal=$3 name=$4 pid
  if ! pid=$(node_pid "$dir"); then
    rm -f "$dir/kafka.pid"
    return 0
  fi
  kill "-$signal" "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + KAFKA_STOP_TIMEOUT))
  while pid_alive "$pid" && (( SECONDS < deadline )); do sleep 0.2; done
  if pid_alive "$pid"; then
    log "$name did not stop within ${KAFKA_STOP_TIMEOUT} s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    while pid_alive "$pid"; do sleep 0.1; done
  fi
  rm -f "$dir/kafka.pid"
  wait_port_closed "$KAFKA_HOST" "$port"
}
