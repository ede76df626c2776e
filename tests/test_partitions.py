"""Hive-partitioned Parquet directories (`year=2020/part-0.parquet`, as pyarrow's
`write_to_dataset`, Spark's `partitionBy` and Hive write them): served whole, with each partition
key as a column of the type pyarrow.dataset infers, locally and on the real S3 server, listed or
indexed; and the layouts that are not one dataset refused by name."""

from __future__ import annotations

import collections
import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch.utils.data
from s3server import S3Server
from test_bounds import free_port, scrape
from test_parquet import daemon_maps, prefetch

import shardstream
import shardstream.torch as sst
from conftest import SHARDSTREAM, Daemon, kept_row_groups, within

ROWS = 240


def write_partitioned(root: Path) -> None:
    """`ROWS` rows partitioned by an int year and a string region whose values need escaping (a
    space, a '/', a null), plus what jobs leave beside them: `_SUCCESS`, a `_temporary/` file."""
    rng = np.random.default_rng(5)
    regions = ["eu west", "us/east", None]
    table = pa.table(
        {
            "id": pa.array(range(ROWS), pa.int64()),
            "x": pa.array(rng.random(ROWS), pa.float64()),
            "caption": pa.array([f"row {i}" for i in range(ROWS)]),
            "year": pa.array([2020 + i % 3 for i in range(ROWS)], pa.int64()),
            "region": pa.array([regions[i % 7 % 3] for i in range(ROWS)]),
        }
    )
    pq.write_to_dataset(table, str(root), partition_cols=["year", "region"], row_group_size=16)
    (root / "_SUCCESS").write_bytes(b"")
    (root / "_temporary" / "0").mkdir(parents=True)
    pq.write_table(table.slice(0, 3), root / "_temporary" / "0" / "part-9.parquet")


def expected(root: Path) -> pa.Table:
    return pads.dataset(str(root), partitioning="hive").to_table()


def by_id(t: pa.Table) -> list[dict]:
    return sorted(t.to_pylist(), key=lambda r: r["id"])


def served(url: str, addr: str, **kw) -> pa.Table:
    batches = list(shardstream.Loader(url, batch_size=13, connect=addr, format="arrow", **kw))
    return pa.Table.from_batches(batches).drop_columns(["__row__"])


@pytest.fixture(scope="module")
def s3_daemon(s3: S3Server, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("partitions-s3"), env=s3.env()).start()
    yield d
    assert d.stop() == 0


def place(where: str, name: str, tmp_path: Path, daemon, s3, s3_daemon) -> tuple[Path, str, str]:
    if where == "local":
        return tmp_path / name, str(tmp_path / name), daemon.addr
    return s3.bucket("parts") / name, f"s3://parts/{name}/", s3_daemon.addr


