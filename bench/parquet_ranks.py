"""One shuffled Parquet epoch read by 2 ranks x 2 workers (4 processes, 4 streams) on one fresh
daemon: seconds, every row exactly once, and how many streams decoded a row group a second time
within the epoch (the daemon's "a row group decoded again" debug line): whether the decoded
budget, or an outgrown dataset's share of it, holds every stream's window. Not part of
`make bench`; the check behind bench/PARQUET_PROFILE.md, "the decoded budget fills with fresh
memory".

    python bench/parquet_ranks.py bench/data/parquet/image-100000-plain 100000 [--site SITE] [--repeats N]

`--site` measures another build (a `pip install --target` directory, as `--variant` does in
parquet_bench.py); each repeat runs this build, then the site's, on fresh daemons.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon as bench_daemon  # noqa: E402

RANKS, WORKERS = 2, 2
LOG = "warn,shardstream::format::parquet::dataset=debug"


def stream_ids(args: tuple[str, str, int, int]) -> list[int]:
    """Row ids one (rank, worker) stream delivers."""
    import shardstream

    data, addr, rank, worker = args
    loader = shardstream.Loader(
        data,
        batch_size=256,
        seed=0,
        rank=rank,
        world_size=RANKS,
        _worker=(worker, WORKERS),
        connect=addr,
        format="arrow",
    )
    ids: list[int] = []
    for b in loader:
        ids.extend(b.column(b.schema.get_field_index("__row__")).to_pylist())
    return ids


def epoch(data: str, rows: int, site: str | None) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="pq-ranks-"))
    daemon = bench_daemon.Daemon.start(tmp, env={"SHARDSTREAM_LOG": LOG}, site=site)
    env_site = os.environ.get("PYTHONPATH")
    try:
        if site:
            os.environ["PYTHONPATH"] = site  # the pool's processes import the site's client too
        t0 = time.perf_counter()
        with mp.get_context("spawn").Pool(RANKS * WORKERS) as pool:
            out = pool.map(stream_ids, [(data, daemon.addr, r, w) for r in range(RANKS) for w in range(WORKERS)])
        seconds = time.perf_counter() - t0
    finally:
        if env_site is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_site
        daemon.stop()
    again = daemon.log.read_text(errors="replace").count("a row group decoded again")
    ids = sorted(i for o in out for i in o)
    shutil.rmtree(tmp, ignore_errors=True)
    check = "ok" if ids == list(range(rows)) else f"MISMATCH ({len(ids)} rows, {len(set(ids))} distinct)"
    return f"{seconds:.2f} s, {rows / seconds:,.0f} rows/s, {check}, streams that decoded a row group again: {again}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("rows", type=int)
    ap.add_argument("--site", help="another build of the package (a `pip install --target` directory)")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    for i in range(a.repeats):
        print(f"[{i}] this build: {epoch(a.dir, a.rows, None)}", flush=True)
        if a.site:
            print(f"[{i}] {a.site}: {epoch(a.dir, a.rows, a.site)}", flush=True)


if __name__ == "__main__":
    main()
