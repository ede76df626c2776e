#!/usr/bin/env bash
# Installs what the two-host tests (tests/netns.py) need: the `ip` command from iproute2.
# A no-op when it is already there; without root or apt-get it says why and the netns variants of
# the tests skip (they run on loopback instead).
set -euo pipefail
if command -v ip >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "netns-tools: no \`ip\` command and cannot install iproute2 here (needs root and apt-get);" \
    "the two-host tests will skip their network-namespace variants" >&2
  exit 0
fi
apt-get install -y -qq iproute2 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iproute2; }
