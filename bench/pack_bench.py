"""`shardstream pack` against the other ways to turn a tree of small files into shards.

On one generated ImageNet-style tree (`bench/data/pack-n<N>/src/<class>/<key>.jpg`, 16-20 KiB of
random bytes each, 100 classes; generated once and cached), hot in the page cache, this times:

- `shardstream pack SRC --output DEST` (default options: 1 GiB WebDataset shards, manifest,
  sidecars; every shard fsynced before the manifest is written);
- `webdataset.ShardWriter` fed by a Python loop over the tree (walk, read, write), the way its
  documentation packs files, with the same 1 GiB shard size;
- GNU `tar cf` of the same tree into one archive (single-threaded; no fsync).

tar and ShardWriter return before their output is on disk; `+sync` adds the time of a `sync` run
right after each, so the last column compares the time until the shards are durable. Files/s and
MB/s (payload bytes, 10^6) are over the command's wall time, best of `--repeat` runs.

Usage: `python bench/pack_bench.py [--files 100000] [--repeat 3] [--out bench/pack-results.md]`
(`--shardstream` defaults to this checkout's `target/release/shardstream`, built with
`cargo build --release -p shardstream`; the lead merges the table into bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# Bump when the generated tree changes (the cache directory name changes with it).
TREE_VERSION = 1
CLASSES = 100
MIN_BYTES, MAX_BYTES = 16 << 10, 20 << 10
SHARD_SIZE = 1 << 30


SHARDSTREAM: str | None = None


def shardstream_cmd() -> str:
    """`--shardstream`, else the release build of this checkout, else the installed command."""
    global SHARDSTREAM
    if SHARDSTREAM is None:
        candidates = [HERE.parent / "target" / "release" / "shardstream", Path(sys.executable).with_name("shardstream")]
        found = next((str(c) for c in candidates if c.exists()), None) or shutil.which("shardstream")
        if not found:
            sys.exit("shardstream not found: run `cargo build --release -p shardstream` or pass --shardstream")
        SHARDSTREAM = found
    return SHARDSTREAM


def generate(root: Path, files: int, seed: int = 0) -> Path:
    """Writes the tree once; a `.complete` marker makes later runs reuse it."""
    src = root / "src"
    if (root / ".complete").exists():
        return src
    if root.exists():
        shutil.rmtree(root)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    sizes = rng.integers(MIN_BYTES, MAX_BYTES + 1, files)
    offsets = rng.integers(0, len(pool) - MAX_BYTES, files)
    for c in range(CLASSES):
        (src / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        path = src / f"n{i % CLASSES:08d}" / f"{i:08d}.jpg"
        path.write_bytes(pool[offsets[i] : offsets[i] + sizes[i]])
    (root / ".complete").write_text(json.dumps({"files": files, "bytes": int(sizes.sum())}))
    return src


def warm(src: Path) -> tuple[int, int]:
    """Reads every file once (hot page cache); returns (files, bytes)."""
    n = total = 0
    for dirpath, _dirs, names in os.walk(src):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
            n += 1
    return n, total


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(seconds of fn, seconds of a `sync` right after it)."""
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return t1 - t0, time.perf_counter() - t1


def run_shardstream(src: Path, out: Path, files: int) -> None:
    cmd = [shardstream_cmd(), "pack", str(src), "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["total_samples"] == files, manifest["total_samples"]


def run_shardwriter(src: Path, out: Path, files: int) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    n = 0
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=SHARD_SIZE, maxcount=10**9, verbose=0) as sink:
        for cls in sorted(os.listdir(src)):
            d = src / cls
            for name in sorted(os.listdir(d)):
                with open(d / name, "rb") as f:
                    data = f.read()
                key, ext = name.split(".", 1)
                sink.write({"__key__": f"{cls}/{key}", ext: data})
                n += 1
    assert n == files, n


def run_tar(src: Path, out: Path, files: int) -> None:
    out.mkdir(parents=True)
    # A real file: GNU tar does not even read the inputs when the archive is /dev/null.
    subprocess.run(["tar", "cf", str(out / "tree.tar"), "-C", str(src), "."], check=True)


def version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000, help="files in the tree (default 100000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool; the best counts (default 3)")
    ap.add_argument("--data", type=Path, default=HERE / "data", help="cache directory (default bench/data)")
    ap.add_argument("--out", type=Path, help="also write the Markdown table here")
    ap.add_argument("--shardstream", help="the shardstream binary (default: target/release/shardstream)")
    args = ap.parse_args()
    global SHARDSTREAM
    SHARDSTREAM = args.shardstream

    root = args.data / f"pack-v{TREE_VERSION}-n{args.files}"
    t0 = time.perf_counter()
    src = generate(root, args.files)
    gen_s = time.perf_counter() - t0
    files, payload = warm(src)
    assert files == args.files, files
    work = root / "out"

    tools: list[tuple[str, Callable[[Path, Path, int], None]]] = [
        ("shardstream pack", run_shardstream),
        ("webdataset ShardWriter (Python loop)", run_shardwriter),
        ("GNU tar cf", run_tar),
    ]
    results: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):
        for name, fn in tools:
            if work.exists():
                shutil.rmtree(work)
            subprocess.run(["sync"], check=True)
            wall, sync = timed(lambda fn=fn: fn(src, work, files))
            best = results.get(name)
            if best is None or wall < best[0]:
                results[name] = (wall, sync)
            print(f"  {name}: {wall:.2f} s (+{sync:.2f} s sync)", file=sys.stderr)
    if work.exists():
        shutil.rmtree(work)

    sw = results["webdataset ShardWriter (Python loop)"][0]
    tar = results["GNU tar cf"][0]
    import webdataset

    lines = [
        "## Packing small files into shards (`bench/pack_bench.py`)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with "
        f"`python bench/pack_bench.py --files {args.files} --repeat {args.repeat}`"
        + (f" (tree generated in {gen_s:.0f} s)" if gen_s > 5 else "")
        + ".",
        "",
        f"- Machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}; load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        f"- Tree: {files:,} files in {CLASSES} class directories, 16-20 KiB of random bytes each "
        f"({payload / 1e9:.2f} GB), hot in the page cache; output on the same disk.",
        f"- Versions: {version([shardstream_cmd(), '--version'])}, webdataset {webdataset.__version__}, "
        f"{version(['tar', '--version'])}.",
        "- shardstream: default options (1 GiB shards, manifest and sidecars, fsync of every shard before the "
        "manifest). ShardWriter: `maxsize=1 GiB`, fed by a sorted walk reading each file in Python. tar: one "
        "archive. Best of the runs; `+sync`: wall time plus a `sync` right after (time until durable).",
        "",
        "| tool | wall (s) | files/s | MB/s | +sync (s) | files/s vs ShardWriter | files/s vs tar |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, _fn in tools:
        wall, sync = results[name]
        lines.append(
            f"| {name} | {wall:.2f} | {files / wall:,.0f} | {payload / 1e6 / wall:,.0f} | {wall + sync:.2f} "
            f"| {sw / wall:.2f}x | {tar / wall:.2f}x |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
