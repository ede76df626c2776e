"""Which files a dataset URL names: a directory, a glob in the file name (`data/train-*.parquet`,
as Hugging Face's `data_files` takes it) or a brace pattern, locally and on the real S3 server;
and a directory that holds the files of several splits side by side (the Hugging Face Hub's
`data/` layout, `imagenet-train-*` beside `imagenet-val-*`) refused rather than served as one
dataset that mixes them."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from s3server import S3Server

import shardstream
from conftest import SHARDSTREAM, Daemon

# The Hugging Face Hub's layout of a dataset's Parquet files: (split, files, rows per file).
HUB = [("train", 2, 30), ("test", 1, 20), ("validation", 1, 10)]


def write_hub_layout(data: Path) -> dict[str, set[int]]:
    """Writes `data/{split}-{i:05d}-of-{n:05d}.parquet` with pyarrow; returns each split's ids."""
    data.mkdir(parents=True, exist_ok=True)
    ids: dict[str, set[int]] = {}
    first = 0
    for split, files, rows in HUB:
        ids[split] = set()
        for i in range(files):
            values = list(range(first, first + rows))
            pq.write_table(pa.table({"id": values}), data / f"{split}-{i:05d}-of-{files:05d}.parquet")
            ids[split] |= set(values)
            first += rows
    return ids


def place(where: str, name: str, tmp_path: Path, daemon, s3, s3_daemon) -> tuple[Path, str, str]:
    """A dataset place `name`, a local directory or an S3 prefix: where to write its files, its
    URL, and the daemon that reads it."""
    if where == "local":
        return tmp_path / name, str(tmp_path / name), daemon.addr
    return s3.bucket("hub") / name, f"s3://hub/{name}/", s3_daemon.addr


# A macOS AppleDouble file (`._name`, the resource fork a copy from a Mac leaves beside a file):
# its header, then padding to the 4 KiB such files take.
APPLE_DOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(4096 - 24)


def read_ids(url: str, addr: str) -> list[int]:
    return [int(v) for b in shardstream.Loader(url, batch_size=7, connect=addr) for v in b["id"]]


