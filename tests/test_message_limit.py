"""The inline transport's message-size limit: it applies to inline streams only (over shared
memory no sample byte enters a message), it is checked against the batches a stream can really
hold, and a single sample too large for any message is refused when the stream opens, naming the
sample, instead of failing mid-epoch."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

import shardstream
from conftest import SHARDSTREAM, Daemon

MIB = 1 << 20
# The daemon's inline message limit (shardstream_proto::MAX_MESSAGE_BYTES).
LIMIT = 512 * MIB


@pytest.fixture(scope="module")
def big_samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four samples of 1 MiB: with batch_size 1000 the average-based estimate is ~1 GB per batch,
    but no batch can hold more than the four samples there are."""
    root = tmp_path_factory.mktemp("big")
    with wds.ShardWriter(str(root / "big-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(4):
            sink.write({"__key__": f"b{i}", "bin": bytes([i]) * MIB})
    return root


@pytest.fixture(scope="module")
def outlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many small samples and one larger than any message: the average is tiny."""
    root = tmp_path_factory.mktemp("outlier")
    with wds.ShardWriter(str(root / "o-%06d.tar"), maxcount=1000, verbose=0) as sink:
        for i in range(3000):
            sink.write({"__key__": f"s{i:05d}", "bin": b"x" * 100})
    _write_sparse_sample(root / "o-000003.tar", "huge", "bin", LIMIT + MIB)
    return root


def _write_sparse_sample(shard: Path, key: str, ext: str, size: int) -> None:
    """A one-sample TAR shard whose payload of zeros is a hole: a valid archive (`tar tvf` lists
    it, reads give zeros) that takes no disk. Writing half a GiB of real zeros per test run is
    what once filled a nearly full CI disk."""
    info = tarfile.TarInfo(f"{key}.{ext}")
    info.size, info.mode, info.mtime = size, 0o444, 0
    with open(shard, "wb") as f:
        f.write(info.tobuf(format=tarfile.PAX_FORMAT))
        f.seek(size + (-size % tarfile.BLOCKSIZE), os.SEEK_CUR)
        f.write(b"\0" * (2 * tarfile.BLOCKSIZE))


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_limit_is_checked_against_real_batches(daemon, big_samples: Path, transport: str) -> None:
    loader = shardstream.Loader(str(big_samples), batch_size=1000, transport=transport, connect=daemon.addr)
    batches = list(loader)
    assert len(batches) == 1 and len(batches[0]["__key__"]) == 4
    assert sorted(bytes(v)[:1] for v in batches[0]["bin"]) == [bytes([i]) for i in range(4)]
    assert loader.stats()["transport"] == transport


def test_shm_streams_are_not_limited(daemon, outlier: Path) -> None:
    loader = shardstream.Loader(str(outlier), batch_size=64, shuffle=False, transport="shm", connect=daemon.addr)
    sizes = {}
    for batch in loader:
        for key, v in zip(batch["__key__"], batch["bin"], strict=True):
            sizes[key] = len(v)
        batch.release()
    assert sizes["huge"] == LIMIT + MIB and len(sizes) == 3001


def test_inline_outlier_is_refused_at_open_naming_it(daemon, outlier: Path) -> None:
    loader = shardstream.Loader(str(outlier), batch_size=64, shuffle=False, transport="inline", connect=daemon.addr)
    with pytest.raises(ValueError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "o-000003.tar" in msg and "sample" in msg and "shm" in msg, msg


def _linked_copy(src: Path, dst: Path) -> Path:
    """The shards of `src` hard-linked into `dst`: a dataset of its own (its own manifest) for
    no extra disk."""
    dst.mkdir()
    for shard in sorted(src.glob("*.tar")):
        os.link(shard, dst / shard.name)
    return dst


@pytest.fixture(scope="module")
def indexed_outlier(tmp_path_factory: pytest.TempPathFactory, outlier: Path) -> Path:
    """The outlier dataset with a manifest written by `shardstream index`: shard tables are then
    not scanned when the dataset opens."""
    root = _linked_copy(outlier, tmp_path_factory.mktemp("indexed") / "ds")
    subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True, timeout=300)
    return root


def test_inline_outlier_in_a_manifest_dataset_is_refused_at_open(daemon, indexed_outlier: Path) -> None:
    manifest = json.loads((indexed_outlier / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["name"] == "o-000003.tar")
    assert entry["max_sample"] == 0 and entry["max_sample_bytes"] > LIMIT, entry
    loader = shardstream.Loader(
        str(indexed_outlier), batch_size=64, shuffle=False, transport="inline", connect=daemon.addr
    )
    delivered = []
    with pytest.raises(ValueError) as err:
        for batch in loader:
            delivered.append(batch)
    assert delivered == [], "the stream started: the outlier was only found mid-epoch"
    msg = str(err.value)
    assert "o-000003.tar" in msg and "sample 0" in msg and "shm" in msg, msg


def test_old_manifest_outlier_fails_mid_epoch_with_a_clear_error(daemon, tmp_path: Path, indexed_outlier: Path) -> None:
    """A manifest written before the largest sample was recorded: the check happens when the
    outlier's shard is first read, as a ValueError that names the sample and the way out."""
    root = _linked_copy(indexed_outlier, tmp_path / "old")
    (root / "_shardstream").mkdir()
    for idx in (indexed_outlier / "_shardstream").iterdir():
        os.link(idx, root / "_shardstream" / idx.name)
    manifest = json.loads((indexed_outlier / "manifest.json").read_text())
    for s in manifest["shards"]:
        s.pop("max_sample", None)
        s.pop("max_sample_bytes", None)
    (root / "manifest.json").write_text(json.dumps(manifest))
    loader = shardstream.Loader(str(root), batch_size=64, shuffle=False, transport="inline", connect=daemon.addr)
    delivered = 0
    with pytest.raises(ValueError) as err:
        for _ in loader:
            delivered += 1
    assert delivered > 0, "expected the old manifest's stream to start"
    msg = str(err.value)
    assert "o-000003.tar" in msg and "shm" in msg, msg


# The inline message limit of the `split_daemon`, lowered with the test knob so that batches of
# the session dataset (samples of up to ~3 KiB) need several messages each.
SPLIT_LIMIT = 16 << 10


@pytest.fixture(scope="module")
def split_daemon(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("split"), env={"SHARDSTREAM_INLINE_MESSAGE_BYTES": str(SPLIT_LIMIT)}).start()
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("fields", [None, ["json", "jpg"]])
def test_batch_beyond_the_message_limit_is_split_and_joined(split_daemon, dataset, fields) -> None:
    """Batches of ~150 KB under a 16 KiB message limit: each crosses in many parts and is joined
    whole, every sample once with its bytes, samples without a field (`json` on 9 in 10) still
    None at their own index; `fields` in another order than the shards' exercises the daemon's
    compaction of each part."""
    root, samples = dataset
    loader = shardstream.Loader(
        str(root), batch_size=100, shuffle=True, seed=5, transport="inline", fields=fields, connect=split_daemon.addr
    )
    wanted = fields or ["cls", "jpg", "json"]
    got: dict[str, dict[str, bytes | None]] = {}
    sizes = []
    for batch in loader:
        sizes.append(len(batch["__key__"]))
        for i, key in enumerate(batch["__key__"]):
            assert key not in got, f"{key} delivered twice"
            got[key] = {f: None if batch[f][i] is None else bytes(batch[f][i]) for f in wanted}
    assert loader.stats()["transport"] == "inline"
    assert sizes == [100] * 10 + [3]
    assert got == {k: {f: v.get(f) for f in wanted} for k, v in samples.items()}


def test_a_sample_beyond_a_lowered_limit_is_refused_by_name(split_daemon, tmp_path: Path) -> None:
    """One sample larger than any message is still refused when the stream opens, naming it: the
    limit the knob sets is the one the open-time check uses."""
    root = tmp_path / "ds"
    root.mkdir()
    with wds.ShardWriter(str(root / "k-%06d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(20):
            sink.write({"__key__": f"k{i:03d}", "bin": b"y" * (3 * SPLIT_LIMIT if i == 13 else 100)})
    loader = shardstream.Loader(str(root), batch_size=4, shuffle=False, transport="inline", connect=split_daemon.addr)
    with pytest.raises(ValueError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "k-000001.tar" in msg and "sample 3" in msg, msg


def test_a_parquet_row_beyond_the_limit_is_named_with_the_way_out(split_daemon, tmp_path: Path) -> None:
    """A single Parquet row larger than any message cannot be split: it is refused naming its
    file and row and the way out (it said only "use a smaller batch_size" once)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    for f in range(2):
        rows = [b"y" * (3 * SPLIT_LIMIT if f == 1 and i == 3 else 100) for i in range(10)]
        pq.write_table(pa.table({"v": pa.array(rows, pa.binary())}), root / f"p-{f}.parquet")
    for batch_size in (1, 4):
        loader = shardstream.Loader(
            str(root), batch_size=batch_size, shuffle=False, transport="inline", connect=split_daemon.addr
        )
        with pytest.raises(ValueError) as err:
            for _ in loader:
                pass
        msg = str(err.value)
        assert "row 3 of" in msg and "p-1.parquet" in msg and 'transport="shm"' in msg, (batch_size, msg)


def _mixed_parquet(root: Path, files: int, rows: int) -> dict[int, dict]:
    """Parquet files of several column kinds (binary of 0.1-1.2 KiB, strings with nulls,
    dictionary strings, lists of floats, a fixed-size token block, ints with nulls); returns each
    row's values by id as pyarrow reads them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    rng = np.random.default_rng(11)
    expected: dict[int, dict] = {}
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows)
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "blob": pa.array([rng.bytes(int(rng.integers(100, 1200))) for _ in ids], pa.binary()),
                "text": pa.array([None if i % 7 == 0 else f"row {i} " * int(i % 5 + 1) for i in ids], pa.string()),
                "tag": pa.array([f"tag{i % 3}" for i in ids]).dictionary_encode(),
                "vec": pa.array(
                    [rng.random(int(i % 4)).astype(np.float32).tolist() for i in ids], pa.list_(pa.float32())
                ),
                "tokens": pa.array([[int(i), int(i) + 1, int(i) + 2] for i in ids], pa.list_(pa.int32(), 3)),
                "maybe": pa.array([None if i % 5 == 0 else int(i) * 3 for i in ids], pa.int64()),
            }
        )
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=rows // 2)
        for row in pq.read_table(root / f"part-{f}.parquet").to_pylist():
            expected[row["id"]] = row
    return expected


@pytest.mark.parametrize("form", ["arrow", "dict"])
def test_a_parquet_batch_beyond_the_message_limit_is_split_and_joined(split_daemon, tmp_path: Path, form: str) -> None:
    """Parquet batches of ~60 KB under a 16 KiB message limit: each crosses in several parts
    (runs of whole rows, as TAR batches do) and arrives joined, one record batch of the asked
    size, every row once with the values pyarrow reads. Such a batch was refused ("a Parquet
    batch is one message"), so a remote trainer of large rows had to shrink its batch."""
    import numpy as np
    import pyarrow as pa

    expected = _mixed_parquet(tmp_path / "pq", files=3, rows=200)
    loader = shardstream.Loader(
        str(tmp_path / "pq"),
        batch_size=64,
        seed=3,
        transport="inline",
        connect=split_daemon.addr,
        format="arrow" if form == "arrow" else "dict",
    )
    sizes: list[int] = []
    got: dict[int, dict] = {}
    for batch in loader:
        if form == "arrow":
            assert isinstance(batch, pa.RecordBatch)
            assert batch.nbytes > SPLIT_LIMIT, batch.nbytes
            rows = batch.drop_columns([c for c in batch.schema.names if c.startswith("__")]).to_pylist()
        else:
            n = len(batch["__key__"])
            rows = [
                {
                    "id": int(batch["id"][i]),
                    "blob": bytes(batch["blob"][i]),
                    "text": batch["text"][i],
                    "tag": batch["tag"][i],
                    "vec": [float(x) for x in batch["vec"][i]],
                    "tokens": [int(x) for x in batch["tokens"][i]],
                    "maybe": None if batch["maybe"][i] is np.ma.masked else int(batch["maybe"][i]),
                }
                for i in range(n)
            ]
        sizes.append(len(rows))
        for row in rows:
            assert row["id"] not in got, f"row {row['id']} delivered twice"
            got[row["id"]] = row
    assert loader.stats()["transport"] == "inline"
    assert sizes == [64] * 9 + [24], sizes
    assert got.keys() == expected.keys()
    for i, row in got.items():
        want = expected[i]
        if form == "dict":
            want = {**want, "vec": [float(x) for x in want["vec"]]}
        assert row == want, i


def test_a_batch_split_over_messages_is_sent_as_it_is_read(tmp_path: Path) -> None:
    """A 160 MiB batch of 512 KiB samples under a 1 MiB message limit: the daemon sends each part as soon as it is
    made, so its memory grows by a few parts, not by the batch (a client's batch_size times its
    samples would otherwise be the daemon's memory, shared with every other client on the node)."""
    root = tmp_path / "ds"
    root.mkdir()
    blob = b"z" * (1 << 19)
    with wds.ShardWriter(str(root / "m-%06d.tar"), maxcount=40, verbose=0) as sink:
        for i in range(320):
            sink.write({"__key__": f"m{i:03d}", "bin": blob})
    d = Daemon(tmp_path / "d", env={"SHARDSTREAM_INLINE_MESSAGE_BYTES": str(1 << 20)}).start()
    try:
        assert d.proc is not None

        def peak_mib() -> float:
            status = Path(f"/proc/{d.proc.pid}/status").read_text()
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024

        loader = shardstream.Loader(str(root), batch_size=320, shuffle=False, transport="inline", connect=d.addr)
        it = iter(loader)
        before = peak_mib()
        batch = next(it)
        grew = peak_mib() - before
        assert len(batch["__key__"]) == 320 and all(len(v) == 1 << 19 for v in batch["bin"])
        assert grew < 48, f"the daemon's peak memory grew by {grew:.0f} MiB for one 160 MiB batch"
        del batch, it, loader
    finally:
        assert d.stop() == 0
