"""How long a daemon takes to open an S3 Parquet dataset of many files that `shardstream index`
has not described, or (``--index``) how long `shardstream index` takes to describe it: one footer
(a small ranged GET) per file either way, each waiting its round trip.

Usage: ``python bench/s3_open_many.py --bin NAME=PATH [--bin NAME=PATH ...] [--files N]
[--hold S | --direct] [--rounds R] [--index]``. ``PATH`` may be followed by arguments for the
command (``--bin "t32=target/release/shardstream --threads 32"``). Writes N two-row files with
pyarrow into a local s3s-fs, puts
the chaos suite's proxy in front of it holding every object GET for S seconds (S3's round trip,
which the server on 127.0.0.1 does not have; 0 for none; ``--direct``: no proxy, and no count of
GETs in flight), then per round starts each daemon binary fresh
(empty node cache, the order rotated by one per round) and times its open of the dataset
(``Connection.open``: listing and footers, no rows), or with ``--index`` runs ``PATH index`` of
the dataset instead (each run reads every footer again). Prints one markdown row per binary: the
median and spread over the rounds, and the most GETs the proxy saw in flight at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from chaos.proxy import FaultProxy  # noqa: E402
from s3server import S3Server  # noqa: E402

import shardstream  # noqa: E402


def binary(spec: str) -> tuple[str, Path, list[str]]:
    name, sep, rest = spec.partition("=")
    path, *extra = rest.split() or [""]
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=PATH [ARGS] of a shardstream binary")
    return name, Path(path), extra


def index_once(exe: Path, extra: list[str], env: dict[str, str], url: str) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([str(exe), "index", *extra, url], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{exe} index failed: {p.stderr[-500:]}")
    return time.perf_counter() - t0


def open_once(exe: Path, extra: list[str], work: Path, env: dict[str, str], url: str) -> float:
    sock = work / "sock"
    addr = f"unix://{sock}"
    cmd = [str(exe), "serve", "--listen", addr, "--cache-dir", str(work / "cache"), "--log", "warn", *extra]
    with open(work / "daemon.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{exe} exited with {proc.returncode}: {(work / 'daemon.log').read_text()[-500:]}")
            try:
                conn = shardstream._native.Connection(addr)
                conn.status()
                break
            except (ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        t0 = time.perf_counter()
        conn.open(url)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=binary, action="append", required=True, dest="bins")
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--hold", type=float, default=0.03)
    ap.add_argument("--direct", action="store_true", help="no proxy: the daemons ask s3s-fs itself")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--index", action="store_true", help="time `shardstream index` instead of a daemon's open")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="s3-open-") as tmp:
        base = Path(tmp)
        s3 = S3Server(base / "s3").start()
        proxy = FaultProxy(s3.port, rate=0.0, hold=args.hold).start()
        try:
            root = s3.bucket("data") / "many"
            root.mkdir(parents=True)
            for i in range(args.files):
                pq.write_table(pa.table({"id": [2 * i, 2 * i + 1]}), root / f"part-{i:05d}.parquet")
            env = {**os.environ, **s3.env()}
            if not args.direct:
                env["AWS_ENDPOINT_URL"] = proxy.endpoint
            times: dict[str, list[float]] = {name: [] for name, _, _ in args.bins}
            peaks: dict[str, int] = {name: 0 for name, _, _ in args.bins}
            for r in range(args.rounds):
                order = args.bins[r % len(args.bins) :] + args.bins[: r % len(args.bins)]
                for name, exe, extra in order:
                    work = base / f"{name}-{r}"
                    work.mkdir()
                    proxy.reset_peak()
                    if args.index:
                        times[name].append(index_once(exe, extra, env, "s3://data/many/"))
                    else:
                        times[name].append(open_once(exe, extra, work, env, "s3://data/many/"))
                    peaks[name] = max(peaks[name], proxy.peak_gets)
            how = "no proxy" if args.direct else f"every object GET held {args.hold * 1000:.0f} ms"
            what = "`index`" if args.index else "open"
            print(f"{args.files} files, {how}, {args.rounds} rounds")
            print(f"| binary | {what} (s) median (min-max) | GETs in flight, most |")
            print("|---|---|---|")
            for name, _, _ in args.bins:
                t = times[name]
                peak = "-" if args.direct else str(peaks[name])
                print(f"| {name} | {statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) | {peak} |")
        finally:
            proxy.stop()
            s3.stop()


if __name__ == "__main__":
    main()
