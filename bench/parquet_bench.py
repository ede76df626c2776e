"""Parquet: shardstream against the readers a user would pick instead, on the same files, in one
run; written to bench/PARQUET_RESULTS.md.

Two datasets, generated once into ``--data`` (default bench/data/parquet) and reused:

- **image**: ``--image-rows`` rows (100k) of ``image`` (10-30 KiB of random bytes, as incompressible
  as a JPEG, the row id in its first 8 bytes), ``label`` (int64) and ``caption`` (string); files
  of 1,000 rows, row groups of 250, snappy (what pyarrow and HF write by default): ~1.9 GiB;
- **tab**: ``--tab-rows`` rows (1M) of ``row_id`` (int64), 8 float32 features and ``label``;
  files of 100k rows, row groups of 10k.

Readers (one shuffled epoch each, every row's id checked: exactly once or the row says what is
wrong), each in a fresh process so that one's caches do not help the next:

- ``pa_seq``: ``pyarrow.dataset`` ``to_batches`` in file order, no shuffle: the ceiling;
- ``pa_shuffle``: by hand with pyarrow: row groups in a random order, a 10k-row shuffle buffer;
- ``hf_stream``: ``datasets.load_dataset("parquet", streaming=True).shuffle(buffer_size=10_000)``;
- ``hf_map``: ``load_dataset("parquet")`` (an Arrow copy into a temporary cache; its time is
  reported as prep, not in the epoch), ``.shuffle(seed)``, iterated in Arrow form;
- ``litdata_pq``: LitData over the Parquet files (``index_parquet_dataset`` + ``ParquetLoader``);
- ``floor``: not a reader but the bound on all of them: the rows read and cut into shuffled
  batches before the clock (prep), so the epoch is the consumer alone. Three times a peer's rows/s
  above ``floor``'s is out of reach for any loader with this consumer in the trainer's process;
  ``floor_views`` (image only): the same with the image column as ``binary_view``, the bound of
  the ``ss_views`` rows (the consumer reads a view column another way);
- ``ss_dict`` / ``ss_arrow``: shardstream over shared memory (a release daemon started here), the
  dict form and ``format="arrow"``; a fresh daemon per run, so every row group is decoded in the
  measured epoch;
- ``ss_arrow+warm``: the epoch after a first one on the same daemon (another seed), whose row groups
  are then decoded already: what a daemon that outlives its epochs serves from the second on, as
  long as the decoded set fits its budget (1 GiB by default). The counterpart of ``hf_map``, whose
  conversion is reported as prep and left out of its epoch.
- ``ss_arrow+kept``: epochs on one daemon (other seeds) until one keeps no more row groups (at most
  8), then the measured one. Where the decoded set outgrows the budget (the image set at 100,000
  rows), from the second epoch the daemon keeps the row groups in its node cache, written in the
  background at the lowest priority (``ss_arrow+warm`` runs beside that writing), and serves them from
  there; where it fits, it is ``+warm`` again. The report says how many epochs came before.
- ``ss_views`` / ``ss_views+warm``: ``format="arrow", binary_views=True``: the image column as
  ``binary_view`` arrays pointing into the daemon's decoded row groups (no copy of the values); the
  consumer reads each image through its view (``_binary_views``), the same bytes it reads elsewhere.
  The cold row includes writing each decoded row group into the node cache.
- ``ss_views+node``: ``ss_views`` on a fresh daemon whose node cache a first daemon filled (another
  seed, then a clean shutdown): the next job's sidecar on the node, which loads the row groups the
  first one kept instead of decoding them. Like ``hf_map``'s epoch after its conversion.
- ``READER+proc`` (not run by default): the measured epoch is the second of one trainer process,
  whose first epoch (another seed) ran in the same process before the clock: what a process keeps
  from one epoch to the next (its mappings of the node cache's files) shows only here, since every
  other row runs its epoch in a fresh process.
- ``ss_views+nokeep`` (not run by default): ``ss_views`` on a daemon started with
  ``--no-keep-decoded`` (row groups in shared memory only): what keeping them costs a cold epoch.

With S3 (``--no-s3`` leaves it out): the same files served from a local S3-compatible server
(s3s-fs from scripts/s3-server.sh, the files hard-linked into its bucket): ``shardstream index``
on the prefix (the bytes and requests it costs: footers only), then one epoch of shardstream
(``format="arrow"``, a fresh daemon and node cache each) with all fields and with ``label`` alone,
reporting the bytes downloaded and the requests made (daemon ``status``, dataset open included)
against the dataset's size and the bytes of the selected column chunks (what column-chunk ranged
reads download: a stream selecting under 90% of the bytes fetches only those; all fields go as
whole files).

``--variant NAME=SITE`` adds another build of the package (a directory where its wheel was
installed with ``pip install --target``): each shardstream reader asked for (``ss_views+warm``
too) again as ``READER@NAME``, with a daemon of that build, in the same interleaved repeats: a
before/after comparison of two builds in one run.

Per row the consumer touches the payload as a decoder would start (one byte per page of the image;
the features' sum for tab). Reported: rows/s (median of ``--repeats`` interleaved runs, with
their spread; the tab set ``--tab-repeats``, three times as many by default: its epoch lasts
~0.15-0.5 s, which one scheduling hiccup on a shared machine moves by a third, and a repeat costs
seconds), ratios to the best shuffled peer and to ``pa_seq`` (each taken within a repeat, then the
median and spread of those), CPU seconds per epoch (the
reader's process, plus the daemon's for shardstream), first-batch latency, the daemon's peak RSS,
and the measured shuffle (``span``: how far 100 consecutive stored rows end up apart in the
delivered order, as a fraction of the epoch; a uniform shuffle gives ~0.98).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256
BUFFER = 10_000
SEED = 0
PEERS = [
    "pa_seq",
    "pa_shuffle",
    "hf_stream",
    "hf_map",
    "litdata_pq",
    "floor",
    "floor_views",
    "ss_dict",
    "ss_arrow",
    "ss_arrow+warm",
    "ss_arrow+kept",
    "ss_views",
    "ss_views+warm",
    "ss_views+node",
]
WARM = "+warm"
# Epochs on one daemon until one keeps no more row groups, then the measured one.
KEPT = "+kept"
MAX_KEPT_EPOCHS = 8
# A first epoch on one daemon, then the measured one on a fresh daemon over the same node cache.
NODE = "+node"
# A daemon that keeps no decoded row groups in its node cache (`serve --no-keep-decoded`).
NOKEEP = "+nokeep"
# Read through the node cache (`cache="copy"`, the path of S3 datasets): the first epoch copies
# the files there; the daemon decodes from its mapping of the copies.
COPY = "+copy"
# The measured epoch is a trainer process's second: the first (another seed) runs in the same
# process, before the clock. What a process keeps between its epochs (mappings) shows here only.
PROC = "+proc"


# -- data ---------------------------------------------------------------------------------------


# How the image set's files are written: `snappy`, the default of pyarrow and Hugging Face
# (dictionary pages too, which fall back to PLAIN past 1 MiB); `plain`, as `shardstream pack
# --format parquet` writes payload columns (PLAIN, uncompressed: bench/PARQUET_LAYOUT.md).
LAYOUTS = {"snappy": {"compression": "snappy"}, "plain": {"compression": "none", "use_dictionary": False}}


def make_image(d: Path, rows: int, layout: str = "snappy") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = d / ".complete"
    # v2: every image its own random bytes (v1 cut them all from one 40 KiB block, which snappy
    # and zstd found across rows: zstd shrank the set 35x, no JPEG column does that).
    stamp = f"{rows} v2 {layout}"
    if done.exists() and done.read_text() == stamp:
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = 1000
    for f, first in enumerate(range(0, rows, per_file)):
        ids = range(first, min(first + per_file, rows))
        sizes = rng.integers(10 << 10, 30 << 10, len(ids))
        images = [i.to_bytes(8, "little") + rng.bytes(int(s) - 8) for i, s in zip(ids, sizes, strict=True)]
        t = pa.table(
            {
                "image": pa.array(images, pa.binary()),
                "label": pa.array([i % 1000 for i in ids], pa.int64()),
                "caption": pa.array([f"a photo of thing {i % 1000}, number {i}" for i in ids]),
            }
        )
        pq.write_table(t, d / f"image-{f:05d}.parquet", row_group_size=250, **LAYOUTS[layout])
    done.write_text(stamp)
    return d


def make_tab(d: Path, rows: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = d / ".complete"
    if done.exists() and done.read_text() == str(rows):
        return d
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    per_file = 100_000
    for f, first in enumerate(range(0, rows, per_file)):
        n = min(per_file, rows - first)
        cols: dict[str, Any] = {"row_id": np.arange(first, first + n, dtype=np.int64)}
        for k in range(8):
            cols[f"f{k}"] = rng.standard_normal(n, dtype=np.float32)
        cols["label"] = rng.integers(0, 10, n)
        pq.write_table(pa.table(cols), d / f"tab-{f:05d}.parquet", row_group_size=10_000, compression="snappy")
    done.write_text(str(rows))
    return d


def files(d: Path) -> list[str]:
    return [str(p) for p in sorted(d.glob("*.parquet"))]


# -- consumers: each reader yields (ids, payload) per batch ---------------------------------------


def touch(kind: str, ids: Any, payload: Any) -> tuple[np.ndarray, int]:
    """The consumer: image: one byte per page of every image and its id from its first 8 bytes;
    tab: the features' sum. Returns (ids, bytes)."""
    if kind == "image":
        out = np.empty(len(payload), np.int64)
        nbytes = 0
        for j, v in enumerate(payload):
            a = np.frombuffer(v, np.uint8)
            a[::4096].sum()
            out[j] = int.from_bytes(a[:8], "little")
            nbytes += len(a)
        return out, nbytes
    feats = np.asarray(payload)
    float(feats.sum())
    # A copy: views of a batch would hold its ring slot (and stall the stream) for the whole epoch.
    return np.array(ids, np.int64), feats.nbytes


