"""`shardstream pack` against the other ways to turn a tree of small files into shards.

On one generated ImageNet-style tree (`bench/data/pack-n<N>/src/<class>/<key>.jpg`, 16-20 KiB of
random bytes each, 100 classes; generated once and cached), hot in the page cache, this times:

- `shardstream pack SRC --output DEST` (default options: 1 GiB WebDataset shards, manifest,
  sidecars; every shard fsynced before the manifest is written);
- `webdataset.ShardWriter` fed by a Python loop over the tree (walk, read, write), the way its
  documentation packs files, with the same 1 GiB shard size;
- GNU `tar cf` of the same tree into one archive (single-threaded; no fsync);
- `shardstream pack SRC --output s3://bench/pack/` into a local S3-compatible server (s3s-fs, from
  scripts/s3-server.sh), next to what the same server accepts from a plain aws-sdk-s3 client in
  the same run (`server/examples/s3_put.rs`: the same shard bytes as 16 MiB PUTs, 16 in flight).
  `--no-s3` leaves it out.

tar and ShardWriter return before their output is on disk; `+sync` adds the time of a `sync` run
right after each, so the last column compares the time until the shards are durable. Files/s and
MB/s (payload bytes, 10^6) are over the command's wall time, best of `--repeat` runs.

Usage: `python bench/pack_bench.py [--files 100000] [--repeat 3] [--out bench/pack-results.md]`
(`--shardstream` defaults to this checkout's `target/release/shardstream`, built with
`cargo build --release -p shardstream --example s3_put`; `make bench` writes the table to
bench/PACK_RESULTS.md).
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
sys.path.insert(0, str(HERE.parent / "tests"))

import report  # noqa: E402
from s3server import S3Server  # noqa: E402

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


def example(name: str) -> str:
    """A server example of this checkout, release build preferred."""
    for profile in ("release", "debug"):
        path = HERE.parent / "target" / profile / "examples" / name
        if path.exists():
            return str(path)
    sys.exit(f"{name} not found: run `cargo build --release -p shardstream --example {name}`")


def run_s3(src: Path, root: Path, files: int, repeat: int) -> tuple[float, dict]:
    """Best wall time of `pack --output s3://...` into a fresh prefix, and the plain client's PUT
    throughput (s3_put's JSON) on the same shard bytes, against one s3s-fs on 127.0.0.1."""
    if root.exists():
        shutil.rmtree(root)
    server = S3Server(root / "s3").start()
    try:
        env = {**os.environ, **server.env(), "XDG_CACHE_HOME": str(root / "state")}
        bucket = server.bucket("bench")
        best = float("inf")
        for _ in range(repeat):
            shutil.rmtree(bucket / "pack", ignore_errors=True)
            shutil.rmtree(root / "state", ignore_errors=True)
            cmd = [shardstream_cmd(), "pack", str(src), "--output", "s3://bench/pack/"]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
            wall = time.perf_counter() - t0
            manifest = json.loads((bucket / "pack" / "manifest.json").read_text())
            assert manifest["total_samples"] == files, manifest["total_samples"]
            print(f"  shardstream pack to S3: {wall:.2f} s", file=sys.stderr)
            best = min(best, wall)
        # The plain client uploads the very shard files pack produced.
        put = subprocess.run(
            [example("s3_put"), str(bucket / "pack"), "bench", "raw/"], env=env, capture_output=True, text=True
        )
        if put.returncode != 0:
            raise RuntimeError(f"s3_put failed: {put.stderr}")
        raw = json.loads(put.stdout)
        print(f"  plain PUTs: {raw['mb_per_s']:.0f} MB/s", file=sys.stderr)
        return best, raw
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


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
    ap.add_argument("--no-s3", action="store_true", help="leave out packing into a local S3 server")
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
    walls: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for name, fn in tools:
            if work.exists():
                shutil.rmtree(work)
            subprocess.run(["sync"], check=True)
            wall, sync = timed(lambda fn=fn: fn(src, work, files))
            walls.setdefault(name, []).append(wall)
            best = results.get(name)
            if best is None or wall < best[0]:
                results[name] = (wall, sync)
            print(f"  {name}: {wall:.2f} s (+{sync:.2f} s sync)", file=sys.stderr)
    if work.exists():
        shutil.rmtree(work)
    s3_wall, raw_put = (None, None) if args.no_s3 else run_s3(src, root / "s3-run", files, args.repeat)

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
        "archive. The tools run interleaved, once each per round. Best of the runs, and the median (min-max) "
        "wall time; `+sync`: the best run's wall time plus a `sync` right after (time until durable).",
        "",
        "| tool | wall (s), best | wall (s), median (min-max) | files/s | MB/s | +sync (s) | files/s vs ShardWriter "
        "| files/s vs tar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, _fn in tools:
        wall, sync = results[name]
        lines.append(
            f"| {name} | {wall:.2f} | {report.spread(walls[name], '.2f')} | {files / wall:,.0f} "
            f"| {payload / 1e6 / wall:,.0f} | {wall + sync:.2f} | {sw / wall:.2f}x | {tar / wall:.2f}x |"
        )
    per_round = [t / p for t, p in zip(walls["GNU tar cf"], walls["shardstream pack"], strict=True)]
    if s3_wall is not None:
        mbps = payload / 1e6 / s3_wall
        lines.append(
            f"| pack to S3 (local server) | {s3_wall:.2f} | - | {files / s3_wall:,.0f} | {mbps:,.0f} | n/a "
            f"| {sw / s3_wall:.2f}x | {tar / s3_wall:.2f}x |"
        )
    lines += [
        "",
        "shardstream pack against `tar cf` within each round (tar's wall time over pack's; pack's includes "
        "the fsync of every shard, tar's none): " + ", ".join(f"{x:.2f}x" for x in per_round) + "; median "
        f"{report.median(per_round):.2f}x.",
    ]
    if s3_wall is not None and raw_put is not None:
        mbps = payload / 1e6 / s3_wall
        lines += [
            "",
            f"Pack to S3: s3s-fs on 127.0.0.1 (objects written to the same disk); the same server accepted "
            f"{raw_put['mb_per_s']:,.0f} MB/s from a plain aws-sdk-s3 client in this run "
            f"(`s3_put`: the pack's {raw_put['bytes'] / 1e6:,.0f} MB of shards as {raw_put['requests']} "
            f"PUT{'s' if raw_put['requests'] != 1 else ''} of up to 16 MiB, 16 in flight), so pack to S3 ran "
            f"at {mbps / raw_put['mb_per_s']:.0%} of the server's raw PUT throughput (its MB/s counts payload, "
            "a little less than the shard bytes).",
        ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
