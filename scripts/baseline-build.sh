#!/usr/bin/env bash
# Builds an earlier commit's release wheel once and installs it into DIR/site, for a bench to
# measure it in the same run as this build (`--variant NAME=DIR/site`). Prints DIR/site.
#
#   bash scripts/baseline-build.sh COMMIT DIR PYTHON
#
# PYTHON: an interpreter with maturin and pip (the bench venv). The sources come from
# `git archive` (no worktree left behind); a second call for the same commit reuses the build.
set -euo pipefail

commit=$(git rev-parse --verify "${1:?commit}^{commit}")
dir=${2:?output directory}
py=${3:?python with maturin and pip}
site="$dir/site"

if [[ -f "$site/.commit" && "$(cat "$site/.commit")" == "$commit" ]]; then
  echo "$site"
  exit 0
fi
rm -rf "$dir/src" "$dir/wheel" "$site"
mkdir -p "$dir/src"
git archive "$commit" | tar -x -C "$dir/src"
echo "baseline-build: release build of ${commit:0:12} (once; ~10 min on 2 cores)" >&2
CARGO_TARGET_DIR="$dir/target" "$py" -m maturin build --quiet --release \
  -m "$dir/src/loader-py/Cargo.toml" -o "$dir/wheel" >&2
"$py" -m pip install --quiet --no-deps --target "$site" "$dir"/wheel/shardstream-*.whl >&2
echo "$commit" >"$site/.commit"
rm -rf "$dir/src"
echo "$site"