def arrow_payload(kind: str, rb: Any) -> tuple[Any, Any]:
    """(ids, payload) from an Arrow record batch / table."""
    if kind == "image":
        return None, _binary_views(rb.column("image"))
    feats = np.column_stack([rb.column(f"f{k}").to_numpy() for k in range(8)])
    return rb.column("row_id").to_numpy(), feats


def warm_consumer(kind: str) -> None:
    """Runs the consumer once on a two-row batch before the clock: its first call imports what it
    uses (pyarrow's `to_numpy` imports pandas, 0.4 s), a cost of the consumer, not of the reader
    being measured. `import pyarrow.dataset` and `import datasets` import pandas too, so without
    this only readers without them paid it, inside their epoch."""
    import pyarrow as pa

    if kind == "image":
        rb = pa.record_batch({"image": pa.array([bytes(8), bytes(16)], pa.binary())})
    else:
        rb = pa.record_batch(
            {"row_id": pa.array([0, 1], pa.int64()), **{f"f{k}": pa.array([0.0, 1.0], pa.float32()) for k in range(8)}}
        )
    touch(kind, *arrow_payload(kind, rb))


#: An Arrow binary view: length, first 4 bytes, buffer index, offset (values of up to 12 bytes
#: lie in the view itself, from byte 4).
VIEW = np.dtype([("len", "<i4"), ("pre", "S4"), ("buf", "<i4"), ("off", "<i4")])


