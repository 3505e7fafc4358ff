# shellcheck shell=bash
# What every service of deploy/local/services.sh shares: the layout, the output convention, errors,
# process and port checks, the lock and apt. Sourced by services.sh after SCRIPT_DIR is set.

# Everything is derived from the script's location so that it works from any clone path (CI uses
# a fresh clone in an arbitrary folder).
REPO_ROOT=$(cd -- "$SCRIPT_DIR/../.." && pwd -P)
STATE_DIR="$REPO_ROOT/.services"
# Short, stable per-clone id, used for state kept outside the repo.
REPO_HASH=$(printf '%s' "$REPO_ROOT" | sha256sum | cut -c1-12)

# Keep the real stdout on fd 3 for the env lines; everything else goes to stderr.
exec 3>&1 1>&2

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }
# -E makes this fire inside functions too; report once (not again from every
# enclosing subshell) with the file and the call chain, which say which step failed.
trap 'rc=$?; [[ $BASH_SUBSHELL -eq 0 ]] && log "failed (exit $rc) at ${BASH_SOURCE[0]##*/}:$LINENO in ${FUNCNAME[*]:-main}: $BASH_COMMAND"' ERR

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

# wait_port_closed HOST PORT: up to 5 s. Callers (outage tests) expect a stopped service's port
# to refuse connections when the stop command returns.
wait_port_closed() {
  local _
  for _ in {1..50}; do port_open "$1" "$2" || break; sleep 0.1; done
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
