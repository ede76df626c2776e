"""The client's CPU per epoch in view mode (shared memory, the default on one host): what the
trainer process spends turning each `ShmBatch` into a batch dict of keys and memoryviews.

Not a timed test and not part of `make bench`: a before/after measurement for one change (the
daemon locating every sample's key and fields from its index, `ShmBatch.key_offsets`/`fields`,
so that the client no longer parses TAR headers per sample). Run it with a release install; it
measures whatever `shardstream` the interpreter imports, in two modes over the same shards and
manifest (`shardstream index`):

- `located`: the version 2 sidecars `index` writes, with each sample's layout: the daemon sends
  the locations and the client slices;
- `parsed`: the same sidecars rewritten as version 1 (no layout, what the previous build wrote
  and this one still reads): the daemon sends none and the client parses every sample's TAR
  headers, exactly the code path of the previous build.

    python bench/layout_cpu.py --data /tmp/layout-cpu [--samples 50000] [--epochs 3]

The dataset (small samples, where header parsing weighs most: a 1-3 KiB `jpg` and a `cls` label,
written by `webdataset.TarWriter`) is made once under --data. One daemon is started per run; one
warm-up epoch, then the client's user+system CPU (`getrusage`, the whole process: Python and the
native module's threads) and the daemon's are measured per epoch; the minimum over epochs is
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon  # noqa: E402
import measure  # noqa: E402

PER_SHARD = 1000
BATCH = 256


def dataset(root: Path, samples: int) -> Path:
    import webdataset as wds

    d = root / f"wds-{samples}"
    if (d / ".complete").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 8192, dtype=np.uint8).tobytes()
    for s in range(0, samples, PER_SHARD):
        with wds.TarWriter(str(d / f"shard-{s // PER_SHARD:06d}.tar")) as w:
            for i in range(s, min(s + PER_SHARD, samples)):
                size = 1024 + (i * 97) % 2048
                w.write({"__key__": f"{i:08d}", "jpg": block[i % 4096 : i % 4096 + size], "cls": str(i % 1000)})
    (d / ".complete").write_text("")
    return d


def _crc32c(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _varint(b: bytes, at: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        x = b[at]
        at += 1
        v |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return v, at


def sidecar_v1(v2: bytes) -> bytes:
    """A version 2 sidecar (server/src/format/sidecar.rs) as version 1: the same table without
    its layout section."""
    assert v2[:8] == b"SSIDX\0\r\n" and int.from_bytes(v2[8:12], "little") == 2, "not a v2 sidecar"
    at = 12
    n, at = _varint(v2, at)
    at += n  # identity
    fields, at = _varint(v2, at)
    for _ in range(fields):
        n, at = _varint(v2, at)
        at += n
    samples, at = _varint(v2, at)
    for _ in range(samples + 1 if samples else 0):
        _, at = _varint(v2, at)
    body = v2[:8] + (1).to_bytes(4, "little") + v2[12:at]
    return body + _crc32c(body).to_bytes(4, "little")


def indexed(data: Path, samples: int, mode: str) -> Path:
    """The dataset with a manifest, its sidecars as `mode` wants them (a copy per mode, shards
    hard-linked)."""
    src = dataset(data, samples)
    d = data / f"{src.name}-{mode}"
    if (d / ".complete").exists():
        return d
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    for f in src.glob("*.tar"):
        os.link(f, d / f.name)
    subprocess.run([str(daemon.executable()), "index", str(d)], check=True, capture_output=True)
    if mode == "parsed":
        for idx in (d / "_shardstream").glob("*.idx"):
            idx.write_bytes(sidecar_v1(idx.read_bytes()))
    (d / ".complete").write_text("")
    return d


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def epoch(shardstream, path: Path, addr: str, seed: int) -> tuple[int, int]:
    loader = shardstream.Loader(str(path), batch_size=BATCH, seed=seed, connect=addr)
    n = payload = 0
    for batch in loader:
        keys = batch["__key__"]
        n += len(keys)
        # Touch what a trainer touches: every field of every sample (length only: decoding is
        # the same with or without the change and would drown it).
        for v in batch["jpg"]:
            payload += len(v)
        for v in batch["cls"]:
            payload += len(v)
    if loader.stats()["transport"] != "shm":
        raise SystemExit("expected the shared-memory transport")
    return n, payload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=50_000)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()

    import shardstream

    report = {"shardstream": str(Path(shardstream.__file__).parent)}
    for mode in ("parsed", "located"):
        path = indexed(args.data, args.samples, mode)
        report[mode] = run(shardstream, path, args.epochs)
    p, loc = report["parsed"], report["located"]
    report["client_cpu_saved"] = f"{1 - loc['client_cpu_s_per_epoch'] / p['client_cpu_s_per_epoch']:.0%}"
    print(json.dumps(report, indent=1))


def run(shardstream, path: Path, epochs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="layout-cpu-") as work:
        d = daemon.Daemon.start(Path(work))
        try:
            epoch(shardstream, path, d.addr, seed=0)  # warm: index resident, pages cached
            runs = []
            for e in range(epochs):
                c0, d0, t0 = cpu(), measure.cpu_seconds(d.pid) or 0.0, time.perf_counter()
                n, _ = epoch(shardstream, path, d.addr, seed=e + 1)
                wall = time.perf_counter() - t0
                runs.append(
                    {
                        "client_cpu_s": cpu() - c0,
                        "daemon_cpu_s": (measure.cpu_seconds(d.pid) or 0.0) - d0,
                        "wall_s": wall,
                        "samples": n,
                    }
                )
        finally:
            d.stop()
    best = min(runs, key=lambda r: r["client_cpu_s"])
    return {
        "samples": best["samples"],
        "client_cpu_s_per_epoch": round(best["client_cpu_s"], 3),
        "client_cpu_us_per_sample": round(1e6 * best["client_cpu_s"] / best["samples"], 2),
        "daemon_cpu_s_per_epoch": round(min(r["daemon_cpu_s"] for r in runs), 3),
        "samples_per_s": round(best["samples"] / min(r["wall_s"] for r in runs)),
    }


if __name__ == "__main__":
    main()
