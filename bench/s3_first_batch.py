"""Where the first batch of a cold S3 Parquet epoch waits: the dataset's open (with a manifest and
its footers bundle: two requests), then the downloads the first shuffle window needs.

Usage: ``python bench/s3_first_batch.py [DIR] [--repeats N] [--fields a,b] [--site DIR]`` (DIR: a Parquet set made by
``parquet_bench.py``, by default its image set in pack's layout). Serves DIR's files from a local
s3s-fs (hard links), runs ``shardstream index`` on them, then per repeat starts a fresh daemon with
an empty node cache and prints the open's time and requests, and what the first batch of
``format="arrow"`` then waited for: seconds, requests and MB downloaded.

It also prints the files the first batch draws on (from its rows' ids and the manifest) and how long
the plain concurrent client of ``make bench``'s S3 rows (``target/release/examples/s3_fetch``,
all of them at once, one GET each) takes to download just those files from the same server: the
least any loader that fetches whole files could wait for that batch here. And what one small
ranged GET costs on this server, of one of those files and of a 1 KB object: s3s-fs reads the
whole object for every GET, so a request's cost grows with its object's size, not its range's.
"""

from __future__ import annotations

import argparse
import bisect
import json
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


def first_files(manifest: dict, row_ids: list[int]) -> list[dict]:
    """The manifest's shards that rows `row_ids` lie in (row ids count through the shards in order)."""
    starts, total = [], 0
    for sh in manifest["shards"]:
        starts.append(total)
        total += sh["samples"]
    hit = sorted({bisect.bisect_right(starts, r) - 1 for r in row_ids})
    return [manifest["shards"][i] for i in hit]


def plain_fetch(env: dict[str, str], bucket: str, prefix: str, concurrency: int) -> dict:
    """`s3_fetch` of every object under `prefix`: its JSON report (seconds, bytes)."""
    exe = ROOT / "target/release/examples/s3_fetch"
    if not exe.exists():
        subprocess.run(["cargo", "build", "--release", "-q", "--example", "s3_fetch"], cwd=ROOT, check=True)
    out = subprocess.run(
        [str(exe), bucket, prefix, str(concurrency), str(64 << 20)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"s3_fetch failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def ranged_get_ms(env: dict[str, str], bucket: str, key: str, rounds: int = 10) -> tuple[float, float]:
    """Least and median milliseconds of a GET of the first 100 bytes of `key` (boto3, which the
    bench's peers bring along)."""
    import boto3

    c = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    took = []
    for _ in range(rounds):
        t = time.perf_counter()
        c.get_object(Bucket=bucket, Key=key, Range="bytes=0-99")["Body"].read()
        took.append((time.perf_counter() - t) * 1000)
    took.sort()
    return took[0], took[len(took) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, nargs="?", default=ROOT / "bench/data/parquet/image-100000-plain")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fields", help="comma-separated columns to stream (all by default)")
    ap.add_argument("--site", help="another build of the package (a `pip install --target` directory)")
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
        (server.bucket("bench") / "small.bin").write_bytes(b"x" * 1000)
        big = ranged_get_ms(env, "bench", f"set/{files[0].name}")
        small = ranged_get_ms(env, "bench", "small.bin")
        print(
            f"a 100-byte ranged GET takes {big[0]:.1f} / {big[1]:.1f} ms (least / median of 10) of a "
            f"{files[0].stat().st_size / 1e6:.0f} MB file, {small[0]:.1f} / {small[1]:.1f} ms of a 1 KB object"
        )
        for rep in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix="s3-first-batch-"))
            d = bench_daemon.Daemon.start(work, site=args.site)
            try:
                conn = shardstream._native.Connection(d.addr)
                t0 = time.perf_counter()
                conn.open(url)
                opened = time.perf_counter() - t0
                st0 = conn.status()
                t1 = time.perf_counter()
                fields = args.fields.split(",") if args.fields else None
                loader = shardstream.Loader(
                    url, batch_size=256, seed=rep, connect=d.addr, format="arrow", fields=fields
                )
                batch = next(iter(loader))
                first = time.perf_counter() - t1
                st = conn.status()
                print(
                    f"[{rep}] open {opened:.3f} s, {st0['storage_requests']} requests; first batch "
                    f"{first:.3f} s later: {st['storage_requests'] - st0['storage_requests']} requests, "
                    f"{(st['storage_bytes'] - st0['storage_bytes']) / 1e6:,.0f} MB downloaded"
                )
                needed = first_files(json.loads((bucket / "manifest.json").read_text()), batch["__row__"].to_pylist())
                only = server.bucket("bench") / f"first-{rep}"
                only.mkdir()
                for sh in needed:
                    os.link(bucket / sh["name"], only / sh["name"])
                plain = plain_fetch(env, "bench", f"first-{rep}/", len(needed))
                print(
                    f"    it draws on {len(needed)} files ({sum(sh['bytes'] for sh in needed) / 1e6:,.0f} MB); "
                    f"the plain client downloads just those in {plain['seconds']:.3f} s"
                )
            finally:
                d.stop()
                shutil.rmtree(work, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
