"""How long the daemon takes to read the first page headers of many one-part S3 Parquet files
(bench/S3_RESULTS.md, "One-part uploads whose pages carry checksums"; not part of `make bench`).

Writes `--files` files of 40 rows (`id`, a 2,000-byte `blob`, snappy, pyarrow page checksums:
`tests/test_parquet.py`'s `write_blob_files`) to the test S3 server, starts a daemon with a node
cache of 3/4 of them, streams every column until the first batch, and prints the daemon's own
line for the probe (its `ms`) and the time to the first batch. `--hold` puts the chaos proxy in
front, holding every object GET that many seconds (a remote store's round trip).

Usage: ``python bench/probe_time.py [--files 2000] [--hold 0.03] [--bin PATH]``. Needs the S3
server (``SHARDSTREAM_S3_SERVER="$(bash scripts/s3-server.sh)"``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from chaos.proxy import FaultProxy  # noqa: E402
from s3server import S3Server  # noqa: E402
from test_parquet import write_blob_files  # noqa: E402

import shardstream  # noqa: E402
from conftest import SHARDSTREAM, Daemon  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--hold", type=float, default=0.0, help="seconds the proxy holds each object GET")
    ap.add_argument("--bin", default=SHARDSTREAM, help="the shardstream binary")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="probe-time-"))
    bucket = tmp / "s3" / "data" / "many"
    write_blob_files(bucket, 0, files=args.files, rows=40, blob=2000)
    size = sum(p.stat().st_size for p in bucket.iterdir())
    s3 = S3Server(tmp / "s3").start()
    env = s3.env()
    proxy = None
    if args.hold:
        proxy = FaultProxy(s3.port, rate=0.0, hold=args.hold).start()
        env = {**env, "AWS_ENDPOINT_URL": proxy.endpoint}
    log = tmp / "daemon.log"
    d = Daemon(tmp / "d", binary=args.bin, env=env, args=["--cache-size", str(size * 3 // 4)], log=log, level="info")
    d.start()
    try:
        shardstream._native.Connection(d.addr).open("s3://data/many/")
        t = time.perf_counter()
        next(iter(shardstream.Loader("s3://data/many/", batch_size=32, seed=0, connect=d.addr)))
        first = time.perf_counter() - t
    finally:
        d.stop()
        s3.stop()
        if proxy:
            proxy.stop()
    probes = [line for line in log.read_text().splitlines() if "first page headers" in line]
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.files} files, hold {args.hold} s: first batch after {first:.2f} s")
    print(probes[-1] if probes else "no probe ran")
    return 0 if probes else 1


if __name__ == "__main__":
    sys.exit(main())