def _binary_views(col: Any) -> list[memoryview]:
    import pyarrow as pa

    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out: list[memoryview] = []
    for c in chunks:
        bufs = c.buffers()
        if pa.types.is_binary_view(c.type):
            # Images are never 12 bytes or less: every value lies in a data buffer.
            v = np.frombuffer(bufs[1], VIEW, count=len(c), offset=c.offset * 16)
            data = [memoryview(b) for b in bufs[2:]]
            out.extend(
                data[b][o : o + n]
                for n, b, o in zip(v["len"].tolist(), v["buf"].tolist(), v["off"].tolist(), strict=True)
            )
            continue
        wide = pa.types.is_large_binary(c.type)
        offs = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[c.offset : c.offset + len(c) + 1]
        mv = memoryview(bufs[2])
        out.extend(mv[a:z] for a, z in zip(offs[:-1].tolist(), offs[1:].tolist(), strict=True))
    return out


def columns(kind: str) -> list[str]:
    return ["image", "label"] if kind == "image" else ["row_id", *(f"f{k}" for k in range(8)), "label"]


def read_pa_seq(kind: str, d: Path, _: dict) -> Iterator[tuple[Any, Any]]:
    import pyarrow.dataset as pads

    for rb in pads.dataset(files(d), format="parquet").to_batches(columns=columns(kind), batch_size=BATCH):
        yield arrow_payload(kind, rb)


def read_pa_shuffle(kind: str, d: Path, _: dict) -> Iterator[tuple[Any, Any]]:
    import pyarrow as pa
    import pyarrow.dataset as pads

    rng = np.random.default_rng(SEED)
    frags = [rg for f in pads.dataset(files(d), format="parquet").get_fragments() for rg in f.split_by_row_group()]
    rng.shuffle(frags)
    buf: list[Any] = []
    held = 0

    def drain(keep: int) -> Iterator[tuple[Any, Any]]:
        nonlocal buf, held
        t = pa.Table.from_batches(buf).combine_chunks()
        perm = rng.permutation(t.num_rows)
        out, rest = perm[: t.num_rows - keep], perm[t.num_rows - keep :]
        for s in range(0, len(out), BATCH):
            yield arrow_payload(kind, t.take(out[s : s + BATCH]))
        buf = [t.take(rest).combine_chunks().to_batches()[0]] if keep else []
        held = keep

    for frag in frags:
        for rb in frag.to_batches(columns=columns(kind)):
            buf.append(rb)
            held += rb.num_rows
        if held >= BUFFER:
            yield from drain(BUFFER // 2)
    if held:
        yield from drain(0)


def read_hf_stream(kind: str, d: Path, _: dict) -> Iterator[tuple[Any, Any]]:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=files(d), split="train", streaming=True, columns=columns(kind))
    ds = ds.shuffle(seed=SEED, buffer_size=BUFFER)
    for b in ds.iter(batch_size=BATCH):
        if kind == "image":
            yield None, b["image"]
        else:
            yield b["row_id"], np.column_stack([b[f"f{k}"] for k in range(8)])


def read_hf_map(kind: str, d: Path, prep: dict) -> Iterator[tuple[Any, Any]]:
    import datasets

    cache = tempfile.mkdtemp(prefix="hfmap-", dir=os.environ.get("PQ_BENCH_TMP"))
    try:
        t0 = time.perf_counter()
        ds = datasets.load_dataset("parquet", data_files=files(d), split="train", cache_dir=cache)
        ds = ds.select_columns(columns(kind)).shuffle(seed=SEED).with_format("arrow")
        prep["prep_s"] = time.perf_counter() - t0
        prep["t0"], prep["cpu0"] = time.perf_counter(), time.process_time()
        for t in ds.iter(batch_size=BATCH):
            yield arrow_payload(kind, t)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def read_floor(kind: str, d: Path, prep: dict, views: bool = False) -> Iterator[tuple[Any, Any]]:
    """Not a reader: every batch of a shuffled epoch built in memory before the clock (its prep),
    so the epoch is the consumer alone. No loader feeding this process can beat it: it bounds
    what any ratio to another reader can be with this consumer on this machine. With `views`
    the image column is `binary_view`, as `binary_views=True` delivers it (the consumer reads
    views another way than offsets)."""
    import pyarrow as pa
    import pyarrow.dataset as pads

    t0 = time.perf_counter()
    table = pads.dataset(files(d), format="parquet").to_table(columns=columns(kind)).combine_chunks()
    perm = np.random.default_rng(SEED).permutation(table.num_rows)
    batches = [table.take(perm[s : s + BATCH]).to_batches()[0] for s in range(0, table.num_rows, BATCH)]
    del table
    if views:
        # After `take`, which has no kernel for views (pyarrow 26).
        i = batches[0].schema.get_field_index("image")
        batches = [rb.set_column(i, "image", rb.column(i).cast(pa.binary_view())) for rb in batches]
    prep["prep_s"] = time.perf_counter() - t0
    prep["t0"], prep["cpu0"] = time.perf_counter(), time.process_time()
    for rb in batches:
        yield arrow_payload(kind, rb)


