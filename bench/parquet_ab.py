"""Two builds of shardstream on one Parquet set, interleaved: the before/after figures of
bench/PARQUET_PROFILE.md (not part of `make bench`).

Per round and build: a fresh daemon of that build, then three `format="arrow"` epochs, each in a
fresh process: the first is "cold" (every row group decoded in it), the next two "warm" (row
groups already in the daemon's decoded cache). Reported per build: median rows/s and daemon
CPU-s per epoch, cold and warm.

Usage: ``python bench/parquet_ab.py KIND ROWS OLD_SITE [--rounds 3] [--data DIR]``, KIND one of
``image`` / ``tab`` (parquet_bench.py's sets and consumer) or ``hfimage`` (a Hugging Face style
set: ``image`` = ``struct<bytes: binary, path: string>`` of 10-30 KiB + ``label``, row groups of
250, snappy; consumer: one byte per page of each image). OLD_SITE is the other build, installed
with ``pip install --no-deps --target OLD_SITE WHEEL``; "new" is the build of this interpreter.
``--views``: "new" reads with ``binary_views=True`` (``image``: parquet_bench's ``ss_views``;
``hfimage``: the struct's bytes as views); with OLD_SITE the same build, the two ways of one build.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon as bench_daemon  # noqa: E402
import measure  # noqa: E402
import parquet_bench as pb  # noqa: E402

HF_EPOCH = r"""
import json, sys, time
import numpy as np, shardstream
views = sys.argv[4] == "1"
VIEW = np.dtype([("len", "<i4"), ("pre", "S4"), ("buf", "<i4"), ("off", "<i4")])
t0, c0, n = time.perf_counter(), time.process_time(), 0
for rb in shardstream.Loader(sys.argv[1], batch_size=256, seed=int(sys.argv[3]), connect=sys.argv[2],
                             transport="shm", format="arrow", **({"binary_views": True} if views else {})):
    col = rb.column("image").field("bytes")
    if views:
        v = np.frombuffer(col.buffers()[1], VIEW, count=len(col), offset=col.offset * 16)
        data = [np.frombuffer(b, np.uint8) for b in col.buffers()[2:]]
        for size, b, at in zip(v["len"].tolist(), v["buf"].tolist(), v["off"].tolist()):
            data[b][at : at + size : 4096].sum()
    else:
        offs = np.frombuffer(col.buffers()[1], np.int32)[col.offset : col.offset + len(col) + 1]
        np.frombuffer(col.buffers()[2], np.uint8)[offs[0] : offs[-1] : 4096].sum()
    n += rb.num_rows
seconds = time.perf_counter() - t0
print(json.dumps({"rows": n, "rows_per_s": n / seconds, "cpu_s": time.process_time() - c0}))
"""


def make_hfimage(d: Path, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = d / ".complete"
    if done.exists() and done.read_text() == str(rows):
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f, first in enumerate(range(0, rows, 1000)):
        ids = range(first, min(first + 1000, rows))
        sizes = rng.integers(10 << 10, 30 << 10, len(ids))
        images = [i.to_bytes(8, "little") + rng.bytes(int(s) - 8) for i, s in zip(ids, sizes, strict=True)]
        image = pa.StructArray.from_arrays(
            [pa.array(images, pa.binary()), pa.array([f"img/{i}.jpg" for i in ids])], names=["bytes", "path"]
        )
        table = pa.table({"image": image, "label": pa.array([i % 1000 for i in ids], pa.int64())})
        pq.write_table(table, d / f"part-{f:05d}.parquet", row_group_size=250, compression="snappy")
    done.write_text(str(rows))
    return d


def epoch(kind: str, d: Path, rows: int, daemon: bench_daemon.Daemon, site: str | None, seed: int, views: bool) -> dict:
    if kind != "hfimage":
        return pb.child("ss_views" if views else "ss_arrow", kind, d, daemon.addr, rows, daemon.pid, site, seed=seed)
    before = measure.cpu_seconds(daemon.pid) or 0.0
    p = subprocess.run(
        [sys.executable, "-c", HF_EPOCH, str(d), daemon.addr, str(seed), "1" if views else "0"],
        capture_output=True,
        text=True,
        timeout=600,
        env=bench_daemon.env_for(site),
    )
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["daemon_cpu_s"] = (measure.cpu_seconds(daemon.pid) or before) - before
    r["check"] = "ok" if r["rows"] == rows else f"{r['rows']} rows"
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["image", "tab", "hfimage"])
    ap.add_argument("rows", type=int)
    ap.add_argument("old_site")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=pb.ROOT / "bench/data/parquet")
    ap.add_argument("--views", action="store_true", help='"new" reads with binary_views=True')
    args = ap.parse_args()
    make = {"image": pb.make_image, "tab": pb.make_tab, "hfimage": make_hfimage}[args.kind]
    d = make(args.data / f"{args.kind}-{args.rows}", args.rows)
    builds: dict[str, str | None] = {"new": None, "old": args.old_site}
    got: dict[str, dict[str, list[dict]]] = {b: {"cold": [], "warm": []} for b in builds}
    for _ in range(args.rounds):
        for build, site in builds.items():
            daemon = bench_daemon.Daemon.start(Path(tempfile.mkdtemp(prefix="pq-ab-")), site=site)
            try:
                for i in range(3):
                    r = epoch(args.kind, d, args.rows, daemon, site, seed=i, views=args.views and build == "new")
                    if "error" in r or r.get("check") != "ok":
                        raise SystemExit(f"{build} epoch {i}: {r}")
                    got[build]["cold" if i == 0 else "warm"].append(r)
            finally:
                daemon.stop()
    for build in builds:
        for when in ("cold", "warm"):
            rs = got[build][when]
            rps = statistics.median(r["rows_per_s"] for r in rs)
            cpu = statistics.median(r["daemon_cpu_s"] for r in rs)
            print(f"{build} {when}: {rps:,.0f} rows/s (epochs: {len(rs)}), daemon {cpu:.3f} CPU-s per epoch")


if __name__ == "__main__":
    main()
