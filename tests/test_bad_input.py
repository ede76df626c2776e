"""Bad input gets an error naming its cause, and the daemon keeps serving everyone else."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

import shardstream
from conftest import SHARDSTREAM, Daemon


def assert_still_serves(daemon, dataset) -> None:
    root, samples = dataset
    assert daemon.alive()
    loader = shardstream.Loader(str(root), batch_size=256, connect=daemon.addr)
    assert sum(len(b["__key__"]) for b in loader) == len(samples)


def test_missing_dataset(daemon, dataset, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        shardstream.Loader(str(missing), connect=daemon.addr)
    assert_still_serves(daemon, dataset)


@pytest.mark.parametrize("url", ["pipe:cat {root}/shard-000000.tar", "pipe:curl -s https://host/shard-000000.tar"])
def test_a_webdataset_pipe_url_is_refused_saying_why(daemon, dataset, url: str) -> None:
    # A pipe: URL without "://" was taken for a relative path: "dataset not found:
    # /cwd/pipe:cat ...", which sent a user migrating from webdataset looking for a file.
    root, _ = dataset
    with pytest.raises(ValueError, match=r"pipe: URLs .* are not read.*s3://"):
        shardstream.Loader(url.format(root=root), batch_size=8, connect=daemon.addr)
    r = subprocess.run([SHARDSTREAM, "index", url.format(root=root)], capture_output=True, text=True)
    assert r.returncode != 0 and "pipe: URLs" in r.stderr, r.stderr


def test_a_shard_whose_samples_files_are_apart_is_served_as_runs_and_said(tmp_path: Path) -> None:
    # `tar cf` of a directory orders members as the file system lists them: a sample's files
    # apart. Each run is a sample of its own (as webdataset reads it) with the fields it lacks
    # None: 8,542 "samples" for 2,000 in one trial, without a word.
    root = tmp_path / "ds"
    root.mkdir()
    with tarfile.open(root / "shard-0.tar", "w") as t:
        for name in ["a.jpg", "b.jpg", "a.cls", "b.cls", "c.jpg", "c.cls"]:
            data = name.encode()
            info = tarfile.TarInfo(f"d/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path / "daemon", log=log).start()
    try:
        keys = [k for b in shardstream.Loader(str(root), batch_size=8, connect=d.addr) for k in b["__key__"]]
        assert sorted(keys) == ["d/a", "d/a", "d/b", "d/b", "d/c"], keys
    finally:
        d.stop()
    assert "2 of its 5 samples repeat the key of an earlier one" in log.read_text(), log.read_text()
    r = subprocess.run([SHARDSTREAM, "index", str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    said = "warning: shard shard-0.tar: 2 of its 5 samples repeat the key of an earlier one that is not next to them"
    assert f'{said} (first "d/a")' in r.stdout, r.stdout
    assert "tar --sort=name" in r.stdout and "shardstream pack" in r.stdout, r.stdout


def test_an_unknown_field_is_refused_when_the_loader_is_made(daemon, dataset) -> None:
    """A typo in `fields` was accepted (len() answered) and refused at the first batch, inside a
    DataLoader worker of the first epoch; the README promises a ValueError when the Loader is
    made."""
    root, _ = dataset
    with pytest.raises(ValueError, match=r"field 'jpeg' is not in dataset .* \(fields: cls, jpg"):
        shardstream.Loader(str(root), fields=["jpg", "jpeg"], connect=daemon.addr)
    assert_still_serves(daemon, dataset)


def test_a_long_url_with_a_control_character_is_a_value_error(daemon, dataset) -> None:
    """A pattern of 700 non-ASCII names read from a file with its newline: the refusal
    quoted it whole, percent-encoded three bytes a byte, past the reply's 16 KiB header limit,
    and the trainer read "no shardstream daemon answered"."""
    root, _ = dataset
    names = ",".join(f"éééé{i:03d}" for i in range(700))  # 8.4 KB; 21 KB percent-encoded
    with pytest.raises(ValueError, match="control character"):
        shardstream.Loader(f"{root}/{{{names}}}.tar\n", connect=daemon.addr)
    assert_still_serves(daemon, dataset)


def test_empty_directory(daemon, dataset, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no"):
        shardstream.Loader(str(tmp_path), connect=daemon.addr)
    assert_still_serves(daemon, dataset)


def test_not_a_tar(daemon, dataset, tmp_path: Path) -> None:
    (tmp_path / "x-000000.tar").write_bytes(b"this is not a tar file at all\n" * 100)
    with pytest.raises(shardstream.ShardError, match="not a TAR") as err:
        shardstream.Loader(str(tmp_path), connect=daemon.addr)
    assert err.value.shard.endswith("x-000000.tar")
    assert_still_serves(daemon, dataset)


def test_truncated_tar(daemon, dataset, tmp_path: Path) -> None:
    root, _ = dataset
    good = (root / "train-000002.tar").read_bytes()
    # Cut inside the payload of the member whose header sits at the middle of the shard.
    headers = [o for o in range(0, len(good) // 2, 512) if good[o + 257 : o + 262] == b"ustar"]
    cut = headers[-1] + 512  # the header is there, its payload is not
    (tmp_path / "t-000000.tar").write_bytes(good[:cut])
    with pytest.raises(shardstream.ShardError) as err:
        shardstream.Loader(str(tmp_path), connect=daemon.addr)
    assert err.value.shard.endswith("t-000000.tar")
    assert err.value.offset is not None and 0 <= err.value.offset < len(good)
    assert str(err.value.offset) in str(err.value)
    assert_still_serves(daemon, dataset)


def test_member_larger_than_shard(daemon, dataset, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("k1.bin")
        info.size = 100
        tf.addfile(info, io.BytesIO(b"x" * 100))
    data = bytearray(buf.getvalue())
    # Claim 1 GiB in the header's size field and fix its checksum: a lying member.
    data[124:136] = b"%011o\0" % (1 << 30)
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    (tmp_path / "lie-000000.tar").write_bytes(bytes(data))
    with pytest.raises(shardstream.ShardError, match="lie-000000.tar"):
        shardstream.Loader(str(tmp_path), connect=daemon.addr)
    assert_still_serves(daemon, dataset)


def test_a_sparse_member_from_gnu_tar_is_refused_by_name_not_left_out(daemon, dataset, tmp_path: Path) -> None:
    # `tar --sparse` stores a file with holes as its data blocks and a map; webdataset (tarfile)
    # gives the whole file. The shard's bytes are not the file, so it cannot be served in place;
    # it was skipped without a word: the sample arrived without the field, or not at all.
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "s.bin", "wb") as f:
        f.seek(1 << 20)
        f.write(b"tail")
    (src / "s.cls").write_bytes(b"3")
    for fmt in ("gnu", "posix"):
        d = tmp_path / fmt
        d.mkdir()
        tar = ["tar", f"--format={fmt}", "--sparse", "-cf", str(d / "sp-000000.tar"), "-C", str(src), "s.bin", "s.cls"]
        subprocess.run(tar, check=True)
        with pytest.raises(shardstream.ShardError, match=r"sp-000000\.tar.*s\.bin.* sparse .*without --sparse"):
            next(iter(shardstream.Loader(str(d), connect=daemon.addr)))
    assert_still_serves(daemon, dataset)


def test_member_names_that_are_not_utf8_are_refused_not_merged(daemon, dataset, tmp_path: Path) -> None:
    # Names were decoded lossily: b"caf\xe9.jpg" and b"caf\xe8.cls" both became key "caf\ufffd",
    # two samples served as one; with the same field twice, the error blamed a duplicate member.
    for i, names in enumerate([(b"caf\xe9.jpg", b"caf\xe8.cls"), (b"caf\xe9.jpg", b"caf\xe8.jpg")]):
        d = tmp_path / f"latin1-{i}"
        d.mkdir()
        with tarfile.open(d / "l-000000.tar", "w", format=tarfile.GNU_FORMAT) as tf:
            for raw in (*names, b"ok.jpg"):
                info = tarfile.TarInfo(raw.decode("utf-8", "surrogateescape"))
                info.size = 2
                tf.addfile(info, io.BytesIO(b"xy"))
        with pytest.raises(shardstream.ShardError, match=r"l-000000\.tar.*caf\\xe9\.jpg.* not UTF-8"):
            next(iter(shardstream.Loader(str(d), connect=daemon.addr)))
    assert_still_serves(daemon, dataset)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # One message whatever side of the range (-1 said "from 0 to 2**32-1", 0 "from 1").
        ({"batch_size": 0}, r"batch_size must be an integer from 1 to 1048576, not 0"),
        ({"batch_size": -1}, r"batch_size must be an integer from 1 to 1048576, not -1"),
        ({"batch_size": 1 << 30}, "batch_size"),
        ({"rank": 4, "world_size": 4}, "rank 4"),
        ({"rank": 0, "world_size": 0}, "world"),
        ({"rank": 0, "world_size": 1 << 40}, "world"),
        ({"fields": ["nope"]}, "nope"),
        ({"fields": "jpg"}, "fields"),
        # An empty list travels as "no selection", which the daemon reads as every field: a user
        # who filtered their list down to nothing would get everything without a word.
        ({"fields": []}, r"fields=\[\] selects no field.*fields=None"),
        ({"fields": ["jpg", 7]}, "field names.*7"),
        ({"seed": -1}, "seed"),
        ({"transport": "carrier-pigeon"}, "transport"),
    ],
)
def test_invalid_requests(daemon, dataset, kwargs, match) -> None:
    root, _ = dataset
    with pytest.raises(ValueError, match=match):
        loader = shardstream.Loader(str(root), connect=daemon.addr, **kwargs)
        next(iter(loader))
    assert_still_serves(daemon, dataset)


def test_unreachable_daemon(tmp_path: Path, dataset) -> None:
    root, _ = dataset
    with pytest.raises(ConnectionError, match="cannot connect"):
        shardstream.Loader(str(root), connect=f"unix://{tmp_path}/no.sock")
    with pytest.raises(ValueError, match="invalid daemon address"):
        shardstream.Loader(str(root), connect="carrier://pigeon")


def test_slow_client_does_not_block_others(daemon, dataset) -> None:
    root, samples = dataset
    stalled = shardstream.Loader(str(root), batch_size=8, connect=daemon.addr)
    it = iter(stalled)
    next(it)  # opened, then never read again while the others run
    for _ in range(3):
        assert_still_serves(daemon, dataset)
    del it


def test_a_dataset_url_with_control_characters_is_refused(daemon, dataset) -> None:
    # The URL is logged as given: a newline in it wrote a line of the attacker's choosing into
    # the daemon's log ("... INFO shardstream::daemon: forged line"). No dataset is named so.
    root, _ = dataset
    for url in (f"{root}\n2026-12-03T14:01:00.000000Z  INFO shardstream::daemon: forged", f"{root}\x1b[2J"):
        with pytest.raises(ValueError, match="control character"):
            shardstream._native.Connection(daemon.addr).open(url, "auto")
    assert_still_serves(daemon, dataset)


@pytest.mark.parametrize("views", [False, True])
def test_a_parquet_page_whose_checksum_fails_is_a_shard_error(daemon, tmp_path: Path, views: bool) -> None:
    """A writer that stores page checksums (pyarrow's ``write_page_checksum=True``) lets a reader
    catch a flipped byte in a page; the README says they are checked, yet the daemon served the
    damaged value (row 50 read 51). Nothing of a page whose checksum fails may be delivered."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    ids = pa.array(range(100), pa.int64())
    blobs = pa.array([i.to_bytes(8, "little") for i in range(100)], pa.binary())
    pq.write_table(
        pa.table({"id": ids, "blob": blobs}),
        path,
        compression="none",
        use_dictionary=False,
        write_page_checksum=True,
    )
    data = bytearray(path.read_bytes())
    at = bytes(data).find((50).to_bytes(8, "little"))  # row 50 of `id`, the first column
    assert at > 0
    data[at] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="(?i)crc|checksum"):
        pq.read_table(path, page_checksum_verification=True)  # the damage is what pyarrow catches
    got: list[int] = []
    with pytest.raises(shardstream.ShardError, match="a.parquet") as err:
        loader = shardstream.Loader(
            str(tmp_path), batch_size=10, shuffle=False, binary_views=views, connect=daemon.addr
        )
        for batch in loader:
            got.extend(np.asarray(batch["id"]).tolist())
    assert got == [], "no row of a row group whose page fails its checksum"
    # Where the row group's chunks begin (it was None for every Parquet error).
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    assert err.value.offset == (chunk.dictionary_page_offset or chunk.data_page_offset)