def read_litdata_pq(kind: str, d: Path, prep: dict) -> Iterator[tuple[Any, Any]]:
    import litdata as ld
    from litdata.streaming.item_loader import ParquetLoader

    t0 = time.perf_counter()
    if not (d / "index.json").exists():
        ld.index_parquet_dataset(str(d))
    cache = tempfile.mkdtemp(prefix="litdata-", dir=os.environ.get("PQ_BENCH_TMP"))
    try:
        ds = ld.StreamingDataset(str(d), item_loader=ParquetLoader(), shuffle=True, seed=SEED, cache_dir=cache)
        prep["prep_s"] = time.perf_counter() - t0
        prep["t0"], prep["cpu0"] = time.perf_counter(), time.process_time()
        names = columns(kind)
        rows: list[Any] = []
        for item in ds:
            rows.append(item)
            if len(rows) == BATCH:
                yield _litdata_batch(kind, names, rows)
                rows = []
        if rows:
            yield _litdata_batch(kind, names, rows)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _litdata_batch(kind: str, names: list[str], rows: list[Any]) -> tuple[Any, Any]:
    get = (lambda r, c: r[c]) if isinstance(rows[0], dict) else (lambda r, c: r[names.index(c)])
    if kind == "image":
        return None, [get(r, "image") for r in rows]
    return [get(r, "row_id") for r in rows], np.array([[get(r, f"f{k}") for k in range(8)] for r in rows])


def read_ss(kind: str, d: Path, prep: dict, form: str, views: bool = False) -> Iterator[tuple[Any, Any]]:
    import shardstream

    loader = shardstream.Loader(
        str(d),
        batch_size=BATCH,
        seed=prep.get("seed", int(os.environ.get("PQ_BENCH_SEED", SEED))),
        connect=prep["addr"],
        transport="shm",
        fields=columns(kind),
        format=form,
        **({"binary_views": True} if views else {}),
        **({"cache": prep["cache"]} if "cache" in prep else {}),
    )
    for b in loader:
        if form == "arrow":
            yield arrow_payload(kind, b)
        elif kind == "image":
            yield None, b["image"]
        else:
            yield b["row_id"], np.column_stack([b[f"f{k}"] for k in range(8)])


READERS: dict[str, Any] = {
    "pa_seq": read_pa_seq,
    "pa_shuffle": read_pa_shuffle,
    "hf_stream": read_hf_stream,
    "hf_map": read_hf_map,
    "litdata_pq": read_litdata_pq,
    "floor": read_floor,
    "floor_views": lambda k, d, p: read_floor(k, d, p, views=True),
    "ss_dict": lambda k, d, p: read_ss(k, d, p, "dict"),
    "ss_arrow": lambda k, d, p: read_ss(k, d, p, "arrow"),
    "ss_views": lambda k, d, p: read_ss(k, d, p, "arrow", views=True),
}


def span(ids: np.ndarray) -> float:
    """Median over blocks of 100 consecutive stored rows of how far apart they are delivered."""
    n = len(ids)
    if n < 200:
        return float("nan")
    pos = np.empty(n, np.int64)
    pos[ids] = np.arange(n)
    starts = np.linspace(0, n - 100, 64).astype(np.int64)
    return float(np.median([(pos[s : s + 100].max() - pos[s : s + 100].min()) / n for s in starts]))


IMPORTS = {
    "pa_seq": ["pyarrow.dataset"],
    "pa_shuffle": ["pyarrow.dataset"],
    "hf_stream": ["datasets"],
    "hf_map": ["datasets"],
    "litdata_pq": ["litdata", "litdata.streaming.item_loader"],
    "floor": ["pyarrow.dataset"],
    "floor_views": ["pyarrow.dataset"],
    "ss_dict": ["shardstream", "shardstream._arrow", "pyarrow"],
    "ss_arrow": ["shardstream", "shardstream._arrow", "pyarrow"],
    "ss_views": ["shardstream", "shardstream._arrow", "pyarrow"],
}


def applies(peer: str, kind: str) -> bool:
    """Whether `peer` reads the `kind` set: `binary_views` needs a binary column (image only)."""
    return kind == "image" or not reader_of(peer).startswith(("ss_views", "floor_views"))


def kept_row_groups(addr: str) -> int:
    """Row groups the daemon at `addr` keeps decoded in its node cache."""
    import shardstream

    return int(shardstream._native.Connection(addr).status()["cache"]["decoded_row_groups"])


def reader_of(peer: str) -> str:
    """The reader a peer runs: `ss_arrow@before` is `ss_arrow` of the build named `before`,
    `ss_arrow+warm` is `ss_arrow` after a first epoch."""
    base = peer.partition("@")[0].removesuffix(PROC)
    base = base.removesuffix(WARM).removesuffix(KEPT).removesuffix(NODE).removesuffix(NOKEEP)
    return base.removesuffix(COPY)


