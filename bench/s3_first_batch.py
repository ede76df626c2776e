"""Where the first batch of a cold S3 Parquet epoch waits: the dataset's open (with a manifest and
its footers bundle: two requests), then the downloads the first shuffle window needs.

Usage: ``python bench/s3_first_batch.py [DIR] [--repeats N]`` (DIR: a Parquet set made by
``parquet_bench.py``, by default its image set in pack's layout). Serves DIR's files from a local
s3s-fs (hard links), runs ``shardstream index`` on them, then per repeat starts a fresh daemon with
an empty node cache and prints the open's time and requests, and what the first batch of
``format="arrow"`` then waited for: seconds, requests and MB downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import daemon as bench_daemon  # noqa: E402
from s3server import S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, nargs="?", default=ROOT / "bench/data/parquet/image-100000-plain")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import shardstream

    files = sorted(args.dir.glob("*.parquet"))
    if not files:
        sys.exit(f"no Parquet files in {args.dir}: make them with bench/parquet_bench.py first")
    root = args.dir.parent / f".s3-first-batch-{os.getpid()}"
    server = S3Server(root).start()
    try:
        bucket = server.bucket("bench") / "set"
        bucket.mkdir(parents=True)
        for f in files:
            os.link(f, bucket / f.name)
        url = "s3://bench/set/"
        env = {**os.environ, **server.env()}
        subprocess.run([str(bench_daemon.executable()), "index", url], env=env, check=True, capture_output=True)
        os.environ.update(server.env())
        for rep in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix="s3-first-batch-"))
            d = bench_daemon.Daemon.start(work)
            try:
                conn = shardstream._native.Connection(d.addr)
                t0 = time.perf_counter()
                conn.open(url)
                opened = time.perf_counter() - t0
                st0 = conn.status()
                t1 = time.perf_counter()
                next(iter(shardstream.Loader(url, batch_size=256, seed=rep, connect=d.addr, format="arrow")))
                first = time.perf_counter() - t1
                st = conn.status()
                print(
                    f"[{rep}] open {opened:.3f} s, {st0['storage_requests']} requests; first batch "
                    f"{first:.3f} s later: {st['storage_requests'] - st0['storage_requests']} requests, "
                    f"{(st['storage_bytes'] - st0['storage_bytes']) / 1e6:,.0f} MB downloaded"
                )
            finally:
                d.stop()
                shutil.rmtree(work, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
