"""What a write's size costs when it fills fresh page-cache pages. Not part of `make bench`; the
figures behind "Writes of a MiB" in bench/PARQUET_PROFILE.md and `server/src/page_writes.rs`.

    python bench/write_sizes.py --rounds 3

Writes ``--gib`` GiB (2 by default) into ``--files`` new files in ``--dir`` (a temporary directory
on the disk of bench/data by default), from one buffer of ``buffer`` bytes, one ``pwrite`` of
``write`` bytes after another, then deletes them; each (buffer, write) pair once per round,
interleaved. Reported: the system CPU seconds of the writes (the kernel's copy into the page
cache), median and spread over the rounds. No fsync: writeback happens later, off this process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
from pathlib import Path

MIB = 1 << 20
# (buffer, write): the write size alone, and the buffer's size alone.
PAIRS = [
    (4 * MIB, 4 * MIB),
    (4 * MIB, MIB),
    (4 * MIB, MIB // 4),
    (4 * MIB, MIB // 16),
    (MIB, MIB),
    (16 * MIB, 16 * MIB),
    (16 * MIB, MIB),
]


def size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n >> 10} KiB"


def write_files(where: Path, total: int, files: int, buffer: int, write: int) -> float:
    data = memoryview(os.urandom(buffer))
    per = total // files
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    for i in range(files):
        fd = os.open(where / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            off = 0
            while off < per:
                for j in range(0, buffer, write):
                    off += os.pwrite(fd, data[j : j + write], off)
        finally:
            os.close(fd)
    spent = resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
    for i in range(files):
        os.unlink(where / f"{i}")
    os.sync()
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / "data")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    total = int(args.gib * (1 << 30))
    spent: dict[tuple[int, int], list[float]] = {p: [] for p in PAIRS}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="write-sizes-") as d:
        for _ in range(args.rounds):
            for pair in PAIRS:
                spent[pair].append(write_files(Path(d), total, args.files, *pair))
    print(f"{args.gib:g} GiB into {args.files} new files, {args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    print("| buffer | one write | system CPU-s, median (min-max) |")
    print("|---|---|---|")
    for (buffer, write), s in spent.items():
        print(f"| {size(buffer)} | {size(write)} | {statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) |")


if __name__ == "__main__":
    main()
