"""One cold S3 epoch on a timeline: every 20 ms, the machine's idle share, the bytes the daemon's
node cache holds, and the samples the trainer has taken. The tool behind the "timeline" round of
bench/PROFILES.md section 1 (not part of `make bench`).

    python bench/s3_timeline.py [--samples 40000] [--every 2] [--plain]

The dataset, bucket and server are `bench/s3_profile.py`'s (run.py's WebDataset shards hard-linked
into an s3s-fs bucket on 127.0.0.1, objects hot in the page cache); a fresh daemon with an empty
cache serves one shuffled epoch to this process. Printed: the epoch's seconds and the CPU-seconds
the machine left idle during it, then one line per `--every`-th sample (time since the loader was
made, idle % of both cores over the last 20 ms, MB in the node cache, samples taken). Where the
cache stops growing while the trainer waits, the daemon is not downloading; where idle stays near
0, something on the machine is working. `--plain`: the plain client (`s3_fetch`, the daemon's
32 MiB GETs, 16 at once) instead of the epoch, with its idle CPU-seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gen  # noqa: E402
import measure  # noqa: E402
import s3_bench  # noqa: E402
from s3server import S3Server  # noqa: E402

PERIOD = 0.02


def cpu_idle() -> tuple[int, int]:
    """(idle + iowait, all) jiffies of the whole machine (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)


def tree_bytes(root: Path) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(d, name)).st_blocks * 512
            except OSError:
                pass  # renamed or removed meanwhile
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--every", type=int, default=2, help="print every n-th 20 ms sample")
    ap.add_argument("--data", type=Path, default=Path(s3_bench.ROOT) / "bench/data")
    ap.add_argument("--plain", action="store_true", help="time the plain client (s3_fetch, 16 GETs at once) instead")
    a = ap.parse_args()

    spec = gen.Spec(samples=a.samples)
    base = gen.ensure(a.data, spec, ["wds"])
    bucket = a.data / "s3" / "bench"
    s3_bench.link_tree(base / "wds", bucket / f"{spec.key()}/wds")
    s3_bench.shardstream_index(bucket / f"{spec.key()}/wds")
    measure.warm(sorted((bucket / f"{spec.key()}/wds").glob("*.tar")))
    server = S3Server(a.data / "s3").start()
    tmp = Path(tempfile.mkdtemp(prefix="s3-timeline-"))
    import shardstream

    proc = None
    try:
        proc, addr = s3_bench.daemon(tmp, server.env())
        line: list[tuple[float, float, float]] = []
        taken: list[tuple[float, int]] = []
        done = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            i0, a0 = cpu_idle()
            while not done.is_set():
                time.sleep(PERIOD)
                i1, a1 = cpu_idle()
                line.append((time.perf_counter() - t0, 100 * (i1 - i0) / max(1, a1 - a0), tree_bytes(tmp) / 1e6))
                i0, a0 = i1, a1

        sampler = threading.Thread(target=sample)
        sampler.start()
        n = 0
        if a.plain:
            got = s3_bench.plain_client(server.env(), "bench", f"{spec.key()}/wds/", 16, s3_bench.DAEMON_PART_BYTES)
            n = int(got["requests"])
        else:
            loader = shardstream.Loader(f"s3://bench/{spec.key()}/wds/", batch_size=256, seed=0, connect=addr)
            for b in loader:
                n += len(b["__key__"])
                taken.append((time.perf_counter() - t0, n))
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        cores = os.cpu_count() or 1
        idle_s = sum(idle / 100 * PERIOD * cores for _, idle, _ in line)
        what = f"plain client, {n} GETs" if a.plain else f"epoch, {n} samples (expected {a.samples})"
        print(f"{what}: {seconds:.2f} s; idle {idle_s:.2f} of {seconds * cores:.2f} CPU-s")
        k = 0
        for i, (t, idle, mb) in enumerate(line):
            while k < len(taken) and taken[k][0] <= t:
                k += 1
            if i % a.every == 0:
                print(f"{t:5.2f} s  idle {idle:3.0f}%  cache {mb:6.0f} MB  samples {taken[k - 1][1] if k else 0}")
    finally:
        if proc is not None:
            s3_bench.stop(proc)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
