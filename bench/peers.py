"""One shuffled epoch of one reader, in a fresh interpreter (the harness runs this as a subprocess)::

    python bench/peers.py READER WORKERS DATASET_DIR SAMPLES [ADDRESS]

Every reader is driven the way its documentation shows, batch size 256, and feeds the same cheap
consumer: for each sample, touch the payload (`np.frombuffer(v, np.uint8)[::4096].sum()`), take its
length, and read the sample index the generator wrote after the start marker (so the harness can
tell "every sample exactly once" from "the right count"). Library imports happen before the clock
starts: they are not the reader's cost.

With `BENCH_EPOCHS=N` in the environment (`run.py --epochs N`), the reader first runs N-1 untimed
epochs in this interpreter, each with a reader made anew, and the last one is measured: a
trainer's later epochs, where each library's first-use costs (its index, its caches, the garbage
its imports left for the collector) are behind it, for every reader alike.

Prints one line `RESULT {json}`: samples, bytes, seconds (construction of the loader to the end of
the epoch), ttfb (construction to the first batch), cpu_before (CPU seconds this process had used
when the clock started, so the harness can leave imports out), cpu_at_exit (CPU seconds of this
process and its waited-for children just before it exits, so the harness can leave out tearing
down the interpreter), missing/duplicated/out-of-range ids.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import consumer
import measure

BATCH = 256
SEED = 0
# Samples in the shuffle buffer of the webdataset peer: the value its documentation uses.
WDS_SHUFFLE_BUFFER = 1000
RESULT_PREFIX = "RESULT "

Payloads = Iterable[Any]  # one batch: bytes-like payloads
Make = Callable[[Path, int, str], Iterator[Payloads]]


def as_list(batch: list[Any]) -> list[Any]:
    """collate_fn that keeps a batch as the list of samples (no tensor conversion)."""
    return batch


class RawFiles:
    """Map-style dataset over `raw/<label>/<key>.jpg` + `.cls`: what a user writes without a library."""

    def __init__(self, root: Path) -> None:
        dirs = [d.path for d in os.scandir(root) if d.is_dir()]
        jpgs = (e.path for d in dirs for e in os.scandir(d) if e.name.endswith(".jpg"))
        self.stems = sorted(p[: -len(".jpg")] for p in jpgs)

    def __len__(self) -> int:
        return len(self.stems)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        stem = self.stems[i]
        with open(stem + ".jpg", "rb") as f:
            jpg = f.read()
        with open(stem + ".cls", "rb") as f:
            cls = int(f.read())
        return jpg, cls


def torch_files(data: Path, workers: int, _addr: str) -> Iterator[Payloads]:
    import torch
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(SEED)
    dl = DataLoader(
        RawFiles(data / "raw"),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        collate_fn=as_list,
        generator=generator,
    )
    return ([jpg for jpg, _cls in batch] for batch in dl)


def webdataset(data: Path, workers: int, _addr: str) -> Iterator[Payloads]:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [str(p) for p in sorted((data / "wds").glob("*.tar"))]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), seed=SEED, empty_check=False)
        .shuffle(WDS_SHUFFLE_BUFFER)
        .to_tuple("jpg", "cls")
        .batched(BATCH, collation_fn=as_list)
    )
    dl = DataLoader(ds, batch_size=None, num_workers=workers)
    return ([jpg for jpg, _cls in batch] for batch in dl)


def mosaicml(data: Path, workers: int, _addr: str) -> Iterator[Payloads]:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()  # a previous run killed by the timeout leaves its segments behind
    ds = StreamingDataset(local=str(data / "mds"), shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=as_list)
    return ([s["jpg"] for s in batch] for batch in dl)


def litdata(data: Path, workers: int, _addr: str) -> Iterator[Payloads]:
    import litdata as ld

    ds = ld.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED)
    dl = ld.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=as_list)
    return ([s["jpg"] for s in batch] for batch in dl)


def floor_batches(data: Path) -> list[list[memoryview]]:
    """Every sample's payload of the WebDataset shards, in memory, shuffled into batches: what
    `floor` feeds the consumer. Made before the clock."""
    import random
    import tarfile

    payloads: list[memoryview] = []
    for shard in sorted((data / "wds").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                f = tar.extractfile(member) if member.name.endswith(".jpg") else None
                if f is not None:
                    payloads.append(memoryview(f.read()))
    random.Random(SEED).shuffle(payloads)
    return [payloads[i : i + BATCH] for i in range(0, len(payloads), BATCH)]


def shardstream(
    data: Path, workers: int, addr: str, transport: str = "auto", cache: str = "auto"
) -> Iterator[Payloads]:
    import shardstream as ss

    url = str(data / "wds")
    opts = {"batch_size": BATCH, "shuffle": True, "seed": SEED, "connect": addr, "transport": transport, "cache": cache}
    if workers == 0:
        loader = ss.Loader(url, **opts)
        return (batch["jpg"] for batch in loader)
    from torch.utils.data import DataLoader

    import shardstream.torch as sst

    ds = sst.IterableDataset(url, **opts)
    dl = DataLoader(ds, batch_size=None, num_workers=workers)
    return (batch["jpg"] for batch in dl)


def shardstream_inline(data: Path, workers: int, addr: str) -> Iterator[Payloads]:
    """shardstream with the bytes inside the gRPC messages (what a remote trainer gets)."""
    return shardstream(data, workers, addr, transport="inline")


def shardstream_mapped(data: Path, workers: int, addr: str) -> Iterator[Payloads]:
    """shardstream with SHARDSTREAM_MAP_IN_PLACE=1: the trainer vouches that the shards do not
    change, so shards read in place are mapped (zero-copy) instead of read into a buffer."""
    import os

    os.environ["SHARDSTREAM_MAP_IN_PLACE"] = "1"  # read at the first shard; workers inherit it
    return shardstream(data, workers, addr)


def shardstream_cache(data: Path, workers: int, addr: str) -> Iterator[Payloads]:
    """shardstream reading copies of the shards in the daemon's node cache (`cache="copy"`), the
    path of a dataset on S3 or a parallel file system: the copies are mapped zero-copy."""
    return shardstream(data, workers, addr, cache="copy")


_FLOOR: list[list[memoryview]] = []


def floor(_data: Path, _workers: int, _addr: str) -> Iterator[Payloads]:
    """Not a reader: the consumer alone over payloads already in memory (`floor_batches`, which
    `main` makes before the clock), the most any reader can reach on this machine; no peer."""
    return iter(_FLOOR)


# reader -> (dataset format it reads, how to build it, modules imported before the clock starts)
READERS: dict[str, tuple[str, Make, tuple[str, ...]]] = {
    # The consumer alone (0 workers only): what no reader can beat here.
    "floor": ("wds", floor, ()),
    "torch-files": ("raw", torch_files, ()),
    "webdataset": ("wds", webdataset, ("webdataset",)),
    "mosaicml": ("mds", mosaicml, ("streaming", "streaming.base.util")),
    "litdata": ("litdata", litdata, ("litdata",)),
    "shardstream": ("wds", shardstream, ("shardstream", "shardstream.torch")),
    "shardstream-inline": ("wds", shardstream_inline, ("shardstream", "shardstream.torch")),
    # The same two, measured on a daemon that has already served one (untimed) epoch of the
    # dataset: the node daemon's steady state, where the dataset's index is resident and its
    # shards verified. The rows above include that one-time work of a fresh daemon.
    "shardstream-warm": ("wds", shardstream, ("shardstream", "shardstream.torch")),
    "shardstream-inline-warm": ("wds", shardstream_inline, ("shardstream", "shardstream.torch")),
    # Warm, with the trainer vouching that the shards read in place never change (a read-only
    # snapshot): mapped zero-copy instead of the default's one pread per sample into a buffer.
    "shardstream-mapped-warm": ("wds", shardstream_mapped, ("shardstream", "shardstream.torch")),
    # Warm, through the node cache: what a trainer of an S3 or PFS dataset gets once the shards
    # are copied to the node (the untimed epoch copied them).
    "shardstream-cache-warm": ("wds", shardstream_cache, ("shardstream", "shardstream.torch")),
}

# Readers whose daemon the harness warms with one untimed epoch before the measured one.
WARM_DAEMON = {
    "shardstream-warm": "shardstream",
    "shardstream-inline-warm": "shardstream-inline",
    "shardstream-mapped-warm": "shardstream",
    "shardstream-cache-warm": "shardstream-cache-warm",
}


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_tree() -> float:
    """CPU seconds of this process and the children it has waited for (DataLoader workers): with
    the harness's own count of the process at its end, what tearing the process down cost."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return cpu_self() + ru.ru_utime + ru.ru_stime


