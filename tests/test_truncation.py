"""A shard of a dataset read in place (local or parallel file system) truncated by someone else
while a trainer uses it: the trainer gets `ShardError` naming the shard, and never dies of SIGBUS
(which a mapping of the file would give it). The trainer runs in a subprocess so that a SIGBUS
shows as its exit status instead of killing the test run. And one rewritten in place at its
length while a stream reads it: a `ShardError` too, never the new file's samples read at the
old index's offsets."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

# Inline, the daemon sends batches ahead of the trainer: up to the stream's HTTP/2 window (64 MiB,
# client/src/lib.rs) plus the client's queue. A dataset smaller than that may be sent whole before
# the truncation, and the epoch then ends without an error. At 3 x 100 samples of 400 KiB (117 MiB)
# at least ~40 MiB are read after it, whatever the timing.
SAMPLE_BYTES = 400 << 10


def write_large_dataset(root: Path) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(21)
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(300):
            payload = rng.integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes()
            sink.write({"__key__": f"s/{i:06d}", "jpg": payload, "cls": str(i % 7).encode()})


TRAINER = textwrap.dedent(
    """
    import json, os, sys, shardstream
    root, addr, transport, when = sys.argv[1:5]
    loader = shardstream.Loader(root, batch_size=4, shuffle=False, transport=transport, connect=addr)
    it = iter(loader)
    held = next(it)
    payload = [bytes(v) for v in held["jpg"]]
    def truncate():
        for name in sorted(os.listdir(root)):
            os.truncate(os.path.join(root, name), 1024)
    out = {"transport": loader.stats()["transport"]}
    truncate()
    if when == "held":
        # The batch taken before the truncation stays readable, and the same.
        out["held_ok"] = [bytes(v) for v in held["jpg"]] == payload
    try:
        for batch in it:
            for v in batch["jpg"]:
                bytes(v)
        out["error"] = None
    except shardstream.ShardError as e:
        out["error"] = "ShardError"
        out["message"] = str(e)
        out["shard"] = e.shard
    except Exception as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("when", ["held", "before_read"])
