"""What each open stream costs the daemon, in memory and in CPU while it waits, over an S3
Parquet dataset of many row groups read by column-chunk copies (bench/S3_RESULTS.md, "What a
stream costs the daemon over many row groups"; not part of `make bench`).

The set: `--files` Parquet files of `--row-groups` row groups of 10 rows each (`id`, a 200-byte
`blob`), so the plan's per-row-group figures dominate; streams select `id` only, so they read
column-chunk copies, and the node cache is smaller than those chunks, so the copies are one per
row group (the largest plan). `--streams` loaders of distinct ranks (or with `--workers` one
rank's workers) each take one batch and are held open; the daemon's resident memory (VmRSS) is
read with none open, then with all, and its CPU over 5 s while they wait (a trainer busy with
its batch).

Usage: ``python bench/plan_memory.py BIN [BIN ...] [--streams 16] [--workers] [--wrap CMD]``,
each a `shardstream` binary (`--wrap`: a profiler the daemon runs under; its CPU and memory then
include the profiler's, so read the profile, not the figures). Needs the S3 server
(``SHARDSTREAM_S3_SERVER="$(bash scripts/s3-server.sh)"``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import measure  # noqa: E402
from s3server import S3Server  # noqa: E402

import shardstream  # noqa: E402
from conftest import Daemon  # noqa: E402

URL = "s3://bench/pq/"
ROWS_PER_GROUP = 10
HOLD_S = 5.0


def write_set(bucket: Path, files: int, groups: int) -> int:
    """The files; the bytes of their `id` chunks' values (a floor under the copies' bytes)."""
    bucket.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = groups * ROWS_PER_GROUP
    for k in range(files):
        ids = np.arange(k * rows, (k + 1) * rows)
        blob = pa.array([rng.bytes(200) for _ in range(rows)], pa.binary())
        pq.write_table(
            pa.table({"id": ids, "blob": blob}),
            bucket / f"part-{k:03d}.parquet",
            row_group_size=ROWS_PER_GROUP,
            compression="none",
            use_dictionary=False,
        )
    return files * rows * 8


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the daemon `pid` (`measure.cpu_seconds`)."""
    cpu = measure.cpu_seconds(pid)
    if cpu is None:
        raise RuntimeError(f"daemon {pid} is gone")
    return cpu


def one_daemon(
    binary: str, tmp: Path, env: dict[str, str], cache: int, streams: int, workers: bool, wrap: list[str]
) -> tuple[float, float, float, float, float]:
    """(RSS with no stream, with `streams` open, seconds to open them all, the daemon's CPU
    share while they are open and waiting, what it fetched meanwhile in node caches' worth) of
    one daemon; the streams are ranks of one job, or with `workers` the workers of one rank."""
    d = Daemon(tmp / "d", binary=binary, env=env, args=["--cache-size", str(cache)], wrap=wrap)
    d.start()
    held = []
    try:
        assert d.proc is not None
        # Open the dataset once, so its footers and index are in the figure before the streams.
        warm = shardstream.Loader(URL, batch_size=64, seed=0, connect=d.addr, fields=["id"], format="arrow")
        next(iter(warm))
        del warm
        time.sleep(0.5)
        base = rss_mib(d.proc.pid)
        t0 = time.perf_counter()
        for r in range(streams):
            loader = shardstream.Loader(
                URL,
                batch_size=64,
                seed=0,
                connect=d.addr,
                fields=["id"],
                format="arrow",
                **({"_worker": (r, streams)} if workers else {"rank": r, "world_size": streams}),
            )
            it = iter(loader)
            next(it)
            held.append((loader, it))
        took = time.perf_counter() - t0
        time.sleep(0.5)
        # Streams waiting on their trainers: what the daemon spends meanwhile is its planning
        # (the prefetcher's tick walks every stream's future ten times a second).
        c0, w0, b0 = cpu_s(d.proc.pid), time.perf_counter(), d.status()["storage_bytes"]
        time.sleep(HOLD_S)
        idle = (cpu_s(d.proc.pid) - c0) / (time.perf_counter() - w0)
        return base, rss_mib(d.proc.pid), took, idle, (d.status()["storage_bytes"] - b0) / cache
    finally:
        held.clear()
        d.stop()
        shutil.rmtree(tmp / "d", ignore_errors=True)


def over_builds(args: argparse.Namespace, what: str, each: Callable[[str, Path, dict[str, str], int], str]) -> None:
    """Writes the set (`args.files` x `args.row_groups`), starts the S3 server, and runs `each`
    (binary, scratch directory, the server's environment, a node cache of half the `id` chunks)
    for every build in `args.bins` and round, the builds' order alternating by round, printing
    what it says."""
    tmp = Path(tempfile.mkdtemp(prefix="plan-memory-"))
    ids = write_set(tmp / "s3" / "bench" / "pq", args.files, args.row_groups)
    s3 = S3Server(tmp / "s3").start()
    print(f"{args.files} files x {args.row_groups} row groups ({args.files * args.row_groups:,}), {what}")
    try:
        for r in range(args.rounds):
            for b in args.bins if r % 2 == 0 else list(reversed(args.bins)):
                print(f"round {r} {b}: {each(b, tmp, s3.env(), ids // 2)}", flush=True)
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bins", nargs="+")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--row-groups", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", action="store_true", help="the streams are one rank's workers, not ranks")
    ap.add_argument(
        "--wrap", default="", help='a profiler the daemon runs under, e.g. "heaptrack -o /tmp/heap" or "perf record -g"'
    )
    args = ap.parse_args()
    groups = args.files * args.row_groups

    def each(binary: str, tmp: Path, env: dict[str, str], cache: int) -> str:
        base, full, took, idle, fetched = one_daemon(
            binary, tmp, env, cache, args.streams, args.workers, shlex.split(args.wrap)
        )
        per = (full - base) / args.streams
        return (
            f"{base:.0f} MiB with none, {full:.0f} MiB with {args.streams} "
            f"({per:.1f} MiB a stream, {per * 2**20 / groups:.0f} bytes a row group); opened in {took:.1f} s; "
            f"{idle:.2f} cores busy while they wait, fetching {fetched:.2f}x the node cache"
        )

    who = "one rank's workers" if args.workers else "ranks"
    over_builds(args, f"{args.streams} streams of `id` ({who})", each)
    return 0


if __name__ == "__main__":
    sys.exit(main())
