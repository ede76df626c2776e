"""What a write's size costs when it fills fresh page-cache pages, and what it leaves the file's
readers. Not part of `make bench`; the figures behind "Folio sizes: a copy's cost against its
readers'" in bench/PARQUET_PROFILE.md.

    python bench/write_sizes.py --rounds 3

Writes ``--gib`` GiB (2 by default) into ``--files`` new files in ``--dir`` (a temporary directory
on the disk of bench/data by default), from one buffer of ``buffer`` bytes, one ``pwrite`` of
``write`` bytes after another, then deletes them; each (buffer, write) pair once per round,
interleaved. Reported: the system CPU seconds of the writes (the kernel's copy into the page
cache), median and spread over the rounds. No fsync: writeback happens later, off this process.

And what a reader then gets (`pmd`): the first file is mapped, advised ``MADV_HUGEPAGE`` (as the
client maps a shard) and read a byte a page; the share of it the mapping maps with 2 MiB entries
(`FilePmdMapped` over `Rss` in /proc/self/smaps), which only 2 MiB page-cache folios allow. A last
row copies that file with ``copy_file_range`` (the kernel's copy, through a 64 KiB pipe) and
reports the copy's share.

``--anon`` measures the likely cause instead: 1 GiB of anonymous memory touched a page at a time,
in 2 MiB pages (``MADV_HUGEPAGE``) or 4 KiB ones, each first after ``--settle`` seconds of quiet
(time for a guest to report the memory freed before to its host) and then again at once (the
same memory, freed a moment ago). A guest whose host took back its free 2 MiB blocks pays for
them when it touches them again.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import tempfile
import time
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


def pmd_share(path: Path) -> float:
    """The share of `path` a fresh `MADV_HUGEPAGE` mapping maps with 2 MiB entries once read."""
    with open(path, "rb") as f:
        length = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        for off in range(0, length, 4096):
            m[off]
        fields: dict[str, int] = {}
        inside = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                inside = line.endswith(str(path))
            elif inside and line.split(":")[0] in ("Rss", "FilePmdMapped"):
                fields[line.split(":")[0]] = int(line.split()[1])
        return fields.get("FilePmdMapped", 0) / max(fields.get("Rss", 1), 1)
    finally:
        m.close()


def write_files(where: Path, total: int, files: int, buffer: int, write: int) -> tuple[float, float]:
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
    pmd = pmd_share(where / "0")
    for i in range(files):
        os.unlink(where / f"{i}")
    os.sync()
    return spent, pmd


def kernel_copy_pmd(where: Path) -> float:
    """`pmd_share` of a copy of a 20 MiB file made by `copy_file_range`."""
    src, dst = where / "src", where / "dst"
    src.write_bytes(os.urandom(20 * MIB))
    with open(src, "rb") as a, open(dst, "wb") as b:
        left = 20 * MIB
        while left:
            n = os.copy_file_range(a.fileno(), b.fileno(), left)
            if n == 0:
                raise RuntimeError(f"copy_file_range of {src} stopped {left} bytes short")
            left -= n
    share = pmd_share(dst)
    src.unlink()
    dst.unlink()
    return share


def touch_anon(huge: bool) -> float:
    """System CPU-s of touching 1 GiB of fresh anonymous memory a page at a time."""
    n = 1 << 30
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        for off in range(0, n, 4096):
            m[off] = 1
        return resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
    finally:
        m.close()


def anon(rounds: int, settle: float) -> None:
    print(f"1 GiB of anonymous memory touched a page at a time, {rounds} rounds; load {os.getloadavg()[0]:.2f}")
    print(f"| pages | after {settle:g} s of quiet: system CPU-s | at once again | again |")
    print("|---|---|---|---|")
    for huge in (True, False):
        cells = []
        for _ in range(rounds):
            time.sleep(settle)
            cells.append([touch_anon(huge), touch_anon(huge), touch_anon(huge)])
        cols = [statistics.median(c[i] for c in cells) for i in range(3)]
        print(f"| {'2 MiB' if huge else '4 KiB'} | " + " | ".join(f"{x:.2f}" for x in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / "data")
    ap.add_argument("--anon", action="store_true", help="anonymous memory in 2 MiB and 4 KiB pages instead")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of quiet before each --anon round")
    args = ap.parse_args()
    if args.anon:
        anon(args.rounds, args.settle)
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    total = int(args.gib * (1 << 30))
    spent: dict[tuple[int, int], list[float]] = {p: [] for p in PAIRS}
    pmd: dict[tuple[int, int], list[float]] = {p: [] for p in PAIRS}
    copied: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="write-sizes-") as d:
        for _ in range(args.rounds):
            for pair in PAIRS:
                cpu, share = write_files(Path(d), total, args.files, *pair)
                spent[pair].append(cpu)
                pmd[pair].append(share)
            copied.append(kernel_copy_pmd(Path(d)))
    print(f"{args.gib:g} GiB into {args.files} new files, {args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    print("| buffer | one write | system CPU-s, median (min-max) | pmd, median |")
    print("|---|---|---|---|")
    for (buffer, write), s in spent.items():
        cells = (
            f"{statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | {statistics.median(pmd[(buffer, write)]):.0%}"
        )
        print(f"| {size(buffer)} | {size(write)} | {cells} |")
    print(f"| `copy_file_range` of a 20 MiB file | - | - | {statistics.median(copied):.0%} |")


if __name__ == "__main__":
    main()
