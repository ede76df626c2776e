"""A local shard that cannot be read (replaced by a directory: EISDIR; by a FIFO; made unreadable:
EACCES) fails the stream within seconds with an error naming the file (`PermissionError`,
`OSError` or `ShardError`), never a hang and never `ConnectionError("daemon unavailable")`, which
would send a trainer's reconnect logic into a loop."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

import shardstream
from conftest import SHARDSTREAM, Daemon, write_dataset

BROKEN = "train-000007.tar"


def iterate_with_deadline(loader, seconds: float) -> BaseException | None:
    """Iterates `loader` (or an iterator) on a thread; returns what it raised (None: it ended
    cleanly)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            for _ in loader:
                pass
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the epoch hung for {seconds} s on an unreadable shard"
    return outcome[0]


def break_shard(path: Path, how: str) -> None:
    if how == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("how", ["directory", "fifo"])
@pytest.mark.parametrize("when", ["before_iterating", "mid_epoch"])
@pytest.mark.parametrize("cache", ["auto", "copy"])  # read in place, or copied into the node cache
def test_unreadable_local_shard_fails_promptly(
    daemon, tmp_path: Path, how: str, transport: str, when: str, cache: str
) -> None:
    root = tmp_path / "ds"
    # Mid-epoch, the last of 100 shards breaks: an inline stream has no credits, so the daemon
    # reads ahead as far as HTTP/2's windows let it, and a shard a few batches after the first
    # could be read before it is replaced (it was, once, on a loaded machine: the epoch then
    # ends cleanly). ~250 batches ahead, the replacement comes first.
    shards = 100 if when == "mid_epoch" else 20
    write_dataset(root, n=20 * shards, per_shard=20, seed=11)
    assert len(list(root.glob("*.tar"))) == shards
    broken = f"train-{shards - 1:06d}.tar" if when == "mid_epoch" else BROKEN
    # Indexed while every shard is fine, then one shard is replaced under the daemon's feet:
    # before the epoch starts (the stream's open lists the directory again), or mid-epoch (the
    # stream reaches the shard later: a FIFO there used to block the stream forever). With
    # cache="copy" the open copied every shard to index it, but a copy stands in for its source
    # only as long as the source is as listed (a stream's open that lists nothing checks it when
    # the shard is first used): a copy of a file that is no longer there is not served.
    loader = shardstream.Loader(
        str(root), batch_size=8, shuffle=False, transport=transport, cache=cache, connect=daemon.addr
    )
    if when == "mid_epoch":
        it = iter(loader)
        next(it)
        loader = it  # iterate the rest of this epoch
    break_shard(root / broken, how)
    t0 = time.monotonic()
    err = iterate_with_deadline(loader, 30)
    elapsed = time.monotonic() - t0
    assert err is not None, "an epoch over an unreadable shard must not end cleanly"
    assert isinstance(err, (OSError, shardstream.ShardError)), repr(err)
    assert not isinstance(err, ConnectionError), repr(err)
    assert broken in str(err), str(err)
    assert elapsed < 20, f"took {elapsed:.1f} s"
    # The daemon still serves a good dataset, and the same one once repaired.
    if (root / broken).is_dir():
        shutil.rmtree(root / broken)
    else:
        (root / broken).unlink()
    good = tmp_path / "good"
    samples = write_dataset(good, n=50, per_shard=20, seed=12)
    assert sum(len(b["__key__"]) for b in shardstream.Loader(str(good), connect=daemon.addr)) == len(samples)


