# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables set here are used by the hooks that source this
# Shared by prolog, epilog and task-prolog (sourced; install all four side by side).
# Slurm runs these hooks with no PATH, so every command here is an absolute path or a builtin.
#
# Site settings: shardstream.env next to slurm.conf (/etc/slurm/shardstream.env), a root-owned,
# world-readable (0644: the TaskProlog runs as the job's user) file of VAR=value lines, read as
# data, not run as shell (the Prolog runs as root): a value is the rest of its line, taken
# literally (quotes around the whole of it are removed; no $ expansion), optionally after
# `export `; blank lines and lines starting with # are skipped, any other line is logged and
# skipped. Recognised:
#   SHARDSTREAM_BIN            the daemon binary (default /usr/local/bin/shardstream)
#   SHARDSTREAM_RUN_DIR        parent of the per-job socket directories (default
#                              /run/shardstream-jobs)
#   SHARDSTREAM_JOB_CACHE_DIR  parent of the per-job caches (default /var/cache/shardstream-jobs;
#                              put it on node-local NVMe)
#   Neither may be inside the node-wide systemd unit's /run/shardstream or /var/cache/shardstream:
#   systemd deletes the first at every stop and restart, and gives both to the unit's user (0750).
#   SHARDSTREAM_LOG_DIR        hook and daemon logs (default /var/log/shardstream)
#   SHARDSTREAM_CACHE_SIZE     cache capacity per job (default: the daemon's, 90% of the free
#                              space when it starts; jobs that share a node each take that much
#                              of the same disk: set a per-job size where nodes are shared)
#   SHARDSTREAM_SERVE_ARGS     extra `serve` options, split on spaces
#   SHARDSTREAM_START_TIMEOUT  seconds the prolog waits for the daemon to serve (default 60)
#   SHARDSTREAM_PREFETCH_WAIT  seconds the prolog waits for staging before the job starts
#                              (default 0: staging continues in the background)
#   AWS_*                      passed to the daemon (S3 endpoint, region); without them the
#                              daemon reads the job user's ~/.aws as usual. Credentials put here
#                              are readable by every job's user (it owns its daemon process and
#                              so its environment): only keys users may hold, e.g. read-only.

ss_conf_dir() {
  local conf=${SLURM_CONF:-/etc/slurm/slurm.conf}
  printf '%s\n' "${conf%/*}"
}

ss_load_settings() {
  SHARDSTREAM_BIN=/usr/local/bin/shardstream
  SHARDSTREAM_RUN_DIR=/run/shardstream-jobs
  SHARDSTREAM_JOB_CACHE_DIR=/var/cache/shardstream-jobs
  SHARDSTREAM_LOG_DIR=/var/log/shardstream
  SHARDSTREAM_CACHE_SIZE=
  SHARDSTREAM_SERVE_ARGS=
  SHARDSTREAM_START_TIMEOUT=60
  SHARDSTREAM_PREFETCH_WAIT=0
  local env_file
  env_file="$(ss_conf_dir)/shardstream.env"
  [ -r "$env_file" ] && ss_read_settings "$env_file"
  # Used in shell arithmetic, where "60s" or "08" is an error that would fail the hook (and a
  # failed Prolog drains the node): a value that is no plain number of seconds is logged and
  # the default used.
  ss_seconds SHARDSTREAM_START_TIMEOUT 60 "$env_file"
  ss_seconds SHARDSTREAM_PREFETCH_WAIT 0 "$env_file"
}

# ss_read_settings FILE: export each NAME=value line of FILE (see the top of this file).
ss_read_settings() {
  local file=$1 line name value n=0
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line%$'\r'}
    # Surrounding blanks go; a value's inner blanks stay.
    line=${line#"${line%%[![:space:]]*}"}
    line=${line%"${line##*[![:space:]]}"}
    [[ -z $line || $line == '#'* ]] && continue
    line=${line#export }
    if ! [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      ss_log settings "line $n of $file is no NAME=value setting, skipped: $line"
      continue
    fi
    name=${BASH_REMATCH[1]}
    value=${BASH_REMATCH[2]}
    if [[ ${#value} -ge 2 && ($value == \"*\" || $value == \'*\') ]]; then
      value=${value:1:${#value}-2}
    fi
    printf -v "$name" '%s' "$value"
    export "${name?}"
  done <"$file"
}

# ss_seconds VAR DEFAULT FILE: VAR as a plain number of seconds, else DEFAULT (logged).
ss_seconds() {
  local var=$1 default=$2 file=$3
  [[ ${!var-} =~ ^(0|[1-9][0-9]{0,5})$ ]] && return 0
  ss_log settings "$var='${!var-}' in $file is not a number of seconds; using $default"
  printf -v "$var" '%s' "$default"
}

# The job's socket directory and the daemon's pidfile. The pidfile is root's (outside the
# user-owned directory), so a job cannot point the epilog at another process. Fails (the hook
# then exits 0) without a numeric SLURM_JOB_ID: nothing of a job can be named.
ss_job_paths() {
  [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]] || return 1
  JOB_DIR="$SHARDSTREAM_RUN_DIR/job-$SLURM_JOB_ID"
  JOB_SOCK="$JOB_DIR/sock"
  JOB_PIDFILE="$SHARDSTREAM_RUN_DIR/job-$SLURM_JOB_ID.pid"
  JOB_CACHE="$SHARDSTREAM_JOB_CACHE_DIR/job-$SLURM_JOB_ID"
  JOB_LOG="$SHARDSTREAM_LOG_DIR/job-$SLURM_JOB_ID.log"
}

ss_log() {
  local hook=$1
  shift
  # Owner-only when made here: the lines name users, sockets and datasets.
  (
    umask 077
    printf '%s %s job %s: %s\n' "$(/usr/bin/date -u +%FT%TZ)" "$hook" "${SLURM_JOB_ID:-?}" "$*" \
      >>"$SHARDSTREAM_LOG_DIR/slurm-hooks.log"
  ) 2>/dev/null || true
}

# True when PID is alive, runs as UID, and its command line names this job's socket: the check
# before the epilog signals anything.
ss_is_job_process() {
  local pid=$1 uid=$2 line arg
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ -r "/proc/$pid/status" ] || return 1
  while read -r line; do
    if [[ $line == Uid:* ]]; then
      read -r _ arg _ <<<"$line"
      [ "$arg" = "$uid" ] || return 1
      break
    fi
  done <"/proc/$pid/status"
  local -a argv=()
  mapfile -d '' argv <"/proc/$pid/cmdline" 2>/dev/null || return 1
  for arg in "${argv[@]}"; do
    [[ $arg == *"$JOB_SOCK"* ]] && return 0
  done
  return 1
}

# The dataset a job names for staging: a word `shardstream:URL` in its --comment.
ss_dataset_from_comment() {
  local word
  for word in ${1:-}; do
    if [[ $word == shardstream:?* ]]; then
      printf '%s\n' "${word#shardstream:}"
      return 0
    fi
  done
  return 1
}
