"""`make demo`: a small WebDataset dataset, a real daemon, two epochs through the Python client.

Generates ~4000 image-like samples (16-20 KiB of bytes + a label) with the real `webdataset`
library's ShardWriter, starts `shardstream serve` on a Unix socket in a temporary directory,
streams two shuffled epochs through `shardstream.Loader` with a progress bar, prints throughput and
time spent waiting for data, and stops the daemon.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import webdataset as wds

import shardstream

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".demo" / "data"
SAMPLES = 4000
PER_SHARD = 500


def make_dataset() -> None:
    if (DATA / "done").exists():
        return
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sizes = rng.integers(16 << 10, 20 << 10, SAMPLES)
    pool = rng.integers(0, 256, 32 << 10, dtype=np.uint8).tobytes()
    with wds.ShardWriter(str(DATA / "demo-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i, size in enumerate(sizes):
            off = int(rng.integers(0, len(pool) - size))
            sink.write({"__key__": f"sample{i:07d}", "jpg": pool[off : off + size], "cls": str(i % 10).encode()})
    (DATA / "done").write_text("ok\n")


def wait_ready(addr: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"daemon exited with code {proc.returncode}")
        if shardstream._native.probe(addr):
            return
        time.sleep(0.05)
    sys.exit(f"daemon did not answer on {addr} within {timeout} s")


def bar(done: int, total: int, started: float, width: int = 40) -> None:
    frac = done / max(total, 1)
    rate = done / max(time.perf_counter() - started, 1e-9)
    fill = int(frac * width)
    sys.stderr.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {done}/{total} samples  {rate:,.0f}/s ")
    sys.stderr.flush()


def main() -> None:
    print(f"==> generating {SAMPLES} samples with webdataset.ShardWriter in {DATA}")
    make_dataset()
    tmp = Path(tempfile.mkdtemp(prefix="shardstream-demo-"))
    addr = f"unix://{tmp / 'sock'}"
    exe = Path(sys.executable).with_name("shardstream")
    cmd = [str(exe), "serve", "--listen", addr, "--cache-dir", str(tmp / "cache"), "--log", "warn"]
    print(f"==> starting daemon: {' '.join(cmd)}")
    daemon = subprocess.Popen(cmd)
    try:
        wait_ready(addr, daemon)
        loader = shardstream.Loader(str(DATA), batch_size=256, shuffle=True, seed=0, connect=addr)
        n = loader.info["num_samples"]
        print(f"==> dataset: {n} samples in {loader.info['num_shards']} shards, fields {loader.info['fields']}")
        for epoch in range(2):
            loader.set_epoch(epoch)
            started = time.perf_counter()
            seen = 0
            checksum = 0
            for batch in loader:
                for v in batch["jpg"]:
                    # Stand-in for a training step's decode: touch the payload.
                    checksum += int(np.frombuffer(v, np.uint8)[::4096].sum())
                seen += len(batch["__key__"])
                bar(seen, n, started)
                time.sleep(0.002)  # stand-in for the GPU step
            sys.stderr.write("\n")
            print(f"  epoch {epoch}: {seen} samples in {time.perf_counter() - started:.2f} s")
        s = loader.stats()
        print(
            f"==> throughput: {s['samples_per_s']:,.0f} samples/s, {s['bytes_per_s'] / 1e6:,.1f} MB/s; "
            f"waited for data {s['wait_s']:.2f} s of {s['elapsed_s']:.2f} s; "
            f"first batch after {s['time_to_first_batch_s'] * 1000:.1f} ms; transport {s['transport']}"
        )
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print("==> daemon stopped")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
