#!/usr/bin/env bash
# Installs libfabric's runtime library (libfabric.so.1, Debian 12: 1.17) so the `rdma` transport
# and its tests run over the `tcp;ofi_rxm` and `shm` providers. Nothing needs it to *build*: the
# binary and the wheel dlopen it at run time. `--dev` adds the headers, `fi_info` and iperf3, only
# for scripts/fabric_layout.sh (checks our struct layouts against the real headers) and the bench.
set -euo pipefail
pkgs=(libfabric1)
if [ "${1:-}" = "--dev" ]; then pkgs+=(libfabric-dev libfabric-bin iperf3 gcc libc6-dev); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/libfabric.sh: need root to apt-get install ${missing[*]} (the rdma tests skip without it)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
