#!/bin/bash
# Interleaved `perf stat` of `tar cf` and `shardstream pack` (old and new build) on one tree: the
# loop behind the pack section of bench/PROFILES.md. Usage: bench/pack_profile.sh SRC [OLD_PYTHONPATH]
# (OLD_PYTHONPATH: a directory holding an older `shardstream` package; its rows are left out
# without it). Prints wall time, task-clock (ms), page faults and context switches per run.
set -euo pipefail
SRC=$1
OLD=${2:-}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SS=$(command -v shardstream)
stat_of() { perf stat -x, -e task-clock,page-faults,context-switches "$@" 2>&1 >/dev/null | awk -F, '{printf "%s=%s ", $3, $1}'; }
timed() {
  local name=$1; shift
  rm -rf "$OUT/x"; mkdir -p "$OUT/x"
  local s e r
  s=$(date +%s.%N); r=$(stat_of "$@"); e=$(date +%s.%N)
  echo "$name wall=$(echo "$e - $s" | bc) $r"
}
for i in 1 2 3; do
  timed "tar#$i" tar cf "$OUT/x/t.tar" -C "$SRC" .
  if [ -n "$OLD" ]; then timed "before#$i" env PYTHONPATH="$OLD" "$SS" pack "$SRC" --output "$OUT/x/p"; fi
  timed "after#$i" "$SS" pack "$SRC" --output "$OUT/x/p"
done
uptime