def test_permission_denied_shard(daemon, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_dataset(root, n=100, per_shard=20, seed=13)
    d = daemon
    if os.geteuid() == 0:
        # Root reads mode-000 files through CAP_DAC_OVERRIDE: run a daemon without capabilities.
        assert shutil.which("setpriv"), "setpriv (util-linux) is needed to test EACCES as root"
        d = Daemon(tmp_path / "d", wrap=["setpriv", "--bounding-set=-all", "--inh-caps=-all"]).start()
    try:
        loader = shardstream.Loader(str(root), batch_size=8, shuffle=False, connect=d.addr)
        os.chmod(root / "train-000002.tar", 0)
        err = iterate_with_deadline(loader, 30)
        assert isinstance(err, PermissionError), repr(err)
        assert "train-000002.tar" in str(err) and err.filename.endswith("train-000002.tar"), str(err)
    finally:
        if d is not daemon:
            assert d.stop() == 0


@pytest.mark.parametrize("cache", ["direct", "copy"])
@pytest.mark.parametrize("kind", ["parquet", "parquet-views", "webdataset"])
def test_a_shard_rewritten_in_place_is_read_anew_by_the_next_open(
    daemon, tmp_path: Path, kind: str, cache: str
) -> None:
    # A notebook rewrites its data file in place (pyarrow and tarfile truncate and write the same
    # inode: the directory's mtime does not move) and reads it again within the minute the daemon
    # trusts an unchanged directory. The open that reuses the listing looks at up to 8 of its
    # shards first (this one among them), lists the dataset again and reads the new rows (it
    # failed once, naming the shard, before that look; a shard it does not look at still does,
    # tests/test_truncation.py). With cache="copy" the shards are read from the node cache's
    # copies (and Parquet views from the row groups kept there), which must not stand in for a
    # source that changed.
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    views = {"format": "arrow", "binary_views": True} if kind == "parquet-views" else {}

    def write(n: int) -> None:
        if kind.startswith("parquet"):
            blobs = pa.array([b"%d" % i * 40 for i in range(n)], pa.binary())
            pq.write_table(pa.table({"id": list(range(n)), "b": blobs}), tmp_path / "a.parquet")
        else:
            with open(tmp_path / "a-000000.tar", "r+b" if (tmp_path / "a-000000.tar").exists() else "wb") as f:
                f.truncate(0)
                with wds.TarWriter(f) as sink:
                    for i in range(n):
                        sink.write({"__key__": f"k{i:03d}", "id": b"%d" % i})

    def ids() -> list[int]:
        loader = shardstream.Loader(str(tmp_path), batch_size=8, connect=daemon.addr, cache=cache, **views)
        if views:
            return sorted(v for b in loader for v in b.column("id").to_pylist())
        return sorted(int(v) if kind == "parquet" else int(bytes(v)) for b in loader for v in b["id"])

    write(10)
    assert ids() == list(range(10))
    write(25)
    assert ids() == list(range(25))


@pytest.mark.parametrize("cache", ["direct", "copy"])
def test_a_shard_rewritten_in_place_at_the_same_size_is_never_read_with_the_old_index(
    daemon, tmp_path: Path, cache: str
) -> None:
    # TAR pads members to 512 bytes: a member of 3 bytes rewritten as one of 5 leaves the file's
    # length as it was, and the index made for the old file would cut the new value to 3 bytes.
    import tarfile

    shard = tmp_path / "a-000000.tar"

    def write(value: bytes) -> None:
        with open(shard, "r+b" if shard.exists() else "wb") as f:
            f.truncate(0)
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tf:
                info = tarfile.TarInfo("k0.id")
                info.size = len(value)
                tf.addfile(info, io.BytesIO(value))

    def values() -> list[bytes]:
        loader = shardstream.Loader(str(tmp_path), batch_size=8, connect=daemon.addr, cache=cache)
        return [bytes(v) for b in loader for v in b["id"]]

    write(b"111")
    assert values() == [b"111"]
    size = shard.stat().st_size
    time.sleep(0.01)  # a new mtime, even on a coarse clock
    write(b"22222")
    assert shard.stat().st_size == size
    try:
        got = values()
    except shardstream.ShardError as e:
        assert "a-000000.tar" in str(e) and "changed" in str(e), e
    else:
        assert got == [b"22222"], got
    assert values() == [b"22222"]


@pytest.mark.parametrize("cache", ["copy", "direct"])
def test_a_manifest_shard_rewritten_after_its_copy_was_made_is_not_served_from_the_copy(
    tmp_path: Path, cache: str
) -> None:
    """A dataset with a manifest: a shard rewritten with other bytes of the same length (manifest
    not rewritten) was served from its old node-cache copy (`cache="copy"`) in every later epoch
    and after a restart; `cache="direct"` checked a file against its CRC once per dataset, and then
    read it as it is. Every open after the rewrite is refused, in this daemon and the next."""
    import subprocess
    import tarfile

    from conftest import SHARDSTREAM

    root = tmp_path / "ds"
    samples = write_dataset(root, n=40, per_shard=20)
    subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True, timeout=120)
    d = Daemon(tmp_path / "d")
    d.tmp.mkdir()

    def keys_and_jpgs() -> dict[str, bytes]:
        loader = shardstream.Loader(str(root), batch_size=8, connect=d.addr, cache=cache)
        return {k: bytes(v) for b in loader for k, v in zip(b["__key__"], b["jpg"], strict=True)}

    # Files from a host whose clock runs an hour ahead: a copy is current by its source's time,
    # not by comparing that with the copy's own (which had every copy made again at every open).
    ahead = time.time() + 3600
    for shard in root.glob("*.tar"):
        os.utime(shard, (ahead, ahead))

    def copies() -> dict[str, int]:
        shards = d.cache_dir / "shards"
        return {p.name: p.stat().st_ino for p in shards.iterdir()} if shards.exists() else {}

    d.start()
    try:
        assert keys_and_jpgs() == {k: v["jpg"] for k, v in samples.items()}
        made = copies()
        assert keys_and_jpgs() == {k: v["jpg"] for k, v in samples.items()}
        assert copies() == made, "copies of unchanged sources were made again"
        if cache == "direct":
            assert not made
        victim = root / "train-000001.tar"
        data = bytearray(victim.read_bytes())
        with tarfile.open(victim) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".jpg"):
                    data[m.offset_data : m.offset_data + m.size] = bytes(
                        b ^ 0xFF for b in data[m.offset_data : m.offset_data + m.size]
                    )
        time.sleep(0.01)  # a newer mtime than the copy's, even on a coarse clock
        with open(victim, "r+b") as f:
            f.write(bytes(data))
        for _ in range(3):  # and not only the first open after the rewrite
            with pytest.raises(shardstream.ShardError, match="train-000001.tar.*does not match manifest.json"):
                keys_and_jpgs()
    finally:
        assert d.stop() == 0
    d.start()
    try:
        with pytest.raises(shardstream.ShardError, match="train-000001.tar.*does not match manifest.json"):
            keys_and_jpgs()
    finally:
        assert d.stop() == 0


