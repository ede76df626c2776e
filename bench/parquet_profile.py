"""`perf record -g` of the daemon while one shardstream reader of parquet_bench.py reads one epoch:
the loop behind bench/PARQUET_PROFILE.md.

Usage: ``python bench/parquet_profile.py DIR KIND ROWS [READER]`` (KIND image or tab, READER
ss_arrow by default). Starts a daemon from this venv's ``shardstream`` command, runs the reader
once to warm the page cache and the daemon, then once under ``perf record -g`` on the daemon
(and, with ``--client``, ``perf record -g`` on the reader's process too, from its first batch
on, so its imports stay out; that run's seconds then include perf's start, 0.3 s), and prints
the figures of both runs and the top of ``perf report --no-children`` (self time by symbol).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon as bench_daemon  # noqa: E402
import parquet_bench as pb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("kind", choices=["image", "tab"])
    ap.add_argument("rows", type=int)
    ap.add_argument("reader", nargs="?", default="ss_arrow")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--warm", type=int, default=1, help="epochs before the profiled one (other seeds)")
    ap.add_argument("--site", help="another build of the package (a `pip install --target` directory)")
    ap.add_argument("--perf-data", type=Path, help="keep the profile here (for `perf report -G`)")
    ap.add_argument("--client", action="store_true", help="also profile the reader's process")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pq-profile-"))
    d = bench_daemon.Daemon.start(work, site=args.site)
    data = args.perf_data or work / "perf.data"
    client = data.with_name(data.name + ".client")
    try:
        for e in range(args.warm):
            seed = pb.SEED + 1 + e
            print("warm:", pb.child(args.reader, args.kind, args.dir, d.addr, args.rows, d.pid, args.site, seed=seed))
        perf = subprocess.Popen(
            ["perf", "record", "-g", "-F", "499", "-o", str(data), "-p", str(d.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            if args.client:
                os.environ["PQ_BENCH_PERF"] = str(client)
            print("profiled:", pb.child(args.reader, args.kind, args.dir, d.addr, args.rows, d.pid, args.site))
        finally:
            os.environ.pop("PQ_BENCH_PERF", None)
            perf.send_signal(2)
            perf.wait(timeout=60)
        print("daemon peak RSS MiB:", pb.peak_rss_mib(d.pid))
    finally:
        d.stop()
    for name, path in [("daemon", data), *([("reader", client)] if args.client else [])]:
        report = subprocess.run(
            ["perf", "report", "-i", str(path), "--no-children", "--stdio", "-g", "none", "--percent-limit", "0.5"],
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in report.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
        print(f"-- {name}:")
        print("\n".join(lines[: args.top]))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
