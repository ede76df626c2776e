"""Two builds of the daemon on S3 datasets larger than the node cache: bytes downloaded per epoch
(bench/S3_RESULTS.md, "A node cache smaller than the data"; not part of `make bench`).

Cases, each on a fresh daemon with a node cache smaller than what the epochs read:

- `parquet-cols`: 16 Parquet files x 2,000 rows (`id`, `label`, a 5 KB `blob`, a 10 KB `other`;
  row groups of 500, stored plain), a stream of `id,blob` (column-chunk copies), a cache of 3/4 of
  those columns' chunks;
- `parquet-cols-staged`: the same, the cache first staged by `shardstream prefetch --fields
  id,blob` (the epoch's first row groups, until it is full);
- `parquet-all`: the same files, every column (whole files), a cache of 3/4 of the files;
- `parquet-all-mp`: the same, through a proxy that gives every ETag a multipart upload's form
  (`tests/chaos/proxy.py`), as large files get from `aws s3 cp`: no MD5 checks a whole file;
- `parquet-all-mixed`: the same, but one file (`part-15`) keeps the ETag the store gives (an MD5,
  as a small file under `aws s3 cp`'s multipart threshold gets): a dataset uploaded partly in one
  part;
- `parquet-all-crc`: `parquet-all` on the same rows written with page checksums (pyarrow
  `write_page_checksum=True`), straight to the store: one-part uploads whose pages a row group's
  copy is checked by;
- `parquet-all-tls`: `parquet-all` through an HTTPS proxy (`tests/chaos/proxy.py`, certificates
  by `tests/tlsutil.py`, trusted through `AWS_CA_BUNDLE` and, for builds that read only that,
  `SSL_CERT_FILE`): the store as AWS S3 is reached;
- `tar`: WebDataset shards (`bench/gen.py`, 20,000 samples of 16-20 KiB, 250 a shard), a cache
  of half of them (the case of `s3_bench.py`'s "Epoch 2" table, on smaller shards so that half
  the dataset holds many more than a shuffle window's), indexed (`shardstream index`).

Each case runs two epochs of one consumer (seed 0), at full speed (`fast`) and at a trainer's
pace (`paced`: a pause after each batch, so an epoch takes about `--paced-s` seconds), and
reports the bytes fetched from S3 during each epoch as a share of what one epoch reads (an
epoch's figure counts what the prefetcher fetches of the next epoch meanwhile, up to the cache). The order
of the builds alternates by round.

Usage: ``python bench/small_cache_ab.py OLD_BIN NEW_BIN [--rounds 2]``, each a `shardstream`
binary (e.g. ``cargo build --release`` of a worktree at the commit before). Needs the S3 server
(``SHARDSTREAM_S3_SERVER="$(bash scripts/s3-server.sh)"``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import gen  # noqa: E402
import tlsutil  # noqa: E402
from chaos.proxy import FaultProxy  # noqa: E402
from parquet_bench import chunk_bytes  # noqa: E402
from s3_check_ab import FILES, ROWS, write_files  # noqa: E402
from s3server import S3Server  # noqa: E402

import shardstream  # noqa: E402
from conftest import Daemon  # noqa: E402

BATCH = 256


def write_parquet(bucket: Path, checksums: bool = False) -> tuple[int, int]:
    """The Parquet set (with page checksums or not); (bytes of the `id,blob` chunks, bytes of the
    files)."""
    write_files(bucket, np.random.default_rng(1), checksums)
    return chunk_bytes(bucket, ["id", "blob"]), sum(p.stat().st_size for p in bucket.iterdir())


def epoch(addr: str, url: str, e: int, fields: list[str] | None, pause: float) -> int:
    """One epoch of one consumer (Parquet as Arrow record batches); the rows it delivered."""
    parquet = "/pq" in url
    extra = {"fields": fields, "format": "arrow"} if parquet else {}
    loader = shardstream.Loader(url, batch_size=BATCH, seed=0, connect=addr, **extra)
    loader.set_epoch(e)
    n = 0
    for batch in loader:
        n += batch.num_rows if parquet else len(batch["__key__"])
        if pause:
            time.sleep(pause)
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", nargs="*", help="some of the cases only (default: all)")
    ap.add_argument("--paced-s", type=float, default=8.0, help="seconds a paced epoch takes")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="small-cache-ab-"))
    s3root = tmp / "s3"
    selected, pq_bytes = write_parquet(s3root / "bench" / "pq")
    _, crc_bytes = write_parquet(s3root / "bench" / "pqcrc", checksums=True)
    spec = gen.Spec(samples=20_000, per_shard=250)
    base = gen.ensure(ROOT / "bench/data", spec, ["wds"])
    wds = s3root / "bench" / "wds"
    wds.mkdir(parents=True)
    for f in sorted((base / "wds").glob("*.tar")):
        os.link(f, wds / f.name)
    # With a manifest, as `s3_bench.py`'s: without one, opening the dataset reads every shard
    # through the cache to index it, and the first epoch's figure would count that too.
    subprocess.run([args.new, "index", str(wds)], check=True, capture_output=True)
    tar_bytes = sum(p.stat().st_size for p in wds.glob("*.tar"))
    s3 = S3Server(s3root).start()
    proxy = FaultProxy(s3.port, rate=0.0, multipart=True).start()
    multipart = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    mixed_proxy = FaultProxy(s3.port, rate=0.0, multipart=lambda path: "part-15" not in path).start()
    mixed = {**s3.env(), "AWS_ENDPOINT_URL": mixed_proxy.endpoint}
    pki = tlsutil.make_pki(tmp / "pki")
    tls_proxy = FaultProxy(s3.port, rate=0.0, tls=(pki / "daemon.pem", pki / "daemon.key")).start()
    ca = str(pki / "ca.pem")
    over_tls = {**s3.env(), "AWS_ENDPOINT_URL": tls_proxy.endpoint, "AWS_CA_BUNDLE": ca, "SSL_CERT_FILE": ca}
    # (url, fields, cache bytes, bytes an epoch reads, rows an epoch delivers, environment)
    cols = ("s3://bench/pq/", ["id", "blob"], selected * 3 // 4, selected, FILES * ROWS, s3.env())
    cases = {
        "parquet-cols": cols,
        "parquet-cols-staged": cols,
        "parquet-all": ("s3://bench/pq/", None, pq_bytes * 3 // 4, pq_bytes, FILES * ROWS, s3.env()),
        "parquet-all-mp": ("s3://bench/pq/", None, pq_bytes * 3 // 4, pq_bytes, FILES * ROWS, multipart),
        "parquet-all-mixed": ("s3://bench/pq/", None, pq_bytes * 3 // 4, pq_bytes, FILES * ROWS, mixed),
        "parquet-all-crc": ("s3://bench/pqcrc/", None, crc_bytes * 3 // 4, crc_bytes, FILES * ROWS, s3.env()),
        "parquet-all-tls": ("s3://bench/pq/", None, pq_bytes * 3 // 4, pq_bytes, FILES * ROWS, over_tls),
        "tar": ("s3://bench/wds/", None, tar_bytes // 2, tar_bytes, spec.samples, s3.env()),
    }
    cases = {k: v for k, v in cases.items() if not args.cases or k in args.cases}
    results: dict[tuple[str, str, str], list[tuple[float, float, float, float]]] = {}
    try:
        for r in range(args.rounds):
            builds = [("old", args.old), ("new", args.new)]
            if r % 2:
                builds.reverse()
            for case, (url, fields, cache, reads, rows, env) in cases.items():
                for pace in ("fast", "paced"):
                    pause = args.paced_s * BATCH / rows if pace == "paced" else 0.0
                    for name, binary in builds:
                        d = Daemon(tmp / f"d-{name}", binary=binary, env=env, args=["--cache-size", str(cache)])
                        d.start()
                        try:
                            if case.endswith("-staged"):
                                staged = subprocess.run(
                                    [binary, "prefetch", "--connect", d.addr, "--fields", ",".join(fields or []), url],
                                    capture_output=True,
                                    text=True,
                                    env={**os.environ, **env},
                                )
                                assert staged.returncode == 0, staged.stderr
                            got, secs = [], []
                            for e in range(2):
                                before = d.status()["storage_bytes"]
                                t0 = time.perf_counter()
                                n = epoch(d.addr, url, e, fields, pause)
                                secs.append(time.perf_counter() - t0)
                                assert n == rows, (case, n, rows)
                                got.append((d.status()["storage_bytes"] - before) / reads)
                        finally:
                            d.stop()
                            shutil.rmtree(tmp / f"d-{name}", ignore_errors=True)
                        results.setdefault((case, pace, name), []).append((got[0], got[1], secs[0], secs[1]))
                        took = f"{secs[0]:.1f} s, {secs[1]:.1f} s"
                        print(f"round {r} {case} {pace} {name}: {got[0]:.2f} {got[1]:.2f} ({took})", flush=True)
    finally:
        proxy.stop()
        mixed_proxy.stop()
        tls_proxy.stop()
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| case | pace | build | epoch 1 fetched / read (median, range) | epoch 2 | epoch 1, 2 (s, median) |")
    print("|---|---|---|---|---|---|")
    for (case, pace, name), v in results.items():
        e1, e2 = [x[0] for x in v], [x[1] for x in v]
        s1, s2 = statistics.median(x[2] for x in v), statistics.median(x[3] for x in v)
        print(
            f"| {case} | {pace} | {name} | {statistics.median(e1):.2f} ({min(e1):.2f}-{max(e1):.2f}) |"
            f" {statistics.median(e2):.2f} ({min(e2):.2f}-{max(e2):.2f}) | {s1:.1f}, {s2:.1f} |"
        )
    print(f"\nload average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