@pytest.fixture(scope="module")
def s3_daemon(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("urls-s3"), env=s3.env()).start()
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_glob_picks_one_split_of_the_hub_layout(daemon, s3, s3_daemon, tmp_path: Path, where: str) -> None:
    if where == "local":
        base, addr = tmp_path / "data", daemon.addr
        ids = write_hub_layout(base)
        url = str(base) + "/"
    else:
        ids = write_hub_layout(s3.bucket("hub") / "ds" / "data")
        url, addr = "s3://hub/ds/data/", s3_daemon.addr
    got = read_ids(url + "train-*.parquet", addr)
    assert sorted(got) == sorted(ids["train"])
    assert sorted(read_ids(url + "test-0000?-of-*.parquet", addr)) == sorted(ids["test"])
    assert sorted(read_ids(url + "{test,validation}-*.parquet", addr)) == sorted(ids["test"] | ids["validation"])
    assert sorted(read_ids(url + "[tv][ae]*.parquet", addr)) == sorted(ids["test"] | ids["validation"])
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.parquet"):
        read_ids(url + "nothing-*.parquet", addr)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_directory_of_several_splits_is_refused_naming_them(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    if where == "local":
        write_hub_layout(tmp_path / "data")
        url, addr = str(tmp_path / "data"), daemon.addr
    else:
        write_hub_layout(s3.bucket("hub") / "mixed")
        url, addr = "s3://hub/mixed/", s3_daemon.addr
    with pytest.raises(ValueError, match="several splits") as e:
        read_ids(url, addr)
    msg = str(e.value)
    for split, example in [("train", "train-00000-of-00002"), ("test", "test-00000"), ("validation", "validation-")]:
        assert split in msg and example in msg, msg
    assert "train-*" in msg, f"the error shows the pattern that picks one split: {msg}"
    # The explicit pattern for everything is the way to serve them together, knowingly.
    assert len(read_ids(url.rstrip("/") + "/*.parquet", addr)) == sum(f * r for _, f, r in HUB)


def test_webdataset_shards_of_two_splits_and_a_glob(daemon, tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    root.mkdir()
    keys: dict[str, set[str]] = {}
    for split, n in [("train", 30), ("val", 10)]:
        keys[split] = set()
        with wds.ShardWriter(str(root / f"imagenet-{split}-%06d.tar"), maxcount=8, verbose=0) as sink:
            for i in range(n):
                key = f"{split}/{i:04d}"
                sink.write({"__key__": key, "cls": b"1"})
                keys[split].add(key)
    with pytest.raises(ValueError, match="several splits"):
        list(shardstream.Loader(str(root), batch_size=8, connect=daemon.addr))
    got = [
        k
        for b in shardstream.Loader(f"{root}/imagenet-val-*.tar", batch_size=8, connect=daemon.addr)
        for k in b["__key__"]
    ]
    assert sorted(got) == sorted(keys["val"])
    # Words that only contain a split's name are no split: one dataset, served whole.
    plain = tmp_path / "words"
    plain.mkdir()
    for name in ["pretrained-000000.tar", "contest-000000.tar", "latest-000000.tar"]:
        with wds.TarWriter(str(plain / name)) as sink:
            sink.write({"__key__": name[:-4], "cls": b"1"})
    assert (
        len([k for b in shardstream.Loader(str(plain), batch_size=8, connect=daemon.addr) for k in b["__key__"]]) == 3
    )


def test_loose_files_and_whole_compressed_shards_point_at_the_fix(daemon, tmp_path: Path) -> None:
    # A user arriving from a folder of samples (or a .tgz webdataset reads) got "the directory
    # holds none", or "no valid TAR header at offset 0" for a .tgz a pattern picked.
    loose = tmp_path / "loose"
    (loose / "cats").mkdir(parents=True)
    (loose / "cats" / "a.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(FileNotFoundError, match=r"holds none.*shardstream pack"):
        shardstream.Loader(str(loose), connect=daemon.addr)
    (loose / "b.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(FileNotFoundError, match=r"holds none.*shardstream pack"):
        shardstream.Loader(str(loose), connect=daemon.addr)
    tgz = tmp_path / "tgz"
    tgz.mkdir()
    (loose / "c.bin").write_bytes(os.urandom(4096))  # a real shard's size: past one TAR block compressed
    with tarfile.open(tgz / "shard-0.tgz", "w:gz") as t:
        t.add(loose / "c.bin", arcname="c.bin")
    with pytest.raises(shardstream.ShardError, match=r"gzip-compressed.*uncompressed"):
        shardstream.Loader(str(tgz / "shard-{0..0}.tgz"), connect=daemon.addr)


def test_a_directory_whose_name_looks_like_a_glob_is_a_directory(daemon, tmp_path: Path) -> None:
    root = tmp_path / "run[1]"
    ids = write_hub_layout(root / "data")
    assert sorted(read_ids(f"{root}/data/train-*.parquet", daemon.addr)) == sorted(ids["train"])
    only = tmp_path / "only[train]"
    only.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3]}), only / "part-0.parquet")
    assert sorted(read_ids(str(only), daemon.addr)) == [1, 2, 3]


