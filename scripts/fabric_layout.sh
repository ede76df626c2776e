#!/usr/bin/env bash
# Regenerates fabric/src/layout_expected.rs: sizes and offsets of the libfabric structs that
# fabric/src/ffi.rs declares by hand, measured by the C compiler against the real headers
# (`bash scripts/libfabric.sh --dev` installs them). Run after changing ffi.rs; never at build time.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cc -std=c11 -Wall -Werror -o "$tmp/layout" "$here/scripts/fabric_layout.c"
"$tmp/layout" > "$here/fabric/src/layout_expected.rs"
echo "wrote fabric/src/layout_expected.rs"
