"""Epochs one after another on one daemon: what each costs while the daemon keeps row groups.

Usage: ``python bench/parquet_epochs.py DIR ROWS [--epochs N] [--reader ss_arrow] [--kind image]
[--settle S]``. Starts a daemon from this venv's ``shardstream`` command, runs the reader of
parquet_bench.py for N epochs (seeds one apart) and prints after each: rows/s, the daemon's CPU-s,
the row groups its node cache keeps (`status`), and the daemon's memory (``/proc/PID/status``:
peak, anonymous, file-backed). With ``--settle S``: the memory again S seconds after the last
epoch, then one more epoch. The measurement behind "Row groups of streams without views kept
past the budget" in bench/PARQUET_PROFILE.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon as bench_daemon  # noqa: E402
import parquet_bench as pb  # noqa: E402


def memory_mib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM", "RssAnon", "RssFile")):
            name, kib = line.split(":")
            out[name] = int(kib.split()[0]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("rows", type=int)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--reader", default="ss_arrow")
    ap.add_argument("--kind", default="image", choices=["image", "tab"])
    ap.add_argument("--settle", type=float, default=0.0, help="seconds to wait after the last epoch, then memory again")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pq-epochs-"))
    d = bench_daemon.Daemon.start(work)
    try:
        print("epoch rows/s daemon-CPU-s kept-row-groups memory-MiB")
        for e in range(args.epochs):
            r = pb.child(args.reader, args.kind, args.dir, d.addr, args.rows, d.pid, seed=pb.SEED + e)
            if "error" in r:
                raise SystemExit(f"epoch {e + 1}: {r['error']}")
            print(
                e + 1,
                f"{r['rows_per_s']:,.0f}",
                f"{r.get('daemon_cpu_s', 0):.2f}",
                pb.kept_row_groups(d.addr),
                memory_mib(d.pid),
                flush=True,
            )
        if args.settle:
            time.sleep(args.settle)
            print(f"{args.settle:g} s later:", memory_mib(d.pid))
            r = pb.child(args.reader, args.kind, args.dir, d.addr, args.rows, d.pid, seed=pb.SEED + args.epochs)
            print("then", f"{r['rows_per_s']:,.0f}", f"{r.get('daemon_cpu_s', 0):.2f}", memory_mib(d.pid))
    finally:
        d.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
