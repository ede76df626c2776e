"""What choosing victims costs once the node cache holds thousands of entries: one stream's
first epoch over an S3 Parquet dataset of many row groups read by column-chunk copies through a
node cache of half of them, so that nearly every copy fetched evicts another
(bench/S3_RESULTS.md, "Choosing what to evict"; not part of `make bench`).

The set is `plan_memory.py`'s: `--files` files of `--row-groups` row groups of 10 rows; the
stream reads `id` only (a copy of ~700 bytes a row group). Each build gets a fresh daemon per
round, the builds' order alternating by round. Reported: the epoch's seconds, the daemon's CPU
seconds over it, its prefetch thread's over the daemon's life (the walks: a steadier figure than
the whole daemon's, which the fetches' and the stream's threads move by several seconds from run
to run), and what
it fetched (the same for every build: the plan does not change).

Usage: ``python bench/evict_scale.py BIN [BIN ...] [--files 64] [--row-groups 500] [--rounds 2]
[--wrap CMD]``. Needs the S3 server (``SHARDSTREAM_S3_SERVER="$(bash scripts/s3-server.sh)"``).
The epoch is bound by the S3 server's requests as much as by the daemon (s3s-fs hashes a whole
object per GET: many small files keep that cheap), so read the daemon's CPU first.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import measure  # noqa: E402
import plan_memory  # noqa: E402

import shardstream  # noqa: E402
from conftest import Daemon  # noqa: E402


def one_epoch(
    binary: str, tmp: Path, env: dict[str, str], cache: int, wrap: list[str]
) -> tuple[float, float, float, int, int]:
    """(seconds, daemon CPU seconds, its prefetch thread's, rows, bytes fetched) of a first
    epoch on a fresh daemon."""
    d = Daemon(tmp / "d", binary=binary, env=env, args=["--cache-size", str(cache)], wrap=wrap)
    d.start()
    try:
        assert d.proc is not None
        loader = shardstream.Loader(
            plan_memory.URL, batch_size=256, seed=0, connect=d.addr, fields=["id"], format="arrow"
        )
        t0, c0, rows = time.perf_counter(), plan_memory.cpu_s(d.proc.pid), 0
        for batch in loader:
            rows += batch.num_rows
        took = time.perf_counter() - t0
        walks = measure.thread_cpu_seconds(d.proc.pid, "prefetch")
        return took, plan_memory.cpu_s(d.proc.pid) - c0, walks, rows, d.status()["storage_bytes"]
    finally:
        d.stop()
        shutil.rmtree(tmp / "d", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bins", nargs="+")
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--row-groups", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wrap", default="", help='a profiler the daemon runs under, e.g. "perf record -o /tmp/p"')
    args = ap.parse_args()
    groups = args.files * args.row_groups

    def each(binary: str, tmp: Path, env: dict[str, str], cache: int) -> str:
        took, cpu, walks, rows, fetched = one_epoch(binary, tmp, env, cache, shlex.split(args.wrap))
        return (
            f"{rows:,} rows in {took:.1f} s ({groups / took:,.0f} row groups/s), "
            f"daemon CPU {cpu:.1f} s (prefetch thread {walks:.1f} s), fetched {fetched:,} B"
        )

    plan_memory.over_builds(args, "a stream of `id`, a node cache of half its chunks", each)
    return 0


if __name__ == "__main__":
    sys.exit(main())