def test_a_node_cache_copy_damaged_on_disk_is_fetched_again_not_refused_for_good(tmp_path: Path) -> None:
    """A copy whose TAR headers were damaged on disk after it was verified failed every epoch, on
    every restart, with "bad header checksum" (the daemon never dropped it, the source was fine).
    The failing open drops it; the next one copies the shard again."""
    root = tmp_path / "ds"
    samples = write_dataset(root, n=40, per_shard=20)
    d = Daemon(tmp_path / "d")
    d.tmp.mkdir()

    def keys() -> list[str]:
        loader = shardstream.Loader(str(root), batch_size=8, connect=d.addr, cache="copy")
        return [k for b in loader for k in b["__key__"]]

    d.start()
    try:
        assert sorted(keys()) == sorted(samples)
    finally:
        assert d.stop() == 0
    copy = next(p for p in (d.cache_dir / "shards").iterdir() if "train-000001" in p.name)
    damaged = bytearray(copy.read_bytes())
    damaged[148:156] = b"0000000\0"  # the first header's checksum field
    copy.write_bytes(bytes(damaged))
    shutil.rmtree(d.cache_dir / "index", ignore_errors=True)  # no sidecar to stand in for the scan
    d.start()
    try:
        with pytest.raises(shardstream.ShardError):
            keys()
        assert sorted(keys()) == sorted(samples)
    finally:
        assert d.stop() == 0


