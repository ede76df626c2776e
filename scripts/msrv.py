#!/usr/bin/env python3
"""Minimum-Rust-version gate (`make msrv`).

The workspace promises `rust-version` in Cargo.toml. Building with exactly that toolchain would
prove it, but the machines this project runs on have one toolchain and cannot download another.
What can be checked with one toolchain, and what breaks the promise in practice:

1. every workspace member inherits the same `rust-version`;
2. no package in the resolved graph (Cargo.lock, for this host) declares a `rust-version` newer
   than ours: a `cargo update` that pulls such a crate would break a user on our minimum;
3. the installed rustc is at least `rust-version` (so the build we test is not of a compiler older
   than the one we claim).

Our own code using an API newer than `rust-version` is not caught here (clippy's
`incompatible_msrv` lint, which reads the same field, catches most of that in `make clippy`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys


def parse(version: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise SystemExit(f"msrv: cannot parse version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def main() -> int:
    cargo = sys.argv[1] if len(sys.argv) > 1 else "cargo"
    host = re.search(r"^host: (\S+)$", subprocess.check_output(["rustc", "-vV"], text=True), re.M)
    if host is None:
        raise SystemExit("msrv: `rustc -vV` printed no host")
    meta = json.loads(
        subprocess.check_output(
            [cargo, "metadata", "--format-version", "1", "--locked", "--filter-platform", host.group(1)],
            text=True,
        )
    )
    members = set(meta["workspace_members"])
    ours = {p["name"]: p.get("rust_version") for p in meta["packages"] if p["id"] in members}
    declared = set(ours.values())
    if None in declared or len(declared) != 1:
        print(f"msrv: FAIL: every workspace member must inherit one rust-version; found {ours}")
        return 1
    msrv_text = declared.pop()
    msrv = parse(msrv_text)

    # Only packages that are in the resolved graph for this host (not every entry of the lock).
    resolved = {node["id"] for node in meta["resolve"]["nodes"]}
    newer = sorted(
        (p["name"], p["version"], p["rust_version"])
        for p in meta["packages"]
        if p["id"] in resolved and p["id"] not in members and p.get("rust_version")
        if parse(p["rust_version"]) > msrv
    )
    failed = False
    if newer:
        failed = True
        print(f"msrv: FAIL: {len(newer)} dependencies need a newer Rust than rust-version = {msrv_text}:")
        for name, version, rv in newer:
            print(f"  {name} {version} needs {rv} (pin an older version: cargo update -p {name} --precise ...)")

    rustc = subprocess.check_output(["rustc", "--version"], text=True).split()[1]
    if parse(rustc) < msrv:
        failed = True
        print(f"msrv: FAIL: rustc {rustc} is older than rust-version = {msrv_text}")
    if failed:
        return 1
    deps = len(resolved - members)
    print(f"msrv: ok: rust-version = {msrv_text}; {deps} dependencies need at most that; rustc {rustc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
