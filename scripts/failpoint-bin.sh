#!/usr/bin/env bash
# Builds the `shardstream` command with `--features failpoints` (debug) and prints its path: a copy
# beside the normal build (target/debug/shardstream-failpoints), so that the next build without the
# feature does not replace it. Only the shardstream crate recompiles for the feature.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
cargo build --quiet -p shardstream --features failpoints --bin shardstream >&2
cp -f "$target/debug/shardstream" "$target/debug/shardstream-failpoints"
realpath "$target/debug/shardstream-failpoints"
