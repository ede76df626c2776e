"""One shuffled epoch of the decode pipeline through one reader, in a fresh interpreter::

    python bench/decode_peers.py READER WORKERS DATASET_DIR SAMPLES [ADDRESS]

With `BENCH_EPOCHS=N` (`decode_bench.py --epochs N`), N-1 untimed epochs come first, each with a
reader made anew, as in bench/peers.py; `BENCH_DAEMON_PID` names the daemon whose CPU is then
counted around the measured epoch.

The pipeline is the same for every reader and runs where each reader's documentation puts it: in
the DataLoader workers (in the reader process with 0 workers). Per image: Pillow decodes the JPEG,
a random-resized crop (scale 0.08-1, aspect 3/4-4/3, torchvision's defaults) is resized to 224x224
(bilinear, crop and resize in one Pillow call), flipped horizontally with probability 1/2, and
turned into a contiguous uint8 CHW tensor (what torchvision's `PILToTensor` gives). torchvision
itself is not used: no wheel of it pairs with this torch. Batches of 256 are made by
`default_collate`: (images [256, 3, 224, 224] uint8, ids, decode ns).

The decode's own CPU time is measured around it with the thread's CPU clock and summed by the
trainer, so the harness can split the epoch's CPU into the decoder's and the loader's (everything
else: reading, framing, shuffling, moving batches between processes). The trainer process runs
torch with one intra-op thread (see `main`).

Prints one line `RESULT {json}` like bench/peers.py, plus `decode_cpu_s` and `bad_shape`.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import consumer
import measure
import numpy as np
import peers

BATCH = 256
SEED = 0
CROP = 224
WDS_SHUFFLE_BUFFER = 1000
RESULT_PREFIX = "RESULT "

Sample = tuple[Any, int, int]  # (CHW uint8 tensor, image index, decode thread-CPU ns)
Batches = Iterable[tuple[Any, Any, Any]]
Make = Callable[[Path, int, str], Batches]

_rng = random.Random()


def random_resized_crop(w: int, h: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (scale 0.08-1, log-uniform aspect 3/4-4/3, 10 tries,
    then the centre crop clamped to the aspect range)."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return x, y, x + cw, y + ch
    ratio = w / h
    if ratio < 3 / 4:
        cw, ch = w, round(w / (3 / 4))
    elif ratio > 4 / 3:
        cw, ch = round(h * (4 / 3)), h
    else:
        cw, ch = w, h
    x, y = (w - cw) // 2, (h - ch) // 2
    return x, y, x + cw, y + ch


def decode(jpg: Any, key: str) -> Sample:
    """The pipeline for one image (bytes or a memoryview of them)."""
    import torch
    from PIL import Image

    t0 = time.thread_time_ns()
    img = Image.open(io.BytesIO(jpg)).convert("RGB")
    img = img.resize((CROP, CROP), Image.Resampling.BILINEAR, box=random_resized_crop(*img.size, _rng))
    if _rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    chw = torch.from_numpy(np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1)))
    return chw, int(key), time.thread_time_ns() - t0


def collate(samples: list[Sample]) -> tuple[Any, Any, Any]:
    from torch.utils.data import default_collate

    out: tuple[Any, Any, Any] = default_collate(samples)
    return out


def seed_worker(worker: int) -> None:
    """Distinct augmentation draws per worker (forked workers would share the parent's state)."""
    _rng.seed(SEED * 1000 + worker)


class RawFiles:
    """ImageFolder-style map-style dataset: opens, reads and decodes `raw/<label>/<key>.jpg`."""

    def __init__(self, root: Path) -> None:
        dirs = [d.path for d in os.scandir(root) if d.is_dir()]
        self.paths = sorted(e.path for d in dirs for e in os.scandir(d) if e.name.endswith(".jpg"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Sample:
        path = self.paths[i]
        with open(path, "rb") as f:
            return decode(f.read(), os.path.basename(path)[: -len(".jpg")])


def torch_files(data: Path, workers: int, _addr: str) -> Batches:
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        RawFiles(data / "raw"),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(SEED),
        worker_init_fn=seed_worker,
    )


def _wds_decode(sample: dict[str, Any]) -> Sample:
    return decode(sample["jpg"], sample["__key__"])


def webdataset(data: Path, workers: int, _addr: str) -> Batches:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [str(p) for p in sorted((data / "wds").glob("*.tar"))]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED, empty_check=False)
        .shuffle(WDS_SHUFFLE_BUFFER)
        .map(_wds_decode)
        .batched(BATCH, collation_fn=collate)
    )
    return DataLoader(ds, batch_size=None, num_workers=workers, worker_init_fn=seed_worker)


