"""Two builds of the daemon on cold S3 Parquet epochs, interleaved: what checking a copy's bytes
by its pages' checksums costs (bench/PARQUET_RESULTS.md, "Copies checked by their pages"; not
part of `make bench`).

Two sets of 16 files x 2,000 rows (`id`, `label`, a 5 KB `blob`, a 10 KB `other`; row groups of
500, stored plain), one written with page checksums (pyarrow `write_page_checksum=True`), one
without, on the test S3 server. Per round, build and set: a fresh daemon (empty cache) and one
`format="arrow"` epoch of `id,blob` (column-chunk copies) and of every column (whole files); the
order of the builds alternates by round. Reported per case: the epoch's seconds and the daemon's
CPU-s, median and range.

Usage: ``python bench/s3_check_ab.py OLD_BIN NEW_BIN [--rounds 4]``, each a `shardstream` binary
(e.g. ``cargo build --release`` of a worktree at the commit before). Needs the S3 server
(``SHARDSTREAM_S3_SERVER="$(bash scripts/s3-server.sh)"``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3server import S3Server  # noqa: E402

import shardstream  # noqa: E402
from conftest import Daemon  # noqa: E402

FILES, ROWS = 16, 2000


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_files(bucket: Path, rng: np.random.Generator, checksums: bool = False) -> None:
    """`FILES` files x `ROWS` rows of `id`, `label`, a 5 KB `blob` and a 10 KB `other`, row groups
    of 500, stored plain, into `bucket` (also `small_cache_ab.py`'s set)."""
    bucket.mkdir(parents=True)
    for k in range(FILES):
        ids = np.arange(k * ROWS, (k + 1) * ROWS)
        table = pa.table(
            {
                "id": ids,
                "label": (ids % 10).astype(np.int32),
                "blob": pa.array([rng.bytes(5000) for _ in ids], pa.binary()),
                "other": pa.array([rng.bytes(10000) for _ in ids], pa.binary()),
            }
        )
        pq.write_table(
            table,
            bucket / f"part-{k:02d}.parquet",
            row_group_size=500,
            compression="none",
            use_dictionary=False,
            write_page_checksum=checksums,
        )


def write_sets(s3: S3Server) -> None:
    rng = np.random.default_rng(1)
    for checksums in (False, True):
        write_files(s3.bucket("data") / ("crc" if checksums else "plain"), rng, checksums)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="s3-check-ab-"))
    s3 = S3Server(tmp / "s3").start()
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        write_sets(s3)
        n = 0
        for r in range(args.rounds):
            builds = [("old", args.old), ("new", args.new)]
            for name, binary in builds if r % 2 == 0 else builds[::-1]:
                for data in ("plain", "crc"):
                    for fields in (["id", "blob"], None):
                        n += 1
                        d = Daemon(tmp / f"d{n}", binary=binary, env=s3.env()).start()
                        try:
                            assert d.proc is not None
                            cpu0, t0, rows = cpu_seconds(d.proc.pid), time.perf_counter(), 0
                            url = f"s3://data/{data}/"
                            loader = shardstream.Loader(
                                url, batch_size=256, seed=r, connect=d.addr, fields=fields, format="arrow"
                            )
                            for batch in loader:
                                rows += batch.num_rows
                            took, cpu = time.perf_counter() - t0, cpu_seconds(d.proc.pid) - cpu0
                            assert rows == FILES * ROWS, rows
                        finally:
                            d.stop()
                            # Each cache holds a whole epoch's copies: gone before the next daemon
                            # sizes its cache by the free disk.
                            shutil.rmtree(tmp / f"d{n}", ignore_errors=True)
                        case = f"{name} {data} {'columns' if fields else 'whole'}"
                        results.setdefault(case, []).append((took, cpu))
    finally:
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("| build, set, read | epoch s median (min-max) | daemon CPU-s median (min-max) |")
    print("|---|---|---|")
    for case in sorted(results):
        secs, cpus = [x[0] for x in results[case]], [x[1] for x in results[case]]
        print(
            f"| {case} | {statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f}) "
            f"| {statistics.median(cpus):.2f} ({min(cpus):.2f}-{max(cpus):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