def test_index_takes_a_directory_not_a_pattern(tmp_path: Path) -> None:
    """`index` writes the directory's manifest.json, which every later open of the directory reads
    (patterns included): one written for some of its files would hide the others."""
    write_hub_layout(tmp_path / "data")
    for url, says in [
        (f"{tmp_path}/data/train-*.parquet", "not a glob"),
        (f"{tmp_path}/data/train-{{00000..00001}}-of-00002.parquet", "not a brace pattern"),
        (f"{tmp_path}/data/train-00000-of-00002.parquet", "not one of its shards"),
    ]:
        p = subprocess.run([SHARDSTREAM, "index", url], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and says in p.stderr, (url, p.stderr)
    assert not (tmp_path / "data" / "manifest.json").exists()


def test_index_reads_a_home_path_as_the_shell_does(tmp_path: Path) -> None:
    (tmp_path / "home" / "ds").mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(10))}), tmp_path / "home" / "ds" / "part-0.parquet")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    r = subprocess.run(
        [SHARDSTREAM, "index", "~/ds"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "home" / "ds" / "manifest.json").is_file()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_index_describes_a_directory_of_several_splits_and_opens_still_pick_one(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    """The Hub's layout (splits side by side in `data/`) could not be indexed at all: `index`
    refused the directory for its splits and pointed to a glob, which it refuses too. The
    manifest describes every file; the opens that read it keep their own rules (the directory
    is refused for its splits, a glob picks one)."""
    base, url, addr = place(where, "indexed-hub", tmp_path, daemon, s3, s3_daemon)
    ids = write_hub_layout(base)
    env = None if where == "local" else {**os.environ, **s3.env()}
    p = subprocess.run([SHARDSTREAM, "index", url], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    manifest = json.loads((base / "manifest.json").read_text())
    assert sorted(s["name"] for s in manifest["shards"]) == sorted(p.name for p in base.glob("*.parquet"))
    with pytest.raises(ValueError, match="several splits"):
        read_ids(url, addr)
    glob_url = url.rstrip("/") + "/train-*.parquet"
    assert sorted(read_ids(glob_url, addr)) == sorted(ids["train"])
    assert sorted(read_ids(url.rstrip("/") + "/{test,validation}-*.parquet", addr)) == sorted(
        ids["test"] | ids["validation"]
    )


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_directory_whose_shards_are_in_subdirectories_names_them(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # A directory per split (not `key=value` partitions, which are served with their keys as
    # columns: test_partitions.py): a dataset is the files of the directory named, so the error
    # must say where the shards are instead of "none".
    root, url, addr = place(where, "splits", tmp_path, daemon, s3, s3_daemon)
    for sub, first in (("train", 0), ("test", 5)):
        (root / sub).mkdir(parents=True)
        pq.write_table(pa.table({"id": list(range(first, first + 5))}), root / sub / "part-0.parquet")
    (root / "notes").mkdir()
    (root / "notes" / "README.txt").write_text("no shards here\n")
    with pytest.raises(FileNotFoundError, match="holds none") as e:
        read_ids(url, addr)
    message = str(e.value)
    assert "train/" in message and "test/" in message, message
    assert "notes/" not in message, message
    assert sorted(read_ids(url.rstrip("/") + "/test/", addr)) == list(range(5, 10))


def test_a_relative_or_home_path_is_the_clients_not_the_daemons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon runs in its own working directory, where a directory of the same relative name
    # holds another dataset: the client's `ds` must be served, never the daemon's.
    daemon_cwd, client_cwd = tmp_path / "daemon-cwd", tmp_path / "client-cwd"
    for where, first in ((daemon_cwd, 1000), (client_cwd, 0)):
        (where / "ds").mkdir(parents=True)
        pq.write_table(pa.table({"id": list(range(first, first + 10))}), where / "ds" / "part-0.parquet")
    d = Daemon(tmp_path / "run", cwd=daemon_cwd).start()
    try:
        monkeypatch.chdir(client_cwd)
        assert sorted(read_ids("ds", d.addr)) == list(range(10))
        assert sorted(read_ids("ds/part-*.parquet", d.addr)) == list(range(10))
        monkeypatch.setenv("HOME", str(client_cwd))
        assert sorted(read_ids("~/ds/", d.addr)) == list(range(10))
        staged = subprocess.run(
            [str(SHARDSTREAM), "prefetch", "ds", "--cache", "copy", "--connect", d.addr],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert staged.returncode == 0, staged.stderr
        assert str(client_cwd / "ds") in staged.stdout + staged.stderr, staged.stdout + staged.stderr
        # A quoted `~` (a Kubernetes exec-form command, a job's SHARDSTREAM_DATASET) reaches the
        # command unexpanded: the home directory's `ds`, as the Loader reads it, from any directory.
        home = subprocess.run(
            [str(SHARDSTREAM), "prefetch", "~/ds", "--cache", "copy", "--connect", d.addr],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert home.returncode == 0, home.stderr
        assert str(client_cwd / "ds") in home.stdout + home.stderr, home.stdout + home.stderr
        # The daemon's refusal reads as its message, once, as `status` prints it (not a gRPC dump).
        missing = subprocess.run(
            [str(SHARDSTREAM), "prefetch", "gone", "--cache", "copy", "--connect", d.addr],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert missing.returncode == 1
        assert missing.stderr == f"shardstream: error: dataset not found: {client_cwd / 'gone'}\n", missing.stderr
        # A local dataset is read in place unless asked otherwise: the advice is in the CLI's words.
        in_place = subprocess.run(
            [str(SHARDSTREAM), "prefetch", "ds", "--connect", d.addr], capture_output=True, text=True, timeout=60
        )
        assert in_place.returncode == 1
        assert "nothing to stage. Stage it with `shardstream prefetch --cache copy`" in in_place.stderr, in_place.stderr
        nowhere = subprocess.run(
            [str(SHARDSTREAM), "prefetch", "ds", "--connect", f"unix://{tmp_path / 'no.sock'}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert nowhere.returncode == 1 and nowhere.stderr.count("\n") == 1, nowhere.stderr
        assert nowhere.stderr.count("No such file or directory") == 1, nowhere.stderr
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_shard_file_is_a_dataset_of_one_and_a_directory_named_like_one_is_a_directory(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # `pd.read_parquet("train.parquet")`, `load_dataset("parquet", data_files=...)` and
    # `wds.WebDataset("shard.tar")` take one file; Spark writes a *directory* named `out.parquet`.
    if where == "local":
        base, addr = tmp_path, daemon.addr
        url = str(base)
    else:
        base, addr = s3.bucket("hub") / "single", s3_daemon.addr
        url = "s3://hub/single"
    ids = write_hub_layout(base / "data")
    first = sorted(ids["train"])[:30]
    assert sorted(read_ids(f"{url}/data/train-00000-of-00002.parquet", addr)) == first
    spark = base / "out.parquet"
    spark.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"id": [100 + i, 200 + i]}), spark / f"part-{i:05d}.snappy.parquet")
    assert sorted(read_ids(f"{url}/out.parquet/", addr)) == [100, 101, 200, 201]
    if where == "local":
        assert sorted(read_ids(f"{url}/out.parquet", addr)) == [100, 101, 200, 201]
    else:
        # No request can tell an S3 object from a prefix of that name in advance: the URL says.
        with pytest.raises(FileNotFoundError, match=r"out\.parquet/.*end the URL with '/'"):
            read_ids(f"{url}/out.parquet", addr)
    with wds.TarWriter(str(base / "one.tar")) as sink:
        for i in range(5):
            sink.write({"__key__": f"s{i}", "cls": b"1"})
    keys = [k for b in shardstream.Loader(f"{url}/one.tar", batch_size=2, connect=addr) for k in b["__key__"]]
    assert sorted(keys) == [f"s{i}" for i in range(5)]
    (base / "notes.txt").write_text("not a shard\n")
    with pytest.raises((ValueError, FileNotFoundError), match="notes.txt"):
        read_ids(f"{url}/notes.txt", addr)
    if where == "local":
        # Read as directories, these said "cannot read manifest .../manifest.json: Not a directory".
        os.mkfifo(base / "fifo.tar")
        with pytest.raises(ValueError, match=r"fifo\.tar is not a regular file nor a directory \(a FIFO"):
            read_ids(f"{url}/fifo.tar", addr)
        (base / "loop").symlink_to(base / "loop")
        with pytest.raises(OSError, match=r"cannot open dataset .*loop: Too many levels of symbolic links"):
            read_ids(f"{url}/loop", addr)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_shard_whose_name_reads_as_a_glob_is_that_shard(daemon, s3, s3_daemon, tmp_path: Path, where: str) -> None:
    # `run[1].parquet` (as some job schedulers name outputs) read as a glob matched only
    # `run1.parquet`, and the file itself was "not found". A name matches itself too.
    base, url, addr = place(where, "brackets", tmp_path, daemon, s3, s3_daemon)
    base.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [7, 8]}), base / "run[1].parquet")
    assert sorted(read_ids(f"{url.rstrip('/')}/run[1].parquet", addr)) == [7, 8]
    # A glob still matches as one: beside `run1.parquet`, both (another place: an S3 dataset's
    # listing is reused for a minute).
    base, url, addr = place(where, "brackets2", tmp_path, daemon, s3, s3_daemon)
    base.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [7, 8]}), base / "run[1].parquet")
    pq.write_table(pa.table({"id": [1]}), base / "run1.parquet")
    assert sorted(read_ids(f"{url.rstrip('/')}/run[1].parquet", addr)) == [1, 7, 8]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_directory_of_compressed_shards_says_they_are_not_served(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # webdataset reads `.tar.gz` shards; shardstream serves members in place, which compression
    # rules out. "holds none" would send the user looking for a wrong path.
    root, url, addr = place(where, "gz", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    for i in range(3):
        with wds.TarWriter(str(root / f"shard-{i:06d}.tar.gz"), compress=True) as sink:
            sink.write({"__key__": f"k{i}", "cls": b"1"})
    (root / "README.md").write_text("about\n")
    with pytest.raises(FileNotFoundError, match=r"3 files ending in \.tar\.gz.*uncompressed") as e:
        read_ids(url, addr)
    assert "README" not in str(e.value), e.value


@pytest.mark.parametrize("where", ["local", "s3"])
def test_compressed_shards_beside_plain_ones_are_refused_not_left_out(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # Half a dataset, silently: the .tar shards were served and the .tar.gz ones beside them left
    # out, and `shardstream index` wrote a manifest of the half.
    root, url, addr = place(where, "halfgz", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    for i in range(4):
        with wds.TarWriter(str(root / f"shard-{i:06d}.tar{'.gz' if i % 2 else ''}"), compress=bool(i % 2)) as sink:
            sink.write({"__key__": f"k{i}", "cls": str(i).encode()})
    match = (
        r"2 files ending in \.tar\.gz \(shard-000001\.tar\.gz, shard-000003\.tar\.gz\) beside"
        r".*uncompressed.*\*\.tar"
    )
    with pytest.raises(ValueError, match=match):
        shardstream.Loader(url, connect=addr)
    keys = [k for b in shardstream.Loader(f"{url.rstrip('/')}/*.tar", connect=addr) for k in b["__key__"]]
    assert sorted(keys) == ["k0", "k2"]
    if where == "local":
        out = subprocess.run([SHARDSTREAM, "index", str(root)], capture_output=True, text=True)
        assert out.returncode != 0 and "shard-000001.tar.gz" in out.stderr, out
        assert not (root / "manifest.json").exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_parquet_files_named_otherwise_are_named_in_the_error(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # pyarrow writes whatever name it is given (`x.pq`, `y.parq`); the listing goes by the
    # `.parquet` extension, and "the directory holds none" hid the files that are there.
    root, url, addr = place(where, "pqnames", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), root / "part-0.pq")
    pq.write_table(pa.table({"id": [3, 4]}), root / "part-1.pq")
    pq.write_table(pa.table({"id": [5, 6]}), root / "part-2.parq")
    with pytest.raises(FileNotFoundError, match=r"3 files ending in \.pq or \.parq.*\*\.parquet") as e:
        read_ids(url, addr)
    assert "holds none" in str(e.value), e.value


@pytest.mark.parametrize("where", ["local", "s3"])
def test_parquet_files_named_otherwise_beside_parquet_ones_are_refused_not_left_out(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # A directory written by two tools, `*.parquet` beside `*.pq`: the listing served the first
    # and left out the others without a word (a third of the rows here).
    root, url, addr = place(where, "pqbeside", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), root / "part-0.parquet")
    pq.write_table(pa.table({"id": [3, 4]}), root / "part-1.parquet")
    pq.write_table(pa.table({"id": [5, 6]}), root / "extra-0.pq")
    with pytest.raises(
        ValueError, match=r"1 file ending in \.pq or \.parq \(extra-0\.pq\) beside.*rename.*\*\.parquet"
    ):
        shardstream.Loader(url, connect=addr)
    assert sorted(read_ids(f"{url.rstrip('/')}/part-*.parquet", addr)) == [1, 2, 3, 4]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_shard_extensions_in_capitals_are_shards(daemon, s3, s3_daemon, tmp_path: Path, where: str) -> None:
    # Files copied from tools or file systems that name in capitals (`PART-0.PARQUET`,
    # `SHARD.TAR`) were not shards: beside lower-case ones they were left out without a word,
    # alone they made "holds none" of a directory full of them.
    root, url, addr = place(where, "caps", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), root / "part-0.parquet")
    pq.write_table(pa.table({"id": [3, 4]}), root / "PART-1.PARQUET")
    pq.write_table(pa.table({"id": [5]}), root / "Part-2.Parquet")
    assert sorted(read_ids(url, addr)) == [1, 2, 3, 4, 5]
    assert sorted(read_ids(f"{url.rstrip('/')}/PART-1.PARQUET", addr)) == [3, 4]
    tars, tar_url, _ = place(where, "capstar", tmp_path, daemon, s3, s3_daemon)
    tars.mkdir()
    for i, name in enumerate(["a.tar", "B.TAR"]):
        with wds.TarWriter(str(tars / name)) as sink:
            sink.write({"__key__": f"k{i}", "cls": str(i).encode()})
    keys = [k for b in shardstream.Loader(tar_url, connect=addr) for k in b["__key__"]]
    assert sorted(keys) == ["k0", "k1"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_files_without_an_extension_are_named_in_the_error(daemon, s3, s3_daemon, tmp_path: Path, where: str) -> None:
    # Hive names a table's data files `000000_0` (Hadoop jobs `part-00000`), Parquet or not, with no
    # extension; the listing goes by the extension, and "the directory holds none" did not say
    # what it does hold.
    root, url, addr = place(where, "hive", tmp_path, daemon, s3, s3_daemon)
    root.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"id": [i]}), root / f"00000{i}_0")
    (root / "README.md").write_text("about\n")
    with pytest.raises(FileNotFoundError, match=r"2 files without an extension \(000000_0, 000001_0\).*\*\.parquet"):
        read_ids(url, addr)


def s3_lists(port: int) -> int:
    """S3 listing requests the daemon has made (its `kind="list"` request counter)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("shardstream_storage_requests_total{") and 'kind="list"' in line
    )


def test_named_shards_on_s3_list_only_what_their_names_share(s3, tmp_path: Path) -> None:
    # A brace pattern or one shard's name under a prefix of thousands of other objects: the
    # listing starts at what the names share, one page, not every page of the prefix.
    from s3server import free_port

    root = s3.bucket("hub") / "many"
    root.mkdir()
    for i in range(2100):  # three pages of 1,000 keys
        (root / f"junk-{i:05d}.bin").write_bytes(b"")
    for i in range(3):
        with wds.TarWriter(str(root / f"a-{i:06d}.tar")) as sink:
            sink.write({"__key__": f"k{i}", "cls": b"1"})
    port = free_port()
    d = Daemon(tmp_path, args=["--metrics-addr", f"127.0.0.1:{port}"], env=s3.env()).start()
    try:
        for url, keys in [
            ("s3://hub/many/a-{000000..000001}.tar", {"k0", "k1"}),
            ("s3://hub/many/a-000002.tar", {"k2"}),
        ]:
            before = s3_lists(port)
            got = {k for b in shardstream.Loader(url, batch_size=4, connect=d.addr) for k in b["__key__"]}
            assert got == keys, url
            assert s3_lists(port) - before == 1, url
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_hidden_and_underscore_files_beside_the_shards_are_left_out(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # A dataset copied from a Mac carries an AppleDouble `._name` file beside each shard (4 KiB of
    # resource fork under the shard's extension); job outputs leave `_`-prefixed files. pyarrow.dataset
    # and Spark leave names starting with '.' or '_' out of a directory; the daemon took them for
    # shards and failed the epoch on them.
    root, url, addr = place(where, "copied", tmp_path, daemon, s3, s3_daemon)
    root.mkdir(parents=True)
    for i in range(2):
        pq.write_table(pa.table({"id": list(range(5 * i, 5 * i + 5))}), root / f"part-{i}.parquet")
        (root / f"._part-{i}.parquet").write_bytes(APPLE_DOUBLE)
    (root / "_tmp-part-2.parquet").write_bytes(b"PAR1 half written")
    assert sorted(read_ids(url, addr)) == list(range(10))
    # Only hidden ones: said so, with the way to read them anyway.
    only, only_url, _ = place(where, "only-hidden", tmp_path, daemon, s3, s3_daemon)
    only.mkdir()
    pq.write_table(pa.table({"id": [1]}), only / "_part-0.parquet")
    with pytest.raises(FileNotFoundError, match=r"_part-0\.parquet.*start with '\.' or '_'"):
        read_ids(only_url, addr)
    # A shard named explicitly is read whatever its name.
    assert read_ids(only_url.rstrip("/") + "/_part-0.parquet", addr) == [1]


def test_hidden_webdataset_shards_are_left_out_too(daemon, tmp_path: Path) -> None:
    with wds.ShardWriter(str(tmp_path / "shard-%06d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(20):
            sink.write({"__key__": f"{i:04d}", "cls": str(i).encode()})
    (tmp_path / "._shard-000000.tar").write_bytes(APPLE_DOUBLE)
    keys = [k for b in shardstream.Loader(str(tmp_path), batch_size=8, connect=daemon.addr) for k in b["__key__"]]
    assert sorted(keys) == [f"{i:04d}" for i in range(20)]


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("partitioned", [False, True], ids=["flat", "partitioned"])
def test_a_delta_lake_table_is_refused_for_the_rows_it_removed(
    daemon, s3, s3_daemon, tmp_path: Path, where: str, partitioned: bool
) -> None:
    # A Delta table's directory keeps the files an overwrite (or DELETE, UPDATE) removed until
    # VACUUM: its Parquet files are not its rows. Served as files, the epoch would train on both.
    from deltalake import write_deltalake

    root, url, addr = place(where, f"delta-{partitioned}", tmp_path, daemon, s3, s3_daemon)
    by = ["year"] if partitioned else None
    write_deltalake(str(root), pa.table({"id": [1, 2, 3], "year": [2020, 2020, 2021]}), partition_by=by)
    write_deltalake(str(root), pa.table({"id": [10, 20], "year": [2021, 2021]}), partition_by=by, mode="overwrite")
    with pytest.raises(ValueError, match="Delta Lake table") as e:
        read_ids(url, addr)
    assert "_delta_log" in str(e.value), e.value
    if not partitioned:
        # A glob serves the files there knowingly, removed ones included.
        assert sorted(read_ids(url.rstrip("/") + "/*.parquet", addr)) == [1, 2, 3, 10, 20]


def write_iceberg_table(root: Path, partitioned: bool, catalog_dir: Path) -> list[int]:
    """An Iceberg table at `root` written by pyiceberg (a SQLite catalog in `catalog_dir`): three
    rows, then an overwrite with two, so that `data/` keeps the first snapshot's files. Returns the
    ids of the table's current snapshot."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog("t", uri=f"sqlite:///{catalog_dir / 'catalog.db'}", warehouse=f"file://{catalog_dir}")
    catalog.create_namespace_if_not_exists("ns")
    first = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "year": pa.array([2020, 2020, 2021], pa.int64())})
    table = catalog.create_table(f"ns.{root.name.replace('-', '_')}", schema=first.schema, location=f"file://{root}")
    if partitioned:
        with table.update_spec() as spec:
            spec.add_identity("year")
    table.append(first)
    table.overwrite(pa.table({"id": pa.array([10, 20], pa.int64()), "year": pa.array([2021, 2021], pa.int64())}))
    return sorted(table.scan().to_arrow().column("id").to_pylist())


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("partitioned", [False, True], ids=["flat", "partitioned"])
def test_an_iceberg_table_is_refused_for_the_rows_its_snapshot_dropped(
    daemon, s3, s3_daemon, tmp_path: Path, where: str, partitioned: bool
) -> None:
    # An Iceberg table keeps under data/ the files an overwrite, delete or compaction dropped from
    # its current snapshot, until the snapshots expire; only metadata/ says which files are
    # current. Named by its directory, the daemon said to name data/ instead; data/ was served as
    # a directory of Parquet files, dropped rows and all.
    root, url, addr = place(where, f"iceberg-{partitioned}", tmp_path, daemon, s3, s3_daemon)
    assert write_iceberg_table(root, partitioned, tmp_path) == [10, 20]
    data_url = url.rstrip("/") + "/data" + ("/" if where == "s3" else "")
    for named in (url, data_url):
        with pytest.raises(ValueError, match="Iceberg table") as e:
            read_ids(named, addr)
        assert "metadata/" in str(e.value) and "pyiceberg" in str(e.value), e.value
    if not partitioned:
        # A glob serves the files there knowingly, dropped ones included.
        assert sorted(read_ids(data_url.rstrip("/") + "/*.parquet", addr)) == [1, 2, 3, 10, 20]
    if where == "local":
        # `index` lists the same way, so it writes no manifest that would serve them later.
        out = subprocess.run([SHARDSTREAM, "index", data_url], capture_output=True, text=True)
        assert out.returncode != 0 and "Iceberg table" in out.stderr, out.stderr
        assert not (root / "data" / "manifest.json").exists()