def record_self() -> subprocess.Popen[bytes] | None:
    """`perf record -g` of this process into `$PQ_BENCH_PERF` (parquet_profile.py `--client`),
    from the first batch on: the reader's imports and a peer's prep stay out of the profile."""
    out = os.environ.get("PQ_BENCH_PERF")
    if not out:
        return None
    cmd = ["perf", "record", "-g", "-F", "999", "-o", out, "-p", str(os.getpid())]
    recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)  # perf attaches before the batches it is meant to see
    return recorder


def run_one(peer: str, kind: str, d: Path, addr: str, rows: int) -> dict:
    """One epoch of one reader in this process; returns its figures. The reader's modules are
    imported before the clock starts (a trainer has imported them long before its first epoch)."""
    import importlib

    prep: dict[str, Any] = {"addr": addr}
    if COPY in peer:
        prep["cache"] = "copy"
    first_in_process = PROC in peer
    peer = reader_of(peer)
    # torch too: a trainer has it loaded, and `datasets` imports it lazily in the middle of an epoch.
    for module in ["torch", *IMPORTS[peer]]:
        importlib.import_module(module)
    warm_consumer(kind)
    daemon = int(os.environ.get("PQ_BENCH_DAEMON_PID", "0")) or None
    if first_in_process:
        seed = int(os.environ.get("PQ_BENCH_SEED", SEED))
        for raw_ids, payload in READERS[peer](kind, d, {**prep, "seed": seed + 1000}):
            touch(kind, raw_ids, payload)
    import measure

    # `+proc`: the daemon's CPU of the measured epoch only (the parent's figure, around the whole
    # child, would hold the first epoch too).
    daemon_cpu0 = measure.cpu_seconds(daemon) if daemon and first_in_process else None
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    ttfb = None
    ids: list[np.ndarray] = []
    nbytes = 0
    recorder = None
    for raw_ids, payload in READERS[peer](kind, d, prep):
        if ttfb is None:
            ttfb = time.perf_counter() - prep.get("t0", t0)
            recorder = record_self()
        got, b = touch(kind, raw_ids, payload)
        ids.append(got)
        nbytes += b
    seconds = time.perf_counter() - prep.get("t0", t0)
    cpu = time.process_time() - prep.get("cpu0", cpu0)
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=120)
    daemon_cpu1 = measure.cpu_seconds(daemon) if daemon_cpu0 is not None else None
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    counts = np.bincount(all_ids[(all_ids >= 0) & (all_ids < rows)], minlength=rows)
    ok = len(all_ids) == rows and bool((counts == 1).all())
    return {
        "rows": int(len(all_ids)),
        "seconds": seconds,
        "rows_per_s": len(all_ids) / seconds if seconds else 0.0,
        "cpu_s": cpu,
        "ttfb_s": ttfb,
        "prep_s": prep.get("prep_s"),
        "check": "ok" if ok else f"MISMATCH ({len(all_ids)} rows, {int((counts == 0).sum())} missing)",
        "span": span(all_ids) if ok else float("nan"),
        "gb": nbytes / 1e9,
        # Other jobs share the machine: a figure taken under load is not comparable to a quiet one.
        "load": load,
        "daemon_cpu_s": daemon_cpu1 - daemon_cpu0 if daemon_cpu0 is not None and daemon_cpu1 is not None else None,
    }


# -- driver ---------------------------------------------------------------------------------------


def child(
    peer: str,
    kind: str,
    d: Path,
    addr: str,
    rows: int,
    daemon_pid: int | None,
    site: str | None = None,
    seed: int = SEED,
) -> dict:
    import daemon as bench_daemon
    import measure

    before = measure.cpu_seconds(daemon_pid) if daemon_pid else None
    # No Hub traffic: `datasets` otherwise reports each load to the Hub (seconds when offline).
    env = {
        **bench_daemon.env_for(site),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PQ_BENCH_SEED": str(seed),
        "PQ_BENCH_DAEMON_PID": str(daemon_pid or 0),
    }
    p = subprocess.run(
        [sys.executable, __file__, "--one", peer, kind, str(d), addr, str(rows)],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
    )
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": tail[0][:200]}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if before is not None:
        after = measure.cpu_seconds(daemon_pid) or before
        # A `+proc` child's own figure covers its measured epoch only; this one, the whole child.
        if r.get("daemon_cpu_s") is None:
            r["daemon_cpu_s"] = after - before
        r["cpu_s"] += r["daemon_cpu_s"]
    else:
        r.pop("daemon_cpu_s", None)
    return r


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- S3: bytes and requests per epoch --------------------------------------------------------------


def chunk_bytes(d: Path, fields: list[str]) -> int:
    """Bytes of the column chunks of `fields` in every file of `d` (from the footers)."""
    import pyarrow.parquet as pq

    total = 0
    for f in files(d):
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                if col.path_in_schema.split(".")[0] in fields:
                    total += col.total_compressed_size
    return total


