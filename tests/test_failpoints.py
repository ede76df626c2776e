"""Failpoints end to end: a daemon built with `--features failpoints` (SHARDSTREAM_FAIL_BIN, or built
by scripts/failpoint-bin.sh when unset), one point armed per test through FAILPOINTS, and what a
trainer then sees: a named error or a transparent retry, never a wrong byte, never a hang (every
epoch runs under a deadline). The unit-level points are tripped by server/tests/failpoints.rs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from s3server import S3Server

import shardstream
from conftest import SHARDSTREAM, Daemon, wait_for, within, write_dataset

Samples = dict[str, dict[str, bytes]]

# No epoch of these small datasets takes more than a few seconds; one that takes a minute hangs.
DEADLINE = 60.0


@pytest.fixture(scope="session")
def fail_bin() -> str:
    path = os.environ.get("SHARDSTREAM_FAIL_BIN")
    if not path:
        built = subprocess.run(["bash", "scripts/failpoint-bin.sh"], capture_output=True, text=True, check=True)
        path = built.stdout.strip()
    assert os.access(path, os.X_OK), f"failpoint build {path!r} is not executable"
    return path


@pytest.fixture(scope="module")
def remote(s3: S3Server) -> Samples:
    """6 shards in s3://fpts/plain/ (no manifest)."""
    return write_dataset(s3.bucket("fpts") / "plain", n=300, per_shard=50, seed=5)


