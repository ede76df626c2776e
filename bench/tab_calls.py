"""Where a tab-set batch's client time goes: one `format="arrow"` epoch of the Parquet tab set
(1M rows, batch 256, no consumer) per fresh interpreter, with the package's per-batch steps
wrapped in `perf_counter_ns`. Not part of `make bench`; the per-call figures in
bench/PARQUET_PROFILE.md ("`__row__` from the daemon, messages in groups").

    python bench/tab_calls.py --epochs 4 [--perf-daemon perf.data] [--site DIR]

One warm daemon (a first, untimed epoch decodes the row groups). Prints, per epoch, rows/s, the
client's CPU per batch, the time spent waiting in `next_batch`, and each wrapped step's time per
batch (wall, including the wrapper's own ~0.3 us). With `--perf-daemon FILE`, `perf record -g` of
the daemon covers the timed epochs (read it with `perf report -i FILE --no-children`). With
`--site DIR`, daemon and client are the build installed there (`pip install --target DIR`).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon  # noqa: E402
import parquet_bench  # noqa: E402

CHILD = r"""
import sys, time
import numpy as np, pyarrow as pa, torch, shardstream
from shardstream import _arrow
path, addr = sys.argv[1], sys.argv[2]
spent = {}
def wrap(owner, name, key):
    f = getattr(owner, name)
    def timed(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            spent[key] = spent.get(key, 0) + time.perf_counter_ns() - t
    setattr(owner, name, timed)
wrap(_arrow.BatchReader, "open", "open")
wrap(_arrow, "row_ids", "row_ids")
wrap(_arrow, "with_row_ids", "with_row_ids")
wrap(pa.ipc, "read_record_batch", "read_record_batch")
loader = shardstream.Loader(path, batch_size=256, seed=0, connect=addr, transport="shm", format="arrow")
cpu0, t0, rows = time.process_time(), time.perf_counter(), 0
for b in loader:
    rows += len(b)
s, cpu, n = time.perf_counter() - t0, time.process_time() - cpu0, rows / 256
steps = ", ".join(f"{k} {v / n / 1e3:.1f} us" for k, v in spent.items()) or "none called"
wait = loader._stats["wait_s"] / n * 1e6
print(f"{rows / s:,.0f} rows/s, client CPU {cpu / n * 1e6:.1f} us/batch, wait {wait:.1f} us/batch; {steps}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data/parquet")
    ap.add_argument("--perf-daemon", type=Path, help="record the daemon with perf into this file")
    ap.add_argument("--site", help="the build of the package installed there (default: this interpreter's)")
    args = ap.parse_args()
    path = str(parquet_bench.make_tab(args.data / f"tab-{args.rows}", args.rows))
    with tempfile.TemporaryDirectory(prefix="tab-calls-") as tmp:
        srv = daemon.Daemon.start(Path(tmp), site=args.site)
        perf = None
        try:
            env = daemon.env_for(args.site)

            def epoch() -> str:
                cmd = [sys.executable, "-c", CHILD, path, srv.addr]
                return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip()

            epoch()  # decodes the row groups
            if args.perf_daemon:
                perf = subprocess.Popen(
                    ["perf", "record", "-F", "2999", "-g", "-o", str(args.perf_daemon), "-p", str(srv.pid)],
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(0.5)
            for i in range(args.epochs):
                print(f"epoch {i + 1}: {epoch()}", flush=True)
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
            srv.stop()


if __name__ == "__main__":
    main()
