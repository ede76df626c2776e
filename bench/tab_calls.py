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

With `--consumer`, each batch also goes through `parquet_bench`'s consumer (`arrow_payload` and
`touch`, as its `ss_arrow` rows do), timed on its own: each epoch then prints the consumer's
seconds, the rest of the epoch (the loader's part, its waits included), the first batch's
latency (from the iteration's start) and the second's (after the first), and the trainer's
voluntary context switches; after the epochs, the median (min-max) of each over them
(bench/PARQUET_PROFILE.md, "where a warm tab epoch's spread comes from").
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon  # noqa: E402
import parquet_bench  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import numpy as np, pyarrow as pa, torch, shardstream
from shardstream import _arrow
path, addr, consume = sys.argv[1], sys.argv[2], sys.argv[3] == "consumer"
if consume:
    sys.path.insert(0, sys.argv[4])
    import parquet_bench as pb
    pb.warm_consumer("tab")
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
ru0 = resource.getrusage(resource.RUSAGE_SELF)
cpu0, t0, rows = time.process_time(), time.perf_counter(), 0
consumer_s, arrived = 0.0, []
for b in loader:
    if len(arrived) < 2:
        arrived.append(time.perf_counter())
    rows += len(b)
    if consume:
        c = time.perf_counter()
        pb.touch("tab", *pb.arrow_payload("tab", b))
        consumer_s += time.perf_counter() - c
s, cpu, n = time.perf_counter() - t0, time.process_time() - cpu0, rows / 256
ru1 = resource.getrusage(resource.RUSAGE_SELF)
steps = ", ".join(f"{k} {v / n / 1e3:.1f} us" for k, v in spent.items()) or "none called"
wait = loader._stats["wait_s"] / n * 1e6
print(f"{rows / s:,.0f} rows/s, client CPU {cpu / n * 1e6:.1f} us/batch, wait {wait:.1f} us/batch; {steps}")
if consume:
    print(json.dumps({
        "epoch_s": s, "consumer_s": consumer_s, "loader_s": s - consumer_s, "wait_s": loader._stats["wait_s"],
        "first_batch_ms": (arrived[0] - t0) * 1e3, "second_batch_ms": (arrived[1] - arrived[0]) * 1e3,
        "voluntary_switches": ru1.ru_nvcsw - ru0.ru_nvcsw, "client_cpu_s": cpu,
    }))
"""


def summary(epochs: list[dict]) -> str:
    """Median (min-max) of each figure over the epochs."""
    lines = []
    for key in epochs[0]:
        v = [e[key] for e in epochs]
        lines.append(f"{key}: {statistics.median(v):.4g} ({min(v):.4g}-{max(v):.4g})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data/parquet")
    ap.add_argument("--perf-daemon", type=Path, help="record the daemon with perf into this file")
    ap.add_argument("--site", help="the build of the package installed there (default: this interpreter's)")
    ap.add_argument("--consumer", action="store_true", help="run parquet_bench's consumer on every batch, timed apart")
    args = ap.parse_args()
    path = str(parquet_bench.make_tab(args.data / f"tab-{args.rows}", args.rows))
    with tempfile.TemporaryDirectory(prefix="tab-calls-") as tmp:
        srv = daemon.Daemon.start(Path(tmp), site=args.site)
        perf = None
        try:
            env = daemon.env_for(args.site)

            def epoch() -> str:
                mode = "consumer" if args.consumer else "none"
                cmd = [sys.executable, "-c", CHILD, path, srv.addr, mode, str(Path(__file__).resolve().parent)]
                return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip()

            epoch()  # decodes the row groups
            if args.perf_daemon:
                perf = subprocess.Popen(
                    ["perf", "record", "-F", "2999", "-g", "-o", str(args.perf_daemon), "-p", str(srv.pid)],
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(0.5)
            split = []
            for i in range(args.epochs):
                out = epoch().splitlines()
                print(f"epoch {i + 1}: {out[0]}", flush=True)
                if args.consumer:
                    split.append(json.loads(out[-1]))
                    print(f"  {out[-1]}", flush=True)
            if split:
                print(summary(split))
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
            srv.stop()


if __name__ == "__main__":
    main()