@pytest.fixture(scope="module")
def indexed(s3: S3Server) -> Samples:
    """6 shards in s3://fpts/indexed/ with a manifest (CRC-32C per shard) by `shardstream index`."""
    samples = write_dataset(s3.bucket("fpts") / "indexed", n=300, per_shard=50, seed=6)
    p = subprocess.run(
        [SHARDSTREAM, "index", "s3://fpts/indexed/"],
        env={**os.environ, **s3.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return samples


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Samples]:
    root = tmp_path_factory.mktemp("fp-local")
    return root, write_dataset(root, n=300, per_shard=50, seed=7)


def start(tmp: Path, fail_bin: str, failpoints: str, env: dict[str, str] | None = None) -> Daemon:
    return Daemon(tmp, env={**(env or {}), "FAILPOINTS": failpoints}, binary=fail_bin).start()


def epoch(addr: str, url: str, **kw) -> Samples:
    """One epoch's samples by key; asserts no key comes twice."""
    got: Samples = {}
    for batch in shardstream.Loader(url, batch_size=16, seed=1, connect=addr, **kw):
        for i, key in enumerate(batch["__key__"]):
            assert key not in got, f"{key} delivered twice"
            got[key] = {f: bytes(v[i]) for f in ("jpg", "cls") if (v := batch.get(f)) and v[i] is not None}
    return got


def stop(d: Daemon) -> None:
    assert d.stop() == 0, "the daemon did not shut down cleanly after the fault"


def test_failpoint_local_read_error_fails_the_stream_naming_the_shard(tmp_path, fail_bin, local) -> None:
    root, _ = local
    d = start(tmp_path, fail_bin, "local-read=3*off->return(EIO)")
    got = within(DEADLINE, lambda: epoch(d.addr, str(root), transport="inline"))
    assert isinstance(got, (OSError, shardstream.ShardstreamError)), got
    assert "cannot read shard" in str(got) and str(root) in str(got) and ".tar" in str(got), got
    stop(d)


def test_failpoint_s3_body_breaks_are_resumed_with_identical_bytes(tmp_path, fail_bin, s3, remote) -> None:
    d = start(tmp_path, fail_bin, "s3-get-body=25%return", env=s3.env())
    got = within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/plain/"))
    assert got == remote
    assert d.status()["storage_retries"] > 0, "no body broke: the failpoint did not fire"
    stop(d)


def test_failpoint_s3_wrong_bytes_are_caught_by_the_manifest_crc(tmp_path, fail_bin, s3, indexed) -> None:
    d = start(tmp_path, fail_bin, "s3-get-corrupt=2*return", env=s3.env())
    assert within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/indexed/")) == indexed
    stop(d)
    # Every fetch corrupt: a named shard error, not wrong bytes.
    d = start(tmp_path / "always", fail_bin, "s3-get-corrupt=return", env=s3.env())
    got = within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/indexed/"))
    assert isinstance(got, shardstream.ShardError), got
    assert got.shard.startswith("s3://fpts/indexed/") and "crc32c" in str(got), got
    stop(d)


def test_failpoint_s3_wrong_bytes_without_a_manifest_are_never_served(tmp_path, fail_bin, s3, remote) -> None:
    # No manifest, so no CRC to check: the ETag (the MD5 of a single-part object) is what catches
    # a body whose bytes changed in transit.
    d = start(tmp_path, fail_bin, "s3-get-corrupt=2*return", env=s3.env())
    assert within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/plain/")) == remote
    stop(d)


def test_failpoint_cache_disk_full_is_absorbed_or_named(tmp_path, fail_bin, s3, remote) -> None:
    # The disk fills twice: the cache lowers its capacity, evicts, and fills again.
    d = start(tmp_path, fail_bin, "cache-fill=2*return(ENOSPC)", env=s3.env())
    assert within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/plain/")) == remote
    stop(d)
    # The disk stays full: a named error naming the cache directory.
    d = start(tmp_path / "full", fail_bin, "cache-fill=return(ENOSPC)", env=s3.env())
    got = within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/plain/"))
    assert isinstance(got, shardstream.ShardstreamError), got
    assert "ran out of disk space" in str(got) and str(d.cache_dir) in str(got), got
    stop(d)


def test_failpoint_cache_fsync_error_is_named(tmp_path, fail_bin, s3, remote) -> None:
    d = start(tmp_path, fail_bin, "cache-fsync=return(EIO)", env=s3.env())
    got = within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/plain/"))
    assert isinstance(got, (OSError, shardstream.ShardstreamError)), got
    assert "cannot sync cache file" in str(got), got
    stop(d)


def test_failpoint_sidecar_write_failure_only_costs_a_rescan(tmp_path, fail_bin, local) -> None:
    root, samples = local
    d = start(tmp_path, fail_bin, "sidecar-write=return(ENOSPC)")
    assert within(DEADLINE, lambda: epoch(d.addr, str(root))) == samples
    stop(d)


def test_failpoint_shm_send_failure_is_an_error_not_a_hang(tmp_path, fail_bin, local) -> None:
    root, samples = local
    d = start(tmp_path, fail_bin, "shm-send=return(EPIPE)")
    got = within(DEADLINE, lambda: epoch(d.addr, str(root), transport="shm"))
    assert isinstance(got, (OSError, shardstream.ShardstreamError)), got
    # The daemon is unharmed: the inline transport (no side channel) still serves every sample.
    assert within(DEADLINE, lambda: epoch(d.addr, str(root), transport="inline")) == samples
    stop(d)


def test_failpoint_a_lost_batch_is_reported_not_a_short_epoch(tmp_path, fail_bin, local) -> None:
    root, _ = local
    d = start(tmp_path, fail_bin, "stream-send=3*off->1*return")
    got = within(DEADLINE, lambda: epoch(d.addr, str(root), transport="inline"))
    assert isinstance(got, (OSError, shardstream.ShardstreamError)), f"a short epoch passed as complete: {got!r}"
    assert "stream ended after 3 of" in str(got), got
    stop(d)


def test_failpoint_packed_gather_failure_frees_its_ring_slot(tmp_path, fail_bin) -> None:
    root = tmp_path / "tok"
    root.mkdir()
    rng = np.random.default_rng(11)
    with wds.ShardWriter(str(root / "tok-%04d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(400):
            sink.write({"__key__": f"t{i:05d}", "tok": rng.integers(0, 255, 256, dtype=np.uint8).tobytes()})
    d = start(tmp_path / "d", fail_bin, "packed-gather=2*off->1*return")

    def packed_keys() -> list[str]:
        keys: list[str] = []
        loader = shardstream.Loader(str(root), batch_size=32, fields=["tok"], collate="stack", connect=d.addr)
        for batch in loader:
            keys.extend(batch["__key__"])
        return keys

    got = within(DEADLINE, packed_keys)
    assert isinstance(got, shardstream.ShardstreamError) and "packed-gather" in str(got), got
    # The failed batch's slot was given back: a second packed stream of the same daemon runs to the end.
    keys = within(DEADLINE, packed_keys)
    assert isinstance(keys, list) and sorted(keys) == [f"t{i:05d}" for i in range(400)], keys
    stop(d)


def test_failpoint_a_full_disk_only_stops_keeping_decoded_row_groups(tmp_path, fail_bin) -> None:
    """Keeping row groups decoded for views in the node cache is an optimisation: a disk that is
    full for every fill costs the stream nothing but that (its row groups stay in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    rng = np.random.default_rng(12)
    want = {r: rng.bytes(int(rng.integers(13, 3000))) for r in range(200)}
    for f in range(2):
        ids = range(f * 100, f * 100 + 100)
        t = pa.table({"id": pa.array(ids, pa.int64()), "blob": pa.array([want[r] for r in ids], pa.binary())})
        pq.write_table(t, root / f"p{f}.parquet", row_group_size=10)
    d = start(tmp_path / "d", fail_bin, "cache-fill=return(ENOSPC)")

    def views_epoch() -> list[int]:
        loader = shardstream.Loader(str(root), batch_size=16, seed=3, connect=d.addr, format="arrow", binary_views=True)
        seen: list[int] = []
        for rb in loader:
            ids = rb.column("id").to_pylist()
            assert rb.column("blob").to_pylist() == [want[r] for r in ids]
            seen.extend(ids)
        return seen

    got = within(DEADLINE, views_epoch)
    assert isinstance(got, list) and sorted(got) == list(range(200)), got
    assert not list((d.cache_dir / "shards").glob("*derived-*")), "nothing kept, nothing left behind"
    stop(d)


def test_failpoint_a_full_disk_only_stops_the_background_keeping(tmp_path, fail_bin) -> None:
    """Past `--decoded-budget`, a stream without views keeps its row groups through the
    background writer; a disk full for every fill leaves every epoch exact, served from memory,
    and nothing behind."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "pq"
    root.mkdir()
    rng = np.random.default_rng(13)
    want = {r: rng.bytes(5000) for r in range(600)}
    for f in range(3):
        ids = range(f * 200, f * 200 + 200)
        t = pa.table({"id": pa.array(ids, pa.int64()), "blob": pa.array([want[r] for r in ids], pa.binary())})
        pq.write_table(t, root / f"p{f}.parquet", row_group_size=50, compression="none")
    env = {"FAILPOINTS": "cache-fill=return(ENOSPC)"}
    d = Daemon(tmp_path / "d", args=["--decoded-budget", "1MiB"], env=env, binary=fail_bin).start()

    def dict_epoch(seed: int) -> list[int]:
        seen: list[int] = []
        for batch in shardstream.Loader(str(root), batch_size=32, seed=seed, connect=d.addr):
            ids = [int(i) for i in batch["id"]]
            assert [bytes(b) for b in batch["blob"]] == [want[r] for r in ids]
            seen.extend(ids)
        return seen

    for seed in (1, 2, 3):
        got = within(DEADLINE, lambda s=seed: dict_epoch(s))
        assert isinstance(got, list) and sorted(got) == list(range(600)), got
    # The background writer may still be trying (and failing) to keep a row group of the last
    # epoch; the status counts it until it gives up.
    assert wait_for(lambda: d.status()["cache"]["decoded_row_groups"] == 0, timeout=30), d.status()
    assert not list((d.cache_dir / "shards").glob("*derived-*")), "nothing kept, nothing left behind"
    stop(d)


def test_failpoint_a_prefetch_thread_that_cannot_start_gives_its_slot_back(tmp_path, fail_bin, s3, indexed) -> None:
    """Threads can run out (`ulimit -u`, memory). A prefetch whose thread never started is not in
    flight: were it counted so, `--prefetch-parallel` such failures would stop the node's
    prefetching for the daemon's life, silently. (The indexed dataset: opening one without a
    manifest reads every shard into the cache, leaving nothing to prefetch.)"""
    log = tmp_path / "daemon.log"
    # Its log to a file, to see that the point fired (the daemon warns, naming the failure).
    wrap = ["sh", "-c", f'exec "$@" >{log} 2>&1', "sh"]
    d = Daemon(
        tmp_path,
        args=["--prefetch-parallel", "2"],
        env={**s3.env(), "FAILPOINTS": "prefetch-spawn=2*return"},
        wrap=wrap,
        binary=fail_bin,
    ).start()

    def in_flight() -> int:
        cmd = [SHARDSTREAM, "status", "--connect", d.addr, "--json"]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)[
            "prefetches_in_flight"
        ]

    assert within(DEADLINE, lambda: epoch(d.addr, "s3://fpts/indexed/")) == indexed
    assert log.read_text().count("cannot start a prefetch thread") == 2, log.read_text()
    # Every shard is cached after the epoch, so nothing is left in flight.
    assert wait_for(lambda: in_flight() == 0, timeout=10), in_flight()
    stop(d)


@pytest.mark.parametrize("backtrace", ["0", "1"])
def test_failpoint_a_panic_is_one_error_in_the_log_and_the_daemon_serves_on(
    tmp_path, fail_bin, local, backtrace: str
) -> None:
    """A panic the daemon did not expect (a bug, here injected into a shard read) fails that
    stream only, and is one JSON log line of target shardstream::panic naming the thread and the
    place, with the backtrace inside the line when RUST_BACKTRACE asks for one: never lines of
    plain text on stderr that a log shipper splits into unrelated records."""
    root, samples = local
    log = tmp_path / "daemon.log"
    env = {"FAILPOINTS": "local-read=1*panic(injected)", "RUST_BACKTRACE": backtrace}
    d = Daemon(tmp_path, args=["--log-format", "json"], env=env, binary=fail_bin, log=log).start()
    got = within(DEADLINE, lambda: epoch(d.addr, str(root), transport="inline"))
    assert isinstance(got, (OSError, shardstream.ShardstreamError)), f"a panicked read passed: {got!r}"
    assert within(DEADLINE, lambda: epoch(d.addr, str(root), transport="inline")) == samples
    stop(d)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    panics = [line for line in lines if line.get("target") == "shardstream::panic"]
    assert len(panics) == 1, lines
    (p,) = panics
    assert p["level"] == "ERROR" and p["message"] == "panic: injected" and p["thread"], p
    assert ".rs:" in p["place"] and "/registry/src/" not in p["place"], p
    assert ("backtrace" in p) == (backtrace == "1"), p