def mosaicml(data: Path, workers: int, _addr: str) -> Batches:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    class Decoded(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: int) -> Sample:
            s = super().__getitem__(i)
            return decode(s["jpg"], s["key"])

    clean_stale_shared_memory()  # a previous run killed by the timeout leaves its segments behind
    ds = Decoded(local=str(data / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=collate, worker_init_fn=seed_worker)


def litdata(data: Path, workers: int, _addr: str) -> Batches:
    import litdata as ld

    class Decoded(ld.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: Any) -> Sample:
            s = super().__getitem__(i)
            return decode(s["jpg"], s["key"])

    ds = Decoded(str(data / "litdata"), shuffle=True, seed=SEED)
    return ld.StreamingDataLoader(
        ds, batch_size=BATCH, num_workers=workers, collate_fn=collate, worker_init_fn=seed_worker
    )


def _ss_decode(sample: dict[str, Any]) -> Sample:
    return decode(sample["jpg"], sample["__key__"])


def shardstream(data: Path, workers: int, addr: str, reuse_batch_memory: bool = True) -> Batches:
    """The documented fast way: the transform decodes in each worker, on the zero-copy views. Its
    results go through the default collate (`default_collate`, as `collate` above), which lets the
    workers stack each batch into memory they reuse (`reuse_batch_memory`)."""
    import shardstream.torch as sst

    ds = sst.IterableDataset(
        str(data / "wds"), batch_size=BATCH, shuffle=True, seed=SEED, connect=addr, transform=_ss_decode
    )
    return sst.DataLoader(ds, num_workers=workers, worker_init_fn=seed_worker, reuse_batch_memory=reuse_batch_memory)


def shardstream_fresh(data: Path, workers: int, addr: str) -> Batches:
    """As `shardstream`, but every batch stacked into new memory (a shared-memory segment in a
    worker), as `default_collate` does: what reusing the batch memory saves."""
    return shardstream(data, workers, addr, reuse_batch_memory=False)


def shardstream_main(data: Path, workers: int, addr: str) -> Iterator[tuple[Any, Any, Any]]:
    """Without a transform: workers pickle the raw bytes to the trainer, which decodes (the only
    way before the transform hook; with 0 workers the same as `shardstream`)."""
    import shardstream.torch as sst

    ds = sst.IterableDataset(str(data / "wds"), batch_size=BATCH, shuffle=True, seed=SEED, connect=addr)
    for batch in sst.DataLoader(ds, num_workers=workers):
        yield collate([decode(j, k) for j, k in zip(batch["jpg"], batch["__key__"], strict=True)])


READERS: dict[str, tuple[str, Make, tuple[str, ...]]] = {
    "torch-files": ("raw", torch_files, ()),
    "webdataset": ("wds", webdataset, ("webdataset",)),
    "mosaicml": ("mds", mosaicml, ("streaming", "streaming.base.util")),
    "litdata": ("litdata", litdata, ("litdata",)),
    "shardstream": ("wds", shardstream, ("shardstream", "shardstream.torch")),
    "shardstream-fresh-memory": ("wds", shardstream_fresh, ("shardstream", "shardstream.torch")),
    "shardstream-main-decode": ("wds", shardstream_main, ("shardstream", "shardstream.torch")),
}


def epoch(make: Make, data: Path, workers: int, addr: str, expected: int) -> dict[str, Any]:
    # The tree's: the untimed epochs' DataLoader workers are waited-for children by now.
    cpu_before = peers.cpu_tree()
    t0 = time.perf_counter()
    ttfb = None
    ids: list[int] = []
    decode_ns = bad_shape = touched = 0
    for images, idx, ns in make(data, workers, addr):
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        if tuple(images.shape[1:]) != (3, CROP, CROP) or str(images.dtype) != "torch.uint8":
            bad_shape += 1
        touched += int(images.reshape(-1)[::4096].sum())  # one byte per page, as a copy to the GPU would
        ids += idx.tolist()
        decode_ns += int(ns.sum())
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "samples": len(ids),
        "seconds": seconds,
        "ttfb": ttfb,
        "cpu_before": cpu_before,
        "decode_cpu_s": decode_ns / 1e9,
        "bad_shape": bad_shape,
        "touched": touched,
    }
    result.update(consumer.check_ids(ids, expected))
    return result


def main() -> None:
    reader, workers, data, expected = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    addr = sys.argv[5] if len(sys.argv) > 5 else ""
    _fmt, make, preload = READERS[reader]
    for module in ("torch.utils.data", "PIL.Image", *preload):
        importlib.import_module(module)
    import torch

    # One intra-op thread in the trainer: with torch's default (one per core), the pool's threads
    # spin after every parallel op (default_collate's stack at 0 workers, the consumer's sum),
    # which measured as ~2 ms of CPU per image, more than the decode itself, charged to every
    # loader alike and taken from the decoding workers. A GPU trainer does not run those ops on
    # the CPU. (DataLoader workers run with one thread already.)
    torch.set_num_threads(1)
    seed_worker(-1)
    for _ in range(int(os.environ.get("BENCH_EPOCHS", "1")) - 1):
        untimed = epoch(make, data, workers, addr, expected)
        if untimed["samples"] != expected or untimed["missing"] or untimed["duplicated"]:
            raise SystemExit(f"an untimed epoch delivered {untimed['samples']} images of {expected}")
    daemon = int(os.environ.get("BENCH_DAEMON_PID", "0"))
    daemon_cpu0 = measure.cpu_seconds(daemon) if daemon else None
    result = epoch(make, data, workers, addr, expected)
    if daemon_cpu0 is not None:
        result["daemon_cpu"] = (measure.cpu_seconds(daemon) or daemon_cpu0) - daemon_cpu0
    result["cpu_at_exit"] = peers.cpu_tree()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    os._exit(0)  # some peers' background threads make interpreter teardown slow or hang


if __name__ == "__main__":
    main()