def test_a_later_files_times_that_the_datasets_unit_cannot_hold_are_a_value_error(daemon, tmp_path: Path) -> None:
    """A later file in milliseconds is served in the dataset's nanoseconds; a year-3000 time does
    not fit 64-bit nanoseconds. The file is sound (pyarrow reads it): the error said "corrupt
    data" and was a ShardError."""
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"t": pa.array([0, 1], pa.timestamp("ns"))}), tmp_path / "a.parquet")
    late = pa.array([dt.datetime(2000, 1, 1), dt.datetime(3000, 1, 1)], pa.timestamp("ms"))
    pq.write_table(pa.table({"t": late}), tmp_path / "b.parquet")
    assert pq.read_table(tmp_path / "b.parquet").num_rows == 2
    with pytest.raises(ValueError, match=r"b\.parquet: row group 0: column \"t\" holds values .* do not fit") as err:
        for _ in shardstream.Loader(str(tmp_path), batch_size=2, shuffle=False, connect=daemon.addr):
            pass
    assert not isinstance(err.value, shardstream.ShardError) and "corrupt" not in str(err.value)


@pytest.mark.parametrize("what", ["manifest-fifo", "manifest-device", "sidecar-device"])
def test_metadata_that_is_no_regular_file_is_an_error_at_once(daemon, tmp_path: Path, what: str) -> None:
    """A FIFO in manifest.json's place held a daemon thread in open() for good; a link to
    /dev/zero (a manifest, a sidecar) was read until the daemon ran out of memory (3 GB in 8 s).
    A manifest that is no regular file is an error naming it, at once; a sidecar is passed over
    (the shard is scanned instead, as for any sidecar that cannot be read)."""
    import os

    from conftest import SHARDSTREAM, write_dataset

    root = tmp_path / "ds"
    write_dataset(root, n=20, per_shard=10)
    subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True, timeout=120)
    if what.startswith("manifest"):
        victim = root / "manifest.json"
    else:
        victim = next((root / "_shardstream").glob("*.idx"))
    victim.unlink()
    if what.endswith("fifo"):
        os.mkfifo(victim)
    else:
        victim.symlink_to("/dev/zero")
    if what.startswith("manifest"):
        with pytest.raises((OSError, ValueError), match="not a regular file"):
            next(iter(shardstream.Loader(str(root), batch_size=4, connect=daemon.addr)))
    else:
        got = sum(len(b["__key__"]) for b in shardstream.Loader(str(root), batch_size=4, connect=daemon.addr))
        assert got == 20


