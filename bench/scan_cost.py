"""The TAR scan's cost per sample, measured with `shardstream index` (bench/PROFILES.md, section 1,
"a key hash per sample in the TAR scan"; not part of `make bench`).

Writes `--shards` shards of `--samples` two-member samples of 64 bytes each (the scan's cost with
the least payload around it), then runs `shardstream index` of them with each `--bin`, the
binaries alternated for `--rounds` rounds, and prints each run's wall, user and system seconds
and each binary's median user CPU.

Usage: ``python bench/scan_cost.py --bin before=OLD/shardstream --bin after=target/release/shardstream
[--shards 8] [--samples 50000] [--rounds 4]``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path


def write_shards(root: Path, shards: int, samples: int) -> None:
    payload = b"x" * 64
    for s in range(shards):
        with tarfile.open(root / f"shard-{s:04d}.tar", "w", format=tarfile.USTAR_FORMAT) as t:
            for i in range(samples):
                for ext in ("cls", "txt"):
                    info = tarfile.TarInfo(f"s{s}/{i:07d}.{ext}")
                    info.size = len(payload)
                    t.addfile(info, io.BytesIO(payload))


def index_once(binary: str, root: Path) -> tuple[float, float, float]:
    """(wall, user, system) seconds of one `shardstream index` of `root`, from a clean directory."""
    (root / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(root / "_shardstream", ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.Popen([binary, "index", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own resource usage
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{binary} index failed: {proc.stderr.read().decode() if proc.stderr else ''}")
    return wall, usage.ru_utime, usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH of a shardstream binary")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=50_000, help="samples a shard")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    bins = [tuple(b.split("=", 1)) for b in args.bin]
    with tempfile.TemporaryDirectory(prefix="scan-cost-") as tmp:
        root = Path(tmp)
        write_shards(root, args.shards, args.samples)
        print(f"{args.shards} shards x {args.samples} samples; load {os.getloadavg()[0]:.2f}")
        user: dict[str, list[float]] = {name: [] for name, _ in bins}
        for r in range(args.rounds):
            for name, path in bins:
                wall, utime, stime = index_once(path, root)
                user[name].append(utime)
                print(f"round {r + 1} {name}: wall {wall:.2f} s, user {utime:.2f} s, sys {stime:.2f} s")
        for name, times in user.items():
            print(f"{name}: user CPU median {statistics.median(times):.3f} s ({min(times):.2f}-{max(times):.2f})")
        print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
