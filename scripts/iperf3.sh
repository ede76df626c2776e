#!/usr/bin/env bash
# iperf3 for bench/inline_bench.py's TCP floor (single stream, -l 1M). Installed from Debian when
# missing and apt-get can run (root); otherwise the bench measures the floor with a Python socket
# pair and says so in its report.
set -euo pipefail
command -v iperf3 >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  # The package asks whether to start a system-wide iperf3 daemon: no.
  echo "iperf3 iperf3/start_daemon boolean false" | debconf-set-selections 2>/dev/null || true
  apt-get -o DPkg::Lock::Timeout=600 install -y -q iperf3 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get -o DPkg::Lock::Timeout=600 install -y -q iperf3 >/dev/null 2>&1; } || true
fi
command -v iperf3 >/dev/null || echo "iperf3 unavailable: the inline bench falls back to a Python socket pair" >&2
