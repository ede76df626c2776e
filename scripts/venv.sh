#!/usr/bin/env bash
# Creates (or reuses) the project's Python virtualenv and links it as ./.venv (./.venv-bench with
# --bench).
#
# torch alone is ~6 GB with its CUDA wheels, so the environment lives in a cache directory outside
# the clone (SHARDSTREAM_CACHE, default ~/.cache/shardstream), keyed by a hash of the requirement
# files: a fresh clone on a machine that already built it reuses it, a fresh machine builds it once.
set -euo pipefail
cd "$(dirname "$0")/.."
reqs=(requirements-test.txt)
link=.venv
if [ "${1:-}" = "--bench" ]; then
  # The peers of the benchmark (MosaicML streaming, LitData) pin their own dependencies: they get
  # an environment of their own, so they can never change what the tests run against.
  reqs+=(bench/requirements.txt)
  link=.venv-bench
fi
py=${PYTHON:-python3}
key=$(cat "${reqs[@]}" | { cat; $py -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
cache=${SHARDSTREAM_CACHE:-$HOME/.cache/shardstream}
venv="$cache/venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "==> creating Python environment $venv (first time on this machine: a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  $py -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  for r in "${reqs[@]}"; do "$venv/bin/pip" install --quiet -r "$r"; done
  touch "$venv/.complete"
fi
ln -sfn "$venv" "$link"
# Each change to the requirements makes a new environment of ~6.5 GB, and the old ones would fill
# the disk the tests' datasets need. Kept: the two last used of each kind (tests, bench), so going
# back and forth between two commits does not rebuild one every time.
kind=${link#.}
echo "$kind" >"$venv/.kind"
touch "$venv/.used"
kept=0
while read -r used; do
  dir=$(dirname "$used")
  [ "$(cat "$dir/.kind" 2>/dev/null)" = "$kind" ] || continue
  kept=$((kept + 1))
  if [ $kept -gt 2 ]; then
    echo "==> removing $dir (an older Python environment)" >&2
    rm -rf "$dir"
  fi
done < <(ls -t "$cache"/venv-*/.used 2>/dev/null)
echo "$venv"
