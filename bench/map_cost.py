"""What mapping shards costs, by way of mapping and by the page cache's state, and what tearing a
torch-loaded interpreter down costs. Not part of `make bench`; the figures behind section 4 of
bench/PROFILES.md ("The mapped-in-place gap, populating, and the bench's teardown").

    python bench/map_cost.py --rounds 3

- Mapping: run.py's WebDataset shards (40,000 samples, 0.85 GB), mapped read-only one after the
  other in this process and unmapped again, four ways: `MAP_POPULATE`, `MADV_POPULATE_READ`, one
  read per 64 KiB (what the client does, `shm::prefault`) and one read per 2 MiB; then one byte of
  every page read (what a consumer does next). CPU-s of each step, median of the rounds. Two
  states of the same bytes: as a read from disk leaves them in the page cache (`measure.warm`:
  dropped, then read back) and as the generator's small writes leave them (a copy written 512
  bytes at a time, in a temporary directory); a third, as the client's first reads leave them
  (a copy, dropped, then read back by the faults of a mapping advised `MADV_HUGEPAGE`, as the
  client maps a shard), with the share of each state's bytes a mapping maps with 2 MiB entries.
- Teardown: a child imports torch and shardstream (and maps the shards, or not), reports its CPU
  time and exits with `os._exit`; the parent's `wait4` gives the CPU of the whole process. The
  difference is what the exit cost.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen  # noqa: E402
import measure  # noqa: E402
import numpy as np  # noqa: E402

MADV_POPULATE_READ = 22  # linux/mman.h; Python's mmap module does not name it


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def touch(m: mmap.mmap, step: int) -> None:
    """Reads one byte every `step` bytes (numpy's strided sum: the loop is not Python's)."""
    np.frombuffer(m, np.uint8)[::step].sum()


WAYS: dict[str, tuple[int, Callable[[mmap.mmap], None]]] = {
    "MAP_POPULATE": (mmap.MAP_POPULATE, lambda m: None),
    "MADV_POPULATE_READ": (0, lambda m: m.madvise(MADV_POPULATE_READ)),
    "one read per 64 KiB": (0, lambda m: touch(m, 64 << 10)),
    "one read per 2 MiB": (0, lambda m: touch(m, 2 << 20)),
}


def map_all(files: list[Path], way: str) -> tuple[float, float]:
    """CPU-s to map every file `way`, then to read a byte of every page of them all."""
    flags, after = WAYS[way]
    maps = []
    t0 = cpu()
    for f in files:
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED | flags, prot=mmap.PROT_READ)
        after(m)
        maps.append(m)
    t1 = cpu()
    for m in maps:
        touch(m, 4096)
    t2 = cpu()
    for m in maps:
        m.close()
    return t1 - t0, t2 - t1


def pmd_mapped_share(files: list[Path]) -> float:
    """The share of the files' bytes that a mapping of them maps with 2 MiB entries once one byte
    per 64 KiB was read (`FilePmdMapped` of /proc/self/smaps_rollup, before and after): what the
    page cache's folios allow."""

    def pmd_kib() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("FilePmdMapped:"))

    before = pmd_kib()
    maps = []
    for f in files:
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        touch(m, 64 << 10)
        maps.append(m)
    share = (pmd_kib() - before) * 1024 / sum(len(m) for m in maps)
    for m in maps:
        m.close()
    return share


def read_first_through_huge_mapping(files: list[Path], into: Path) -> list[Path]:
    """Copies of the files, dropped from the page cache, then read back by faults of a mapping
    advised `MADV_HUGEPAGE` (as the client maps a shard): the page cache keeps a file in the
    folios its first reader made."""
    out = []
    for f in files:
        dst = into / f.name
        with open(f, "rb") as src, open(dst, "wb") as w:
            while chunk := src.read(8 << 20):
                w.write(chunk)
            w.flush()
            os.fsync(w.fileno())
            os.posix_fadvise(w.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with open(dst, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_HUGEPAGE)
        touch(m, 64 << 10)
        m.close()
        out.append(dst)
    return out


def small_writes_copy(files: list[Path], into: Path) -> list[Path]:
    """The files copied 512 bytes per write (as Python's tarfile writes), synced."""
    out = []
    for f in files:
        dst = into / f.name
        with open(f, "rb") as src, open(dst, "wb", buffering=0) as w:
            while chunk := src.read(512):
                w.write(chunk)
            os.fsync(w.fileno())
        out.append(dst)
    return out


TEARDOWN_CHILD = """
import json, mmap, os, resource, sys
import torch, shardstream, shardstream.torch
maps = []
for f in sys.argv[1:]:
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    m.madvise(22)
    maps.append(m)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(ru.ru_utime + ru.ru_stime), flush=True)
os._exit(0)
"""


def teardown(files: list[Path]) -> float:
    """CPU-s of a torch-loaded interpreter's exit, with `files` mapped."""
    p = subprocess.Popen([sys.executable, "-c", TEARDOWN_CHILD, *map(str, files)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    before_exit = json.loads(p.stdout.read())
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise RuntimeError(f"teardown child exited with status {status}")
    return ru.ru_utime + ru.ru_stime - before_exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data")
    args = ap.parse_args()
    data = gen.ensure(args.data, gen.Spec(samples=args.samples), ["wds"])
    shards = sorted((data / "wds").glob("*.tar"))
    gb = sum(f.stat().st_size for f in shards) / 1e9
    measure.warm(shards)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    exits: dict[str, list[float]] = {"nothing mapped": [], f"the shards mapped ({gb:.2f} GB)": []}
    with tempfile.TemporaryDirectory(prefix="map-cost-", dir=args.data) as tmp:
        (Path(tmp) / "small").mkdir()
        (Path(tmp) / "huge").mkdir()
        small = small_writes_copy(shards, Path(tmp) / "small")
        huge = read_first_through_huge_mapping(shards, Path(tmp) / "huge")
        states = {
            "read from disk": shards,
            "written 512 B at a time": small,
            "read from disk by a MADV_HUGEPAGE mapping's faults": huge,
        }
        pmd = {state: pmd_mapped_share(files) for state, files in states.items()}
        for r in range(args.rounds):
            for state, files in states.items():
                for way in WAYS:
                    results.setdefault((state, way), []).append(map_all(files, way))
            for name, files in zip(exits, ([], shards), strict=True):
                exits[name].append(teardown(files))
            print(f"round {r + 1} done", file=sys.stderr, flush=True)

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    print(f"{len(shards)} shards, {gb:.2f} GB, {args.rounds} rounds; CPU-s, median (min-max)\n")
    print("| page cache holds the shards | way | mapping them all | then a byte of every page |")
    print("|---|---|---|---|")
    for (state, way), runs in results.items():
        print(f"| {state} | {way} | {cell([m for m, _ in runs])} | {cell([t for _, t in runs])} |")
    print("\n| page cache holds the shards | share of their bytes mapped by 2 MiB entries |")
    print("|---|---|")
    for state, share in pmd.items():
        print(f"| {state} | {share:.2f} |")
    print("\n| interpreter with torch and shardstream loaded, at exit | CPU-s of the exit |")
    print("|---|---|")
    for name, xs in exits.items():
        print(f"| {name} | {cell(xs)} |")


if __name__ == "__main__":
    main()