def test_truncated_shard_is_shard_error_not_sigbus(daemon, tmp_path: Path, transport: str, when: str) -> None:
    root = tmp_path / "ds"
    write_large_dataset(root)
    assert sum(f.stat().st_size for f in root.iterdir()) > 100 << 20
    r = subprocess.run(
        [sys.executable, "-c", TRAINER, str(root), daemon.addr, transport, when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != -signal.SIGBUS, "the trainer was killed by SIGBUS"
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["transport"] == transport
    assert out["error"] == "ShardError", out
    # Names the shard (which one depends on how far the daemon read ahead before the truncation).
    assert re.search(r"/ds/train-00000[0-2]\.tar", out["message"]), out
    assert out["shard"] and re.search(r"train-00000[0-2]\.tar$", out["shard"]), out
    if when == "held":
        assert out["held_ok"]


def write_equal_shards(root: Path, prefix: str, shards: int, seed: int, size: int = SAMPLE_BYTES) -> None:
    """`shards` WebDataset shards of 150 samples of `size` bytes, keys `<prefix>/NNNNNN`: shards of
    equal length whatever the prefix (one character) and the bytes."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=150, verbose=0) as sink:
        for i in range(150 * shards):
            payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            sink.write({"__key__": f"{prefix}/{i:06d}", "jpg": payload, "cls": b"3"})


def read_while_rewritten(
    loader, target: Path, replacement: bytes, check_first: Callable[[list[str]], bool] | None = None
) -> list[str]:
    """The keys `loader` delivers when `target` (whose keys start with "s/") is rewritten in
    place as `replacement` after the first batch: the epoch must end in a ShardError naming the
    file, none of the new file's samples delivered, none twice."""
    import shardstream

    it = iter(loader)
    keys = list(next(it)["__key__"])
    assert check_first is None or check_first(keys), keys
    inode = target.stat().st_ino
    with open(target, "r+b") as f:
        f.write(replacement)
    assert target.stat().st_ino == inode
    with pytest.raises(shardstream.ShardError) as e:
        for batch in it:
            keys.extend(batch["__key__"])
    assert "changed while a stream read it" in str(e.value), e.value
    assert e.value.shard and e.value.shard.endswith(target.name), e.value.shard
    assert not [k for k in keys if not k.startswith("s/")], "a sample of the rewritten file was delivered"
    assert len(keys) == len(set(keys))
    return keys


@pytest.mark.parametrize(("transport", "collate"), [("inline", None), ("shm", None), ("shm", "stack")])
def test_a_shard_rewritten_in_place_while_read_is_shard_error_not_other_samples(
    daemon, tmp_path: Path, transport: str, collate: str | None
) -> None:
    import shardstream

    root, other = tmp_path / "ds", tmp_path / "other"
    write_equal_shards(root, "s", 3, seed=5)
    write_equal_shards(other, "r", 1, seed=6)
    target, replacement = root / "train-000002.tar", (other / "train-000000.tar").read_bytes()
    assert target.stat().st_size == len(replacement)
    # Shuffled: the window holds all three shards, and a batch of 32 draws on each of them, so
    # the stream keeps each open (and checked against its listing, before the rewrite) from its
    # first batch on (a shard no batch draws on for a while is let go of, and checked again when
    # opened again). Inline, the daemon may have sent up to 64 MiB ahead: 5 of 14 batches.
    loader = shardstream.Loader(
        str(root), batch_size=32, shuffle=True, seed=0, transport=transport, collate=collate, connect=daemon.addr
    )
    # In place and never shorter (a truncation is the test above): every later read succeeds,
    # at the old index's offsets, in the other file's samples.
    keys = read_while_rewritten(loader, target, replacement, lambda first: any(k >= "s/000300" for k in first))
    assert len(keys) < 450

    # The next open lists the dataset again and reads the shard as it is now (in view mode the
    # trainer may have seen the change first: the open's look at the shards finds it then).
    again = shardstream.Loader(str(root), batch_size=50, shuffle=False, connect=daemon.addr)
    now = [k for b in again for k in b["__key__"]]
    assert sorted(now) == sorted([f"s/{i:06d}" for i in range(300)] + [f"r/{i:06d}" for i in range(150)])


def write_equal_parquet(path: Path, prefix: str, seed: int, rows: int = 300) -> None:
    """A Parquet file of `rows` rows of SAMPLE_BYTES in row groups of 10, keys `<prefix>/NNNNNN`,
    plain and uncompressed without statistics: files of equal length whatever the prefix (one
    character) and the bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    table = pa.table(
        {
            "__key__": [f"{prefix}/{i:06d}" for i in range(rows)],
            "jpg": pa.array([rng.bytes(SAMPLE_BYTES) for _ in range(rows)], pa.binary()),
            "cls": pa.array(np.full(rows, 3, np.int64)),
        }
    )
    pq.write_table(table, path, row_group_size=10, compression="none", use_dictionary=False, write_statistics=False)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_parquet_file_rewritten_in_place_while_read_is_shard_error_not_other_rows(
    daemon, tmp_path: Path, transport: str
) -> None:
    """The daemon reads a local Parquet file's column chunks in place, a row group at a time: a
    file rewritten at its length while a stream reads it is refused at the next row group read
    from it, never decoded as the listed file's rows; and the next open reads the file as it is
    now, none of the row groups decoded from it before (the daemon keeps them for other streams)
    served again."""
    import shardstream

    root, other = tmp_path / "ds", tmp_path / "other"
    root.mkdir()
    other.mkdir()
    target = root / "part-0.parquet"
    write_equal_parquet(target, "s", seed=5)
    write_equal_parquet(other / "part-0.parquet", "r", seed=6)
    replacement = (other / "part-0.parquet").read_bytes()
    assert target.stat().st_size == len(replacement)
    # In order, 30 row groups of 4 MiB: the stream holds the file open from its first batch on,
    # and whatever it built ahead (the ring's slots, or up to 64 MiB inline) leaves row groups to
    # read after the rewrite.
    loader = shardstream.Loader(str(root), batch_size=10, shuffle=False, transport=transport, connect=daemon.addr)
    assert len(read_while_rewritten(loader, target, replacement)) < 300

    again = shardstream.Loader(str(root), batch_size=50, shuffle=False, connect=daemon.addr)
    now = [k for b in again for k in b["__key__"]]
    assert now == [f"r/{i:06d}" for i in range(300)], "rows decoded from the file before its rewrite served"


def test_a_loader_made_after_a_rewrite_in_place_within_the_listings_minute(daemon, tmp_path: Path) -> None:
    """Regenerate a dataset in place, then start the next run at once: its open could reuse the
    listing an open made less than a minute before (the directory's time did not move), and the
    first use of a rewritten shard refused it, telling the Loader made after the change to make
    a new Loader. An open that reuses a listing now stats 8 shards spread over the dataset
    first: a dataset rewritten in place is listed again. A single file rewritten among those not
    looked at is still refused at its first use, and the error says why."""
    import shardstream

    root, other = tmp_path / "ds", tmp_path / "other"
    write_equal_shards(root, "s", 10, seed=7, size=1000)
    write_equal_shards(other, "r", 10, seed=8, size=1000)
    names = sorted(p.name for p in root.glob("*.tar"))

    def keys() -> list[str]:
        loader = shardstream.Loader(str(root), batch_size=50, shuffle=False, connect=daemon.addr)
        return [k for b in loader for k in b["__key__"]]

    def rewrite(name: str) -> None:
        with open(root / name, "r+b") as f:  # in place, as a writer regenerating it does
            f.write((other / name).read_bytes())

    assert len(keys()) == 1500  # the run before: its open listed the dataset
    time.sleep(0.05)  # apart from the listed times on a coarse clock
    for name in names:
        rewrite(name)
    assert sorted(keys()) == sorted(f"r/{i:06d}" for i in range(1500)), "regenerated: listed again"
    # Shard 4 of 10 is none of the 8 looked at (0, 1, 2, 3, 5, 6, 7, 9).
    write_equal_shards(tmp_path / "third", "t", 10, seed=9, size=1000)
    time.sleep(0.05)
    with open(root / names[4], "r+b") as f:
        f.write((tmp_path / "third" / names[4]).read_bytes())
    with pytest.raises(shardstream.ShardError) as e:
        keys()
    assert "it changed before the dataset's latest open, which reused the daemon's listing" in str(e.value), e.value
    assert sorted(keys()) == sorted(
        [f"r/{i:06d}" for i in range(1500) if not 600 <= i < 750] + [f"t/{i:06d}" for i in range(600, 750)]
    )