def test_a_parquet_dataset_of_empty_files_names_them(daemon, tmp_path: Path) -> None:
    # It said "no samples (0 shards listed)" of a dataset whose one file was listed, and empty.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "a.parquet")
    # When the Loader is made: it was at the first batch, after len() had answered 0.
    with pytest.raises(ValueError, match=r"no samples: its 1 file holds none \(a\.parquet\)"):
        shardstream.Loader(str(tmp_path), batch_size=4, connect=daemon.addr)


def test_a_parquet_file_without_rows_beside_others_is_named_once(tmp_path: Path) -> None:
    """An empty file among others is left out: the daemon's log said so twice an open, and
    `shardstream index`, which writes the manifest that lists it, said nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "ds"
    root.mkdir()
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), root / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1, 2, 3], pa.int64())}), root / "b.parquet")
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path / "d", log=log).start()
    try:
        got = sum(len(b["x"]) for b in shardstream.Loader(str(root), batch_size=2, connect=d.addr))
    finally:
        assert d.stop() == 0
    assert got == 3
    warned = [line for line in log.read_text().splitlines() if "a.parquet" in line]
    assert len(warned) == 1 and "without rows" in warned[0], warned

    p = subprocess.run([SHARDSTREAM, "index", str(root)], capture_output=True, text=True, check=True)
    assert "1 shard without samples, which contribute none: a.parquet" in p.stdout, p.stdout


def test_a_tar_dataset_without_samples_is_refused_when_the_loader_is_made(daemon, dataset, tmp_path: Path) -> None:
    for i in range(2):
        tarfile.open(tmp_path / f"e-{i:06d}.tar", "w").close()
    with pytest.raises(ValueError, match=r"no samples: its 2 files hold none \(e-000000\.tar, e-000001\.tar\)"):
        shardstream.Loader(str(tmp_path), batch_size=4, connect=daemon.addr)
    assert_still_serves(daemon, dataset)
