#!/usr/bin/env bash
# Prints the path of the S3-compatible server the tests and the benchmark run on 127.0.0.1
# (s3s-fs: SigV4 checked, ETags and ranged GETs as S3, objects are files in a directory), building
# it once per machine into the same cache directory as the Python environment (scripts/venv.sh).
set -euo pipefail
version=0.14.1   # 0.17 needs a newer rustc than this project's minimum
cache=${SHARDSTREAM_CACHE:-$HOME/.cache/shardstream}
root="$cache/tools/s3s-fs-$version"
bin="$root/bin/s3s-fs"
if [ ! -x "$bin" ]; then
  echo "==> building s3s-fs $version (first time on this machine: ~3 minutes)" >&2
  cargo install --quiet --locked --features binary "s3s-fs@$version" --root "$root" >&2
fi
echo "$bin"
