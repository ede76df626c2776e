"""What this machine's memory gives a loader-free random 4 KiB gather, next to memcpy: the
copy packed mode makes, without the daemon around it. Not part of `make bench`; the figures
behind the packed-mode notes of bench/PROFILES.md (section 3).

A file of `--records` records of 4 KiB (random bytes) is written to `--dir`, dropped from the
page cache and read back (`measure.warm`, as a node cache copy is found), and mapped read-only.
Then, best of 3 each: `np.take` of all records in one shuffled order, in batches of `--batch`
into a reused buffer, by 1 and by 2 threads splitting each batch (`np.take` drops the GIL while
it copies); the same batches in file order; and `measure.memcpy_gbps`.

    python bench/gather_ceiling.py --records 131072
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402

RECORD = 4096


def gather_gbps(records: np.ndarray, order: np.ndarray, batch: int, threads: int) -> float:
    """GB/s of copying `records[order]` batch by batch, each batch split over `threads`."""
    outs = [np.empty((batch, RECORD), np.uint8) for _ in range(threads)]

    def part(k: int) -> None:
        for b in range(0, len(order), batch):
            ids = order[b : b + batch]
            ids = ids[k * len(ids) // threads : (k + 1) * len(ids) // threads]
            np.take(records, ids, axis=0, out=outs[k][: len(ids)])

    best = 0.0
    for _ in range(measure.REPEATS):
        workers = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, len(order) * RECORD / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "data")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gather-ceiling-") as tmp:
        path = Path(tmp) / "records.bin"
        with open(path, "wb") as f:
            for at in range(0, args.records, 1024):
                f.write(os.urandom(min(1024, args.records - at) * RECORD))
        measure.warm([path])
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        records = np.frombuffer(m, np.uint8).reshape(-1, RECORD)
        shuffled = np.random.default_rng(0).permutation(len(records))
        in_order = np.arange(len(records))
        print(f"load average {os.getloadavg()[0]:.2f}; {len(records):,} records of 4 KiB, batch {args.batch}")
        memcpy = measure.memcpy_gbps()
        rows = [
            ("memcpy of 1 GiB (np.copyto)", memcpy),
            ("file order, 1 thread", gather_gbps(records, in_order, args.batch, 1)),
            ("shuffled, 1 thread", gather_gbps(records, shuffled, args.batch, 1)),
            ("shuffled, 2 threads", gather_gbps(records, shuffled, args.batch, 2)),
        ]
        for name, gbps in rows:
            print(f"| {name} | {gbps:.2f} GB/s | {gbps / memcpy:.2f}x memcpy |")
        del records
        m.close()


if __name__ == "__main__":
    main()