def epoch(make: Make, data: Path, workers: int, addr: str) -> dict[str, Any]:
    """Runs one epoch through the common consumer and returns what it counted; constructing the
    reader is on the clock."""
    # The tree's: the untimed epochs' DataLoader workers are waited-for children by now.
    cpu_before = cpu_tree()
    t0 = time.perf_counter()
    result = consumer.consume(make(data, workers, addr), t0)
    result["cpu_before"] = cpu_before
    return result


def main() -> None:
    reader, workers, data, expected = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    addr = sys.argv[5] if len(sys.argv) > 5 else ""
    _fmt, make, preload = READERS[reader]
    importlib.import_module("torch.utils.data")
    for module in preload:
        importlib.import_module(module)
    if reader == "floor":
        _FLOOR.extend(floor_batches(data))
    for _ in range(int(os.environ.get("BENCH_EPOCHS", "1")) - 1):
        untimed = consumer.consume(make(data, workers, addr))
        if untimed["samples"] != expected:
            raise SystemExit(f"an untimed epoch delivered {untimed['samples']} samples of {expected}")
    # The daemon's CPU is counted around the measured epoch here when there were untimed ones
    # (the harness counts it around the whole process otherwise).
    daemon = int(os.environ.get("BENCH_DAEMON_PID", "0"))
    daemon_cpu0 = measure.cpu_seconds(daemon) if daemon else None
    result = epoch(make, data, workers, addr)
    if daemon_cpu0 is not None:
        result["daemon_cpu"] = (measure.cpu_seconds(daemon) or daemon_cpu0) - daemon_cpu0
    result.update(consumer.check_ids(result.pop("ids"), expected))
    result["cpu_at_exit"] = cpu_tree()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()
    # Some peers' background threads make interpreter teardown slow or hang; the epoch is over.
    os._exit(0)


if __name__ == "__main__":
    main()