def copied_epoch(root: Path, samples: dict[str, dict[str, bytes]], addr: str, seed: int) -> None:
    """An epoch of `root` through the node cache (cache="copy"): every sample once, as written."""
    seen: list[str] = []
    for batch in shardstream.Loader(str(root), batch_size=40, seed=seed, cache="copy", connect=addr):
        for key, jpg in zip(batch["__key__"], batch["jpg"], strict=True):
            assert bytes(jpg) == samples[key]["jpg"], key
        seen.extend(batch["__key__"])
    assert sorted(seen) == sorted(samples)


def test_a_directory_in_a_node_cache_copy_s_place_is_cleared_and_the_copy_fetched_again(tmp_path: Path) -> None:
    """A directory left where a copy belongs (debris of a clean-up) failed every stream needing that
    shard with "IsADirectoryError: cannot read shard <the cache's path>", and after a restart
    (which skipped it silently) with "cannot publish cache file ...: Is a directory", for good.
    An empty one is deleted, one with files moved aside, each said; the copy is fetched again."""
    root = tmp_path / "ds"
    samples = write_dataset(root, n=400, per_shard=50)
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path / "d", log=log).start()

    def epoch(seed: int) -> None:
        copied_epoch(root, samples, d.addr, seed)

    def replace_by_directory(copy: Path, with_file: bool) -> None:
        copy.unlink()
        copy.mkdir()
        if with_file:
            (copy / "notes.txt").write_text("someone's")

    try:
        epoch(1)
        copies = sorted((d.cache_dir / "shards").glob("*-train-*.tar"))
        replace_by_directory(copies[0], with_file=False)
        replace_by_directory(copies[1], with_file=True)
        epoch(2)
        assert d.stop() == 0
        replace_by_directory(copies[2], with_file=True)
        d.start()
        epoch(3)
        assert all(c.is_file() for c in copies[:3]), copies[:3]
        aside = sorted((d.cache_dir / "moved-aside").iterdir())
        assert len(aside) == 2 and all((a / "notes.txt").read_text() == "someone's" for a in aside), aside
        said = log.read_text()
        assert said.count("a directory held a node-cache copy's place") == 3, said
    finally:
        if d.alive():
            d.stop()


@pytest.mark.parametrize("manifest", [False, True])
def test_node_cache_copies_removed_or_truncated_by_another_hand_are_fetched_again(
    tmp_path: Path, manifest: bool
) -> None:
    """Copies deleted or truncated in the cache directory (a clean-up script, a user) stayed in
    the cache's table: every later stream failed on them ("path not found", or "is 1000 bytes but
    the dataset index says ...: it changed since the dataset was listed", naming the copy), and
    status counted bytes no longer on disk. They are dropped and fetched again at their next use
    (with a manifest too, whose copies are checked against their sources' times first)."""
    root = tmp_path / "ds"
    samples = write_dataset(root, n=400, per_shard=50)
    if manifest:
        subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True)
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path / "d", log=log).start()
    try:

        def epoch(seed: int) -> None:
            copied_epoch(root, samples, d.addr, seed)

        epoch(1)
        copies = sorted((d.cache_dir / "shards").glob("*-train-*.tar"))
        assert len(copies) == 8, copies
        copies[0].unlink()
        copies[3].unlink()
        with open(copies[5], "r+b") as f:
            f.truncate(1000)
        if manifest:
            # Written in place at its size: the copy's time moves, and the manifest's CRC tells
            # (bytes changed in a copy were served as they were, epoch after epoch).
            with open(copies[6], "r+b") as f:
                f.seek(3000)
                f.write(b"X" * 16)
        epoch(2)
        epoch(3)
        on_disk = sum(p.stat().st_size for p in (d.cache_dir / "shards").glob("*-train-*.tar"))
        assert d.status()["cache"]["used_bytes"] == on_disk
        assert d.stop() == 0
        said = log.read_text()
        assert said.count("node-cache copy dropped, fetched again") == 3 + manifest, "each said in the log"
        assert said.count("written in place by another hand") == manifest, said
        # Cut short, it may have killed what mapped it: the log says so, and how to clean up.
        assert said.count("never by truncating them") == 1, said
    finally:
        if d.alive():
            d.stop()