def partitioned_place(where: str, name: str, tmp_path: Path, daemon, s3, s3_daemon) -> tuple[Path, str, str, pa.Table]:
    """`write_partitioned` at a new place: its root, URL, daemon, and the table pyarrow.dataset
    reads there (read before anything else is written beside the files)."""
    root, url, addr = place(where, name, tmp_path, daemon, s3, s3_daemon)
    write_partitioned(root)
    return root, url, addr, expected(root)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_partitioned_directory_is_served_with_its_keys_as_columns(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    _, url, addr, want = partitioned_place(where, "parted", tmp_path, daemon, s3, s3_daemon)
    got = served(url, addr)
    assert got.schema.names == want.schema.names == ["id", "x", "caption", "year", "region"]
    assert got.schema.field("year").type == pa.int32() and got.schema.field("region").type == pa.string()
    assert by_id(got) == by_id(want)
    # A selection names partition keys like any column, in its own order.
    picked = served(url, addr, fields=["region", "id", "year"])
    assert picked.schema.names == ["region", "id", "year"]
    assert by_id(picked) == by_id(want.select(["region", "id", "year"]))
    # The dict form carries them too (the torch tensors: the two-rank test below).
    years = {}
    for b in shardstream.Loader(url, batch_size=13, connect=addr, fields=["id", "year", "region"]):
        for i, y, r in zip(b["id"].tolist(), b["year"].tolist(), b["region"], strict=True):
            years[i] = (y, r)
    assert years == {r["id"]: (r["year"], r["region"]) for r in want.to_pylist()}


def test_only_partition_keys_selected_reads_rows_and_no_column(daemon, tmp_path: Path) -> None:
    root = tmp_path / "keys"
    write_partitioned(root)
    got = served(str(root), daemon.addr, fields=["year"])
    assert sorted(got.column("year").to_pylist()) == sorted(expected(root).column("year").to_pylist())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_indexed_partitioned_directory_serves_the_same_rows(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    # `want` is read before the manifest, which pyarrow.dataset would take for a Parquet file.
    root, url, addr, want = partitioned_place(where, "indexed", tmp_path, daemon, s3, s3_daemon)
    env = s3.env() if where == "s3" else None
    p = subprocess.run([SHARDSTREAM, "index", url], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert "fields: caption, id, x; partition keys: year, region;" in p.stdout, p.stdout
    names = sorted(s["name"] for s in json.loads((root / "manifest.json").read_text())["shards"])
    assert names == sorted(str(f.relative_to(root)) for f in root.glob("year=*/region=*/*.parquet"))
    assert all(n.startswith("year=") for n in names), names
    assert by_id(served(url, addr)) == by_id(want)


def test_two_ranks_two_workers_exactly_once_with_partition_tensors(daemon, tmp_path: Path) -> None:
    root = tmp_path / "ranks"
    write_partitioned(root)
    year_of = {r["id"]: r["year"] for r in expected(root).to_pylist()}
    seen: collections.Counter[int] = collections.Counter()
    for rank in range(2):
        ds = sst.IterableDataset(
            str(root), batch_size=10, seed=3, rank=rank, world_size=2, connect=daemon.addr, fields=["id", "year"]
        )
        for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
            assert batch["year"].dtype == torch.int32
            ids = batch["id"].tolist()
            assert batch["year"].tolist() == [year_of[i] for i in ids]
            seen.update(ids)
    assert seen == collections.Counter(range(ROWS))


def test_keys_that_differ_between_directories_are_refused_naming_both(daemon, tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    for sub, first in (("year=2020", 0), ("month=1", 10)):
        (root / sub).mkdir(parents=True)
        pq.write_table(pa.table({"id": list(range(first, first + 10))}), root / sub / "part-0.parquet")
    with pytest.raises(ValueError, match="partition") as e:
        served(str(root), daemon.addr)
    assert "year=2020/part-0.parquet" in str(e.value) and "month=1/part-0.parquet" in str(e.value), e.value


def test_partitions_written_by_polars_keep_their_keys_in_the_files_and_are_served_from_them(
    daemon, tmp_path: Path
) -> None:
    # Polars' `write_parquet(partition_by=...)` writes each key into the files as well as into the
    # directory names. pyarrow.dataset then fails ("Field year has incompatible types: int64 vs
    # int32"); Polars reads the files' own columns. The daemon refused the key as a column.
    import polars as pl

    root = tmp_path / "polars"
    i = np.arange(ROWS)
    regions = ["eu west" if k % 2 else "us/east" for k in i]
    pl.DataFrame({"id": i, "year": 2020 + i % 3, "region": regions}).write_parquet(
        root, partition_by=["year", "region"]
    )
    want = pl.read_parquet(root, hive_partitioning=True)
    got = served(str(root), daemon.addr)
    assert got.schema.names == ["id", "year", "region"]
    assert got.schema.field("year").type == pa.int64(), "the files' type, as Polars reads it"
    assert by_id(got) == sorted(want.to_dicts(), key=lambda r: r["id"])
    # A key selected alone is read from the files too.
    assert sorted(served(str(root), daemon.addr, fields=["year"]).column("year").to_pylist()) == sorted(want["year"])
    # A file whose column says otherwise than its directory (moved to another partition by hand)
    # is refused at open, naming the file, the key and both values: the footer's statistics say.
    moved = next((root / "year=2020").rglob("*.parquet"))
    moved.rename(root / "year=2021" / moved.parent.name / "moved.parquet")
    with pytest.raises(ValueError, match="moved.parquet") as e:
        served(str(root), daemon.addr)
    assert '"year"' in str(e.value) and "2020" in str(e.value) and "2021" in str(e.value), e.value


def test_a_key_that_is_a_column_of_some_files_only_is_refused_naming_it(daemon, tmp_path: Path) -> None:
    root = tmp_path / "twice"
    for year, first, with_key in ((2020, 0, True), (2021, 10, False)):
        (root / f"year={year}").mkdir(parents=True)
        cols = {"id": list(range(first, first + 3))} | ({"year": [year] * 3} if with_key else {})
        pq.write_table(pa.table(cols), root / f"year={year}" / "part-0.parquet")
    with pytest.raises(ValueError, match='"year"') as e:
        served(str(root), daemon.addr)
    assert "year=2021/part-0.parquet" in str(e.value), e.value


def test_a_partition_is_still_a_dataset_of_its_own_without_the_key(daemon, tmp_path: Path) -> None:
    root = tmp_path / "one"
    write_partitioned(root)
    got = served(str(root / "year=2021"), daemon.addr)
    assert got.schema.names == ["id", "x", "caption", "region"]
    want = pads.dataset(str(root / "year=2021"), partitioning="hive").to_table()
    assert by_id(got) == by_id(want)


def test_a_file_added_to_a_partition_is_in_the_next_open(daemon, tmp_path: Path) -> None:
    # The daemon trusts a listing while the dataset's directory keeps its mtime; a file added in
    # `year=2021/region=x/` moves that directory's mtime only.
    root = tmp_path / "grows"
    write_partitioned(root)
    assert len(served(str(root), daemon.addr)) == ROWS
    part = next(root.glob("year=2021/region=*"))
    pq.write_table(pa.table({"id": [ROWS], "x": [0.5], "caption": ["late"]}), part / "late.parquet")
    got = served(str(root), daemon.addr)
    assert len(got) == ROWS + 1 and ROWS in got.column("id").to_pylist()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_shards_beside_partitions_are_refused_and_a_glob_picks_them(
    daemon, s3, s3_daemon, tmp_path: Path, where: str
) -> None:
    root, url, addr = place(where, "beside", tmp_path, daemon, s3, s3_daemon)
    write_partitioned(root)
    pq.write_table(pa.table({"id": [1000, 1001]}), root / "stray.parquet")
    with pytest.raises(ValueError, match="beside partition directories") as e:
        served(url, addr)
    assert "stray.parquet" in str(e.value) and "year=20" in str(e.value), e.value
    assert served(url.rstrip("/") + "/*.parquet", addr).column("id").to_pylist() == [1000, 1001]


def test_a_split_partition_is_a_column_not_a_mix_of_splits(daemon, tmp_path: Path) -> None:
    # Files named by split beside each other are refused (test_dataset_urls.py); a `split=`
    # partition puts the split in every row, where the trainer can see it.
    root = tmp_path / "splits"
    t = pa.table({"id": list(range(20)), "split": ["train"] * 15 + ["test"] * 5})
    pq.write_to_dataset(t, str(root), partition_cols=["split"])
    got = served(str(root), daemon.addr)
    assert by_id(got) == by_id(expected(root))
    assert got.schema.field("split").type == pa.string()


def test_partition_columns_survive_row_groups_kept_on_disk_past_the_decoded_budget(tmp_path: Path) -> None:
    # Past `--decoded-budget`, a stream's decoded row groups (key columns included) are written
    # to the node cache and served from there by later epochs.
    root = tmp_path / "big"
    rng = np.random.default_rng(2)
    blobs = [rng.integers(0, 256, 5120, dtype=np.uint8).tobytes() for _ in range(1200)]
    t = pa.table(
        {
            "id": pa.array(range(1200), pa.int64()),
            "payload": pa.array(blobs, pa.binary()),
            "shard": [f"s{i % 3}" for i in range(1200)],
        }
    )
    pq.write_to_dataset(t, str(root), partition_cols=["shard"], row_group_size=100, compression="none")
    d = Daemon(tmp_path / "d", args=["--decoded-budget", "1MiB"]).start()

    def epoch(seed: int) -> None:
        seen = set()
        for b in shardstream.Loader(str(root), batch_size=50, seed=seed, connect=d.addr, transport="shm"):
            ids = [int(i) for i in b["id"]]
            assert [bytes(p) for p in b["payload"]] == [blobs[i] for i in ids]
            assert b["shard"] == [f"s{i % 3}" for i in ids]
            seen.update(ids)
        assert seen == set(range(1200))

    try:
        epoch(1)
        epoch(2)
        shards = d.cache_dir / "shards"
        kept = kept_row_groups(d, 12)
        epoch(3)
        assert daemon_maps(d, shards) & kept, "the third epoch read no kept row group"
    finally:
        assert d.stop() == 0


def test_a_partitioned_s3_prefix_staged_by_prefetch_with_a_key_downloads_nothing_more(
    s3, s3_daemon, tmp_path: Path
) -> None:
    root = s3.bucket("parts") / "staged"
    write_partitioned(root)
    want = expected(root)
    url = "s3://parts/staged/"
    p = prefetch(s3_daemon.addr, url, "--fields", "id,year")
    assert p.returncode == 0, p.stderr
    before = s3_daemon.status()
    assert by_id(served(url, s3_daemon.addr, fields=["id", "year"])) == by_id(want.select(["id", "year"]))
    after = s3_daemon.status()
    assert (after["storage_requests"], after["storage_bytes"]) == (
        before["storage_requests"],
        before["storage_bytes"],
    ), (before, after)


def test_a_reopen_stats_the_partition_directories_and_lists_nothing(tmp_path: Path) -> None:
    root = tmp_path / "reopen"
    write_partitioned(root)  # 3 years x 3 regions: 12 partition directories
    dirs = {p.parent for p in root.glob("year=*/region=*/*.parquet")} | set(root.glob("year=*"))
    port = free_port()
    d = Daemon(tmp_path / "d", args=["--metrics-addr", f"127.0.0.1:{port}"]).start()
    try:
        conn = shardstream._native.Connection(d.addr)
        assert conn.open(str(root))["num_samples"] == ROWS
        m = scrape(port)
        # One listing for the dataset's directory and one for each partition directory.
        assert m["shardstream_local_lists_total"] == 1 + len(dirs), m
        for _ in range(5):
            conn.open(str(root))
        after = scrape(port)
        assert after["shardstream_local_lists_total"] == m["shardstream_local_lists_total"]
        # And 8 of its files each, spread over it (a dataset rewritten in place leaves every
        # directory's time as it was).
        files = len(list(root.glob("year=*/region=*/*.parquet")))
        spots = min(8, files)
        assert after["shardstream_local_stats_total"] - m["shardstream_local_stats_total"] == 5 * (
            2 + len(dirs) + spots
        )
        assert after["shardstream_dataset_builds_total"] == 1
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("link", ["loops", "twin"])
def test_a_directory_met_twice_through_a_symlink_is_refused_not_walked_again(
    own_daemon, tmp_path: Path, link: str
) -> None:
    # Symbolic links that lead back up the tree make every level of the walk list the whole tree
    # again, once per link (two links: 2^40 listings before the kernel's ELOOP); one that leads
    # to a sibling partition would serve its files twice under two keys.
    root = tmp_path / link
    write_partitioned(root)
    if link == "loops":
        for year in ("2020", "2021"):
            (root / f"year={year}" / "year=2030").symlink_to(root, target_is_directory=True)
    else:
        (root / "year=2030").symlink_to(root / "year=2020", target_is_directory=True)
    got = within(60, lambda: served(str(root), own_daemon.addr))
    assert isinstance(got, ValueError), got
    assert "symbolic link" in str(got) and "year=2030" in str(got), got
