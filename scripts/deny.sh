#!/usr/bin/env bash
# cargo-deny gate (`make deny`): licences, bans and sources always (they need only Cargo.lock and
# deny.toml); advisories only when the RustSec database can be fetched (it lives on github.com,
# which CI and the developer machines cannot reach). An unchecked advisory step is printed, never
# skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."
deny=$(bash scripts/tool.sh cargo-deny)
"$deny" --log-level error check --hide-inclusion-graph licenses bans sources
if timeout 60 "$deny" --log-level error fetch db >/dev/null 2>&1; then
  "$deny" --log-level error --offline check --hide-inclusion-graph advisories
else
  echo "cargo-deny: ADVISORIES NOT CHECKED: the RustSec advisory database could not be fetched" \
    "(no route to github.com); run \`make deny\` where it can be reached."
fi