def s3_epoch(
    addr: str, url: str, kind: str, fields: list[str], rows: int, seed: int = SEED, views: bool = False
) -> dict:
    """One epoch of shardstream over S3 (Arrow form, with `binary_views` when `views`): rows/s,
    the first batch and the daemon's storage counters."""
    import shardstream

    conn = shardstream._native.Connection(addr)
    before = conn.status()
    t0 = time.perf_counter()
    n, ttfb = 0, None
    for rb in shardstream.Loader(
        url,
        batch_size=BATCH,
        seed=seed,
        connect=addr,
        transport="shm",
        fields=fields,
        format="arrow",
        **({"binary_views": True} if views else {}),
    ):
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        n += rb.num_rows
    seconds = time.perf_counter() - t0
    after = conn.status()
    return {
        "rows": n,
        "check": "ok" if n == rows else f"MISMATCH ({n} rows)",
        "rows_per_s": n / seconds if seconds else 0.0,
        "ttfb_s": ttfb,
        "bytes": after["storage_bytes"] - before["storage_bytes"],
        "requests": after["storage_requests"] - before["storage_requests"],
    }


def run_s3(kinds: list[str], data: dict[str, Path], rows: dict[str, int], work: Path, s3_root: Path) -> list[dict]:
    """Per dataset: the index run's figures, then one epoch with all fields and with `label`. The
    bucket lives in `s3_root` (next to the data, so the files are hard links, not copies; removed
    at the end)."""
    import daemon as bench_daemon
    from s3server import S3Server

    server = S3Server(s3_root).start()
    out: list[dict] = []
    try:
        for kind in kinds:
            bucket = server.bucket("bench") / kind
            bucket.mkdir(parents=True, exist_ok=True)
            for f in files(data[kind]):
                dst = bucket / Path(f).name
                try:
                    os.link(f, dst)
                except OSError:
                    shutil.copyfile(f, dst)
            url = f"s3://bench/{kind}/"
            size = sum(Path(f).stat().st_size for f in files(data[kind]))
            t0 = time.perf_counter()
            p = subprocess.run(
                [str(bench_daemon.executable()), "index", url],
                env={**os.environ, **server.env()},
                capture_output=True,
                text=True,
                timeout=3600,
            )
            index_s = time.perf_counter() - t0
            if p.returncode != 0:
                out.append({"kind": kind, "what": "index", "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
                continue
            line = next((x for x in p.stdout.splitlines() if x.startswith("s3:")), "s3: ? requests, ? bytes")
            req, got = (w for w in line.replace(",", "").split() if w.isdigit() or w == "?")
            out.append(
                {
                    "kind": kind,
                    "what": "index",
                    "files": len(files(data[kind])),
                    "size": size,
                    "selected": None,
                    "bytes": int(got) if got.isdigit() else None,
                    "requests": int(req) if req.isdigit() else None,
                    "seconds": index_s,
                }
            )
            every = columns(kind) + (["caption"] if kind == "image" else [])
            for name, fields in (("all fields", every), ("label", ["label"])):
                wd = work / f"d-{kind}-{len(out)}"
                wd.mkdir()
                d = bench_daemon.Daemon.start(wd, env=server.env())
                runs: list[tuple[str, dict]] = []
                try:
                    runs.append((f"epoch, {name}", s3_epoch(d.addr, url, kind, fields, rows[kind])))
                    if name == "all fields":
                        # The next epoch on the same daemon, from its node cache: as a trainer's
                        # second epoch (images with `binary_views`).
                        views = kind == "image"
                        again = s3_epoch(d.addr, url, kind, fields, rows[kind], seed=SEED + 1, views=views)
                        runs.append((f"epoch 2, {name}{', binary_views' if views else ''}", again))
                except Exception as e:  # noqa: BLE001 - reported in the table, the bench goes on
                    runs.append((f"epoch, {name}", {"error": str(e).splitlines()[0][:200]}))
                finally:
                    d.stop()
                    shutil.rmtree(wd, ignore_errors=True)
                for what, r in runs:
                    r.update(kind=kind, what=what, files=len(files(data[kind])), size=size)
                    r["selected"] = chunk_bytes(data[kind], fields)
                    out.append(r)
                    print(f"s3 {kind} {what}: {r}", file=sys.stderr)
    finally:
        server.stop()
        shutil.rmtree(s3_root, ignore_errors=True)
    return out


def s3_report(rows: list[dict]) -> str:
    lines = [
        "## S3 (local s3s-fs server): bytes downloaded and requests",
        "",
        "`index`: `shardstream index s3://...` (footers only). `epoch`: one shardstream epoch "
        "(Arrow form, shm) through a fresh daemon and node cache, the dataset's open included. "
        "`selected`: bytes of the selected columns' chunks. A stream whose columns are under 90% of the "
        "bytes fetches only their chunks (merged ranged GETs, one cache entry per file), plus one "
        "footer check per file; with all fields whole files go through the node cache.",
        "",
        "| dataset | run | files | dataset MB | selected chunks MB | downloaded MB | x selected | requests "
        "| rows/s | first batch s | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['what']} | not run: {r['error']} | | | | | | | | |")
            continue
        ttfb = r.get("ttfb_s")
        ttfb_s = "-" if ttfb is None else f"{ttfb:.2f}"
        sel, got, rps = r.get("selected"), r.get("bytes"), r.get("rows_per_s")
        ratio = f"{got / sel:.1f}" if sel and got is not None else "-"
        sel_mb = "-" if sel is None else f"{sel / 1e6:,.1f}"
        got_mb = "-" if got is None else f"{got / 1e6:,.3f}"
        rps_s = "-" if rps is None else f"{rps:,.0f}"
        lines.append(
            f"| {r['kind']} | {r['what']} | {r['files']} | {r['size'] / 1e6:,.1f} | {sel_mb} | {got_mb} | "
            f"{ratio} | {r.get('requests', '-')} | {rps_s} | {ttfb_s} | {r.get('check', '-')} |"
        )
    return "\n".join(lines) + "\n"


def repeat_ratios(runs: list[dict], to: list[dict]) -> list[float]:
    """`runs`' rows/s over `to`'s, repeat by repeat (the lists are in repeat order); a repeat where
    either failed has no ratio."""
    return [
        r["rows_per_s"] / t["rows_per_s"]
        for r, t in zip(runs, to, strict=True)
        if "error" not in r and "error" not in t and t["rows_per_s"]
    ]


def ratio_cell(ratios: list[float]) -> str:
    """Median (min-max) of per-repeat ratios: a ratio the machine's swings between repeats cannot
    make up, where a ratio of medians may pair one repeat's fast peer with another's slow reader."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report(results: dict[str, dict[str, list[dict]]], meta: dict) -> str:
    repeats = meta["repeats"]
    counts = sorted(set(repeats.values()))
    said = (
        f"{counts[0]} interleaved repeats"
        if len(counts) == 1
        else "interleaved repeats (" + ", ".join(f"{k} {n}" for k, n in repeats.items()) + ")"
    )
    lines = [
        "# Parquet: shardstream vs the readers a user would pick instead",
        "",
        "Generated by `bench/parquet_bench.py` (`make bench`). One shuffled epoch per reader and repeat, "
        f"{said}, each reader in a fresh process; batch {BATCH}, shuffle "
        f"buffers {BUFFER} rows. Machine: {meta['machine']}. Daemon peak RSS (largest over its runs; a fresh "
        f"daemon per shardstream run): {meta['daemon_rss_mib']:.0f} MiB. Image files written "
        f"{meta['layout']} ({LAYOUTS[meta['layout']]}). `+copy`: read through the node cache "
        '(`cache="copy"`), its first epoch copying the files there. `+proc`: the second epoch of one '
        "process (its first, untimed, in the same process).",
        "",
        "rows/s: median (min-max). `x best shuffled peer`, `x pa_seq`: the reader's rows/s over the peer's "
        "within each repeat, median (min-max) of those. CPU-s: the reader's process plus, for shardstream, "
        "the daemon's, per "
        "epoch. `span`: 100 consecutive stored rows, how far apart delivered (fraction of the epoch; "
        "uniform ~0.98, file order ~0). `load`: the 1-minute load average when the run started (the "
        "machine is shared; compare rows taken at similar load). `rows/s counting prep`: the rows over the "
        "epoch's and the prep's seconds, a user's first epoch ever where a reader first converts or indexes "
        "the files. `floor`: the consumer alone over batches built before its clock, the most any reader "
        "can reach here (not a peer).",
        "",
    ]
    for kind, per_peer in results.items():
        lines += [f"## {kind} ({meta['rows'][kind]:,} rows)", ""]
        med = {}
        for peer, runs in per_peer.items():
            good = [r for r in runs if "error" not in r]
            if good:
                med[peer] = statistics.median(r["rows_per_s"] for r in good)
        shuffled = [p for p in med if p != "pa_seq" and not p.startswith(("ss_", "floor"))]
        best = max(shuffled, key=lambda p: med[p]) if shuffled else None
        lines += [
            f"best shuffled peer: {best or '-'}; ceiling: pa_seq",
            "",
            "| reader | rows/s | x best shuffled peer | x pa_seq | CPU-s / epoch | first batch s | prep s | rows/s "
            "counting prep | span | load | check |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for peer, runs in per_peer.items():
            good = [r for r in runs if "error" not in r]
            if not good:
                lines.append(f"| {peer} | not run: {runs[0].get('error', '?')} | | | | | | | | | |")
                continue
            rps = [r["rows_per_s"] for r in good]

            def m(key: str, rs: list[dict] = good) -> str:
                vals = [r[key] for r in rs if r.get(key) is not None]
                return f"{statistics.median(vals):.2f}" if vals else "-"

            x_best = ratio_cell(repeat_ratios(runs, per_peer[best])) if best else "-"
            x_seq = ratio_cell(repeat_ratios(runs, per_peer["pa_seq"])) if "pa_seq" in med else "-"
            checks = {r["check"] for r in good}
            # A first epoch ever: the conversion or index a reader needs before it (hf_map's Arrow
            # copy, litdata_pq's index) counted in, as a user's first run pays it.
            with_prep = [r["rows"] / (r["seconds"] + r["prep_s"]) for r in good if r.get("prep_s") is not None]
            counting = f"{statistics.median(with_prep):,.0f}" if with_prep else "-"
            lines.append(
                f"| {peer} | {med[peer]:,.0f} ({min(rps):,.0f}-{max(rps):,.0f}) | {x_best} | {x_seq} | "
                f"{m('cpu_s')} | {m('ttfb_s')} | {m('prep_s')} | {counting} | {m('span')} | {m('load')} | "
                f"{', '.join(sorted(checks))} |"
            )
        lines.append("")
        for peer, runs in per_peer.items():
            before = sorted(r["epochs_before"] for r in runs if "epochs_before" in r)
            if before:
                n = f"{before[0]}" if before[0] == before[-1] else f"{before[0]}-{before[-1]}"
                lines += [f"`{peer}`: measured after {n} epochs on its daemon.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    from daemon import variant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/PARQUET_RESULTS.md")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data/parquet")
    ap.add_argument("--image-rows", type=int, default=100_000)
    ap.add_argument("--tab-rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tab-repeats", type=int, help="repeats of the tab set (default: 3 x --repeats)")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--datasets", default="image,tab")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="snappy", help="how the image set's files are written")
    ap.add_argument("--no-s3", action="store_true", help="leave out the S3 bytes-and-requests section")
    ap.add_argument(
        "--variant", action="append", default=[], type=variant, help="NAME=SITE: another build, measured alongside"
    )
    ap.add_argument("--one", nargs=5, metavar=("PEER", "KIND", "DIR", "ADDR", "ROWS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        peer, kind, d, addr, rows = args.one
        print(json.dumps(run_one(peer, kind, Path(d), addr, int(rows))))
        return

    import daemon as bench_daemon
    import measure

    kinds = args.datasets.split(",")
    rows = {"image": args.image_rows, "tab": args.tab_rows}
    repeats = {"image": args.repeats, "tab": args.tab_repeats or 3 * args.repeats}
    dirs = {
        "image": lambda: make_image(
            args.data / f"image-{args.image_rows}{'' if args.layout == 'snappy' else '-' + args.layout}",
            args.image_rows,
            args.layout,
        ),
        "tab": lambda: make_tab(args.data / f"tab-{args.tab_rows}", args.tab_rows),
    }
    data = {k: dirs[k]() for k in kinds}
    peers = args.peers.split(",")
    sites: dict[str, str] = {}
    # Each variant repeats this build's readers, not another variant's.
    ours = [p for p in peers if p.startswith("ss_")]
    for name, site in args.variant:
        for peer in ours:
            peers.append(f"{peer}@{name}")
            sites[f"{peer}@{name}"] = site
    work = Path(tempfile.mkdtemp(prefix="pq-bench-"))
    results: dict[str, dict[str, list[dict]]] = {k: {p: [] for p in peers if applies(p, k)} for k in kinds}
    rss = 0.0
    try:
        for rep in range(max(repeats[k] for k in kinds)):
            for kind in [k for k in kinds if rep < repeats[k]]:
                for peer in results[kind]:
                    # A fresh daemon per shardstream epoch: its cache of decoded row groups would
                    # otherwise hand the next shardstream reader an epoch already decoded, which
                    # no peer gets (the page cache is warm for everyone alike).
                    d = None
                    if peer.startswith("ss_"):
                        (work / f"{rep}-{kind}-{peer}").mkdir()
                        env = {"SHARDSTREAM_NO_KEEP_DECODED": "true"} if NOKEEP in peer else None
                        d = bench_daemon.Daemon.start(work / f"{rep}-{kind}-{peer}", env=env, site=sites.get(peer))
                    try:
                        addr, pid = (d.addr, d.pid) if d else ("", None)
                        before = MAX_KEPT_EPOCHS if KEPT in peer else 1 if WARM in peer or NODE in peer else 0
                        kept, e = -1, 0
                        while e < before:
                            first = child(
                                peer, kind, data[kind], addr, rows[kind], pid, sites.get(peer), seed=SEED + 1 + e
                            )
                            e += 1
                            if "error" in first:
                                raise RuntimeError(f"{peer}: epoch {e} before failed: {first['error']}")
                            if KEPT in peer:
                                now = kept_row_groups(addr)
                                if now == kept:
                                    break
                                kept = now
                        if d and NODE in peer:
                            if d.stop() != 0:
                                raise RuntimeError(f"{peer}: the first daemon did not stop cleanly: {d.log_tail()}")
                            d = bench_daemon.Daemon.start(work / f"{rep}-{kind}-{peer}", site=sites.get(peer))
                            addr, pid = d.addr, d.pid
                        r = child(peer, kind, data[kind], addr, rows[kind], pid, sites.get(peer))
                        if KEPT in peer:
                            r["epochs_before"] = e
                        if d:
                            r["daemon_rss_mib"] = peak_rss_mib(d.pid)
                            rss = max(rss, r["daemon_rss_mib"])
                    finally:
                        if d:
                            d.stop()
                            # Its node cache (the row groups it kept: as large as the data set)
                            # goes now: left in the page cache, every run's copies would make the
                            # later runs pay for reclaiming memory (and writing them back).
                            shutil.rmtree(work / f"{rep}-{kind}-{peer}", ignore_errors=True)
                    results[kind][peer].append(r)
                    print(f"[{rep}] {kind} {peer}: {r}", file=sys.stderr)
        s3_rows = [] if args.no_s3 else run_s3(kinds, data, rows, work, args.data / f".s3-{os.getpid()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine = measure.machine()
    meta = {
        "repeats": {k: repeats[k] for k in kinds},
        "machine": ", ".join(f"{k} {v}" for k, v in machine.items()),
        "daemon_rss_mib": rss,
        "rows": rows,
        "layout": args.layout,
    }
    text = report(results, meta)
    if s3_rows:
        text += "\n" + s3_report(s3_rows)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
