"""S3 datasets end to end: a real S3-compatible server (s3s-fs) on 127.0.0.1, shards written by the
real `webdataset` library into a bucket, a real daemon process with its node cache, and the
faults the daemon must absorb: the server killed and restarted mid-download, an object altered
after its manifest was written, a cache smaller than an epoch, the daemon SIGKILLed mid-download,
and a cache disk that fills up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tlsutil
import webdataset as wds
from chaos.proxy import FaultProxy
from s3server import S3Server, free_port
from test_bounds import scrape

import shardstream
from conftest import SHARDSTREAM, Daemon, write_dataset

Samples = dict[str, dict[str, bytes]]


@pytest.fixture(scope="module")
def small(s3: S3Server) -> Samples:
    """11 shards of ~100 samples in s3://data/small/ (no manifest)."""
    return write_dataset(s3.bucket("data") / "small", n=1003, per_shard=97, extra_every=10)


@pytest.fixture(scope="module")
def indexed(s3: S3Server) -> Samples:
    """8 shards of 50 samples in s3://data/indexed/, with manifest.json written by `shardstream index`."""
    samples = write_dataset(s3.bucket("data") / "indexed", n=400, per_shard=50, seed=3)
    p = index_s3(s3, "s3://data/indexed/")
    assert "indexed 8 shards, 400 samples" in p.stdout and "s3://data/indexed/manifest.json" in p.stdout
    return samples


def start_daemon(tmp: Path, s3: S3Server, *args: str, **kw) -> Daemon:
    return Daemon(tmp, args=list(args), env=s3.env(), **kw).start()


def epoch(addr: str, url: str, seed: int = 0, epoch: int = 0, world: int = 1, batch_size: int = 32, **kw) -> Samples:
    """Every rank's share of one epoch; asserts nothing is delivered twice (bar DDP padding)."""
    got: Samples = {}
    for rank in range(world):
        loader = shardstream.Loader(
            url, batch_size=batch_size, seed=seed, rank=rank, world_size=world, connect=addr, **kw
        )
        loader.set_epoch(epoch)
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                fields = {f: bytes(v[i]) for f in ("jpg", "cls", "json") if (v := batch.get(f)) and v[i] is not None}
                if key in got:
                    assert got[key] == fields  # a padded repeat (at most world - 1 of them)
                got[key] = fields
    return got


def index_s3(s3: S3Server, url: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [SHARDSTREAM, "index", url], env={**os.environ, **s3.env()}, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    return p


def test_epoch_from_s3_is_exactly_once_with_identical_bytes(tmp_path: Path, s3: S3Server, small: Samples) -> None:
    d = start_daemon(tmp_path, s3)
    try:
        assert epoch(d.addr, "s3://data/small/", world=2) == small
        st = d.status()
        # One listing, one manifest probe, then one GET per shard (each smaller than a part).
        shard_bytes = sum(p.stat().st_size for p in (s3.root / "data/small").glob("*.tar"))
        assert st["cache"]["misses"] == 11 and st["storage_bytes"] == shard_bytes, st
        assert 11 <= st["storage_requests"] <= 11 + 4, st
        # Epoch 2 is served from the node cache: no shard byte is downloaded again.
        assert epoch(d.addr, "s3://data/small/", epoch=1) == small
        assert d.status()["storage_bytes"] == st["storage_bytes"]
    finally:
        assert d.stop() == 0


def test_index_writes_the_manifest_to_the_bucket_and_opening_costs_one_get(
    tmp_path: Path, s3: S3Server, indexed: Samples
) -> None:
    prefix = s3.root / "data/indexed"
    assert (prefix / "manifest.json").is_file() and len(list((prefix / "_shardstream").glob("*.idx"))) == 8
    # Each shard's largest sample, as the S3 path records it, is what indexing a local copy records.
    local = tmp_path / "local"
    local.mkdir()
    for shard in prefix.glob("*.tar"):
        shutil.copyfile(shard, local / shard.name)
    subprocess.run([SHARDSTREAM, "index", str(local)], check=True, capture_output=True, timeout=120)

    def largest(manifest: Path) -> dict[str, tuple[int, int]]:
        shards = json.loads(manifest.read_text())["shards"]
        return {s["name"]: (s["max_sample"], s["max_sample_bytes"]) for s in shards}

    assert largest(prefix / "manifest.json") == largest(local / "manifest.json")
    d = start_daemon(tmp_path, s3)
    try:
        info = shardstream._native.Connection(d.addr).open("s3://data/indexed/")
        assert info["from_manifest"] and info["num_samples"] == 400
        assert d.status()["storage_requests"] == 1, "a dataset with a manifest opens with one GET"
        assert epoch(d.addr, "s3://data/indexed/", seed=5) == indexed
        assert d.status()["storage_requests"] == 1 + 8
    finally:
        d.stop()


def test_prefetch_stages_the_dataset_then_an_epoch_downloads_nothing(
    tmp_path: Path, s3: S3Server, indexed: Samples
) -> None:
    d = start_daemon(tmp_path, s3)
    try:
        p = subprocess.run(
            [SHARDSTREAM, "prefetch", "s3://data/indexed/", "--connect", d.addr, "--shards", "3"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0 and "staged 3 of 3 shards" in p.stdout, (p.stdout, p.stderr)
        assert d.status()["cache"]["shards"] == 3
        p = subprocess.run(
            [SHARDSTREAM, "prefetch", "s3://data/indexed/", "--connect", d.addr],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "staged 8 of 8 shards" in p.stdout and "3 already cached" in p.stdout, p.stdout
        before = d.status()["storage_bytes"]
        assert epoch(d.addr, "s3://data/indexed/") == indexed
        assert d.status()["storage_bytes"] == before
    finally:
        d.stop()


def test_prefetch_of_a_dataset_without_manifest_reports_the_open_s_indexing(
    tmp_path: Path, s3: S3Server, small: Samples
) -> None:
    """Without a manifest the daemon opens a dataset by indexing every shard (on S3, each read
    whole through the node cache): minutes for a large one, during which `prefetch` showed
    nothing, then a summary calling every shard "already cached". The open's progress now comes
    first, and the summary says the open indexed the shards. A proxy holds each GET 0.6 s so
    that the open outlasts the progress tick."""
    proxy = FaultProxy(s3.port, rate=0.0, hold=0.6).start()
    d = Daemon(tmp_path, env={**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}).start()
    try:
        p = subprocess.run(
            [SHARDSTREAM, "prefetch", "s3://data/small/", "--connect", d.addr],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        assert "the daemon is indexing s3://data/small/ (11 shards, no manifest.json)" in p.stderr, p.stderr
        assert "shardstream index s3://data/small/" in p.stderr, p.stderr
        assert "staged 11 of 11 shards" in p.stdout and "the open indexed 11 shards first" in p.stdout, p.stdout
    finally:
        assert d.stop() == 0
        proxy.stop()


def test_missing_bucket_prefix_and_bad_credentials_are_named(tmp_path: Path, s3: S3Server, small: Samples) -> None:
    d = start_daemon(tmp_path, s3)
    try:
        with pytest.raises(FileNotFoundError, match="s3://data/nothing-here/"):
            shardstream.Loader("s3://data/nothing-here/", connect=d.addr)
        with pytest.raises(FileNotFoundError, match="s3://no-such-bucket/"):
            shardstream.Loader("s3://no-such-bucket/x/", connect=d.addr)
        with pytest.raises(ValueError, match="direct"):
            shardstream.Loader("s3://data/small/", cache="direct", connect=d.addr)
        # The daemon keeps serving.
        assert sum(1 for _ in shardstream.Loader("s3://data/small/", batch_size=500, connect=d.addr)) == 3
    finally:
        d.stop()
    bad = Daemon(tmp_path / "bad", env=s3.env(secret="wrong-secret")).start()
    try:
        with pytest.raises(PermissionError, match="s3://data/small/"):
            shardstream.Loader("s3://data/small/", connect=bad.addr)
    finally:
        bad.stop()


def big_dataset(s3: S3Server, name: str, shards: int = 6, per_shard: int = 8, size: int = 1 << 20) -> Samples:
    """`shards` shards of `per_shard` samples of `size` random bytes: slow enough to interrupt."""
    root = s3.bucket("data") / name
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    samples: Samples = {}
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            key = f"{name}/{i:05d}"
            samples[key] = {"jpg": rng.integers(0, 256, size, dtype=np.uint8).tobytes(), "cls": str(i).encode()}
            sink.write({"__key__": key, **samples[key]})
    return samples


def run_epoch_in_thread(addr: str, url: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["samples"] = epoch(addr, url)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


# Small parts, one at a time, one shard at a time: a download of ~8 MiB takes many requests, so
# the faults below land in the middle of one.
SLOW = ["--s3-part-size", "256KiB", "--s3-concurrency", "1", "--prefetch-parallel", "1"]


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def test_s3_server_killed_mid_download_and_restarted(tmp_path: Path, s3: S3Server) -> None:
    samples = big_dataset(s3, "restart")
    d = start_daemon(tmp_path, s3, *SLOW)
    try:
        t, out = run_epoch_in_thread(d.addr, "s3://data/restart/")
        wait_for(lambda: d.status()["storage_bytes"] > 0)
        s3.stop()
        time.sleep(1.0)
        s3.start()
        t.join(timeout=300)
        assert not t.is_alive()
        assert "error" not in out, out.get("error")
        assert out["samples"] == samples
        assert d.status()["storage_retries"] > 0, "the kill did not interrupt any request"
    finally:
        d.stop()


def test_a_daemon_stopped_mid_request_exits_without_a_panic(
    tmp_path: Path, s3: S3Server, capfd: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while a request made from a blocking thread (here the footer reads of a Parquet
    dataset's open) is in flight, held by a proxy. When the daemon's runtime went, the request
    failed ("runtime dropped the dispatch task"), was retried, and the retry's sleep panicked on
    the stopped timer ("A Tokio 1.x context was found, but it is being shutdown"). Requests now
    stop retrying when the daemon stops."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = s3.bucket("data") / "stopopen"
    bucket.mkdir(parents=True)
    for k in range(4):
        pq.write_table(pa.table({"x": list(range(k * 10, k * 10 + 10))}), bucket / f"part-{k}.parquet")
    proxy = FaultProxy(s3.port, rate=0.0, hold=1.0).start()
    env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    d = Daemon(tmp_path, args=["--drain-timeout", "0.2"], env=env).start()
    opened: dict = {}

    def open_it() -> None:
        try:
            opened["info"] = shardstream._native.Connection(d.addr).open("s3://data/stopopen/")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            opened["error"] = e

    try:
        t = threading.Thread(target=open_it)
        t.start()
        wait_for(lambda: proxy.gets_in > 0)
        capfd.readouterr()
        assert d.stop() == 0
        t.join(timeout=60)
        assert "error" in opened, "the open could not have finished"
        err = capfd.readouterr().err
        assert "panicked" not in err, err[-3000:]
    finally:
        d.stop()
        proxy.stop()


def test_object_altered_after_the_manifest_is_rejected_by_name(tmp_path: Path, s3: S3Server) -> None:
    samples = write_dataset(s3.bucket("data") / "altered", n=300, per_shard=50, seed=9)
    index_s3(s3, "s3://data/altered/")
    victim = s3.root / "data/altered/train-000003.tar"
    raw = bytearray(victim.read_bytes())
    raw[2000] ^= 0xFF  # inside the first member's payload: same size, other bytes
    victim.write_bytes(bytes(raw))
    d = start_daemon(tmp_path, s3)
    try:
        loader = shardstream.Loader("s3://data/altered/", batch_size=10, shuffle=False, connect=d.addr)
        delivered = 0
        with pytest.raises(shardstream.ShardError) as err:
            for batch in loader:
                for i, key in enumerate(batch["__key__"]):
                    assert bytes(batch["jpg"][i]) == samples[key]["jpg"], "a corrupt byte reached the trainer"
                    delivered += 1
        assert err.value.shard == "s3://data/altered/train-000003.tar"
        assert "crc32c" in str(err.value) and "re-fetch" in str(err.value)
        assert delivered == 150, "everything before the altered shard arrives, nothing of it"
        assert not any(p.name.endswith("train-000003.tar") for p in (d.cache_dir / "shards").iterdir())
    finally:
        d.stop()


def test_cache_smaller_than_an_epoch_evicts_and_stays_under_capacity(tmp_path: Path, s3: S3Server) -> None:
    # 40 shards; the cache holds half. A consumer needs a few shards at a time (its shuffle
    # window, and the batches it holds under lease), far fewer than 20.
    samples = write_dataset(s3.bucket("data") / "evict", n=1000, per_shard=25, seed=4)
    total = sum(p.stat().st_size for p in (s3.root / "data/evict").glob("*.tar"))
    capacity = total // 2
    d = start_daemon(tmp_path, s3, "--cache-size", str(capacity))
    try:
        for e in range(2):
            assert epoch(d.addr, "s3://data/evict/", epoch=e, world=2, shuffle_window=2) == samples
        c = d.status()["cache"]
        assert c["capacity_bytes"] == capacity and c["high_water_bytes"] <= capacity, c
        assert c["evictions"] > 0, c
        # The prefetcher is already fetching the next epoch's shards: a fill's temporary file
        # may be renamed or dropped between listing the directory and reading its size.
        on_disk = 0
        for entry in os.scandir(d.cache_dir / "shards"):
            with contextlib.suppress(FileNotFoundError):
                on_disk += entry.stat().st_size
        assert on_disk <= capacity
    finally:
        assert d.stop() == 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_full_cache_does_not_keep_the_prefetcher_busy(tmp_path: Path, s3: S3Server) -> None:
    # The cache holds 3 of 40 shards, each needed before any shard the prefetcher would fetch next:
    # every prefetch gives up for lack of room. A consumer that stops (a trainer checkpointing)
    # must leave the daemon idle, not retrying those prefetches back to back.
    big_dataset(s3, "fullcache", shards=40, per_shard=1, size=400_000)
    shards = sorted((s3.root / "data/fullcache").glob("*.tar"))
    capacity = 3 * max(p.stat().st_size for p in shards)
    d = start_daemon(tmp_path, s3, "--cache-size", str(capacity))
    try:
        loader = shardstream.Loader("s3://data/fullcache/", batch_size=1, seed=1, shuffle_window=1, connect=d.addr)
        it = iter(loader)
        next(it)
        time.sleep(1.0)  # the prefetches it started run out of room
        assert d.proc is not None
        before = cpu_seconds(d.proc.pid)
        time.sleep(4.0)
        busy = cpu_seconds(d.proc.pid) - before
        assert busy < 0.5, f"the idle daemon spent {busy:.2f} CPU-s in 4 s"
        del it, loader
    finally:
        assert d.stop() == 0


def test_prefetch_into_a_cache_smaller_than_the_dataset_stages_the_head_of_the_epoch(
    tmp_path: Path, s3: S3Server
) -> None:
    # Opening a dataset without a manifest indexes each shard through the node cache, which here
    # kept whichever 3 of them came last; staging, which never evicts, then stopped at once
    # ("staged 0 of 10") or counted those as "already cached", and the head of the epoch was
    # missing. It may now replace the dataset's own copies needed later with those needed first.
    big_dataset(s3, "tight", shards=10, per_shard=1, size=600_000)
    shards = sorted((s3.root / "data/tight").glob("*.tar"))
    capacity = 3 * max(p.stat().st_size for p in shards) + 4096
    (tmp_path / "ref").mkdir()
    (tmp_path / "tight").mkdir()
    ref = start_daemon(tmp_path / "ref", s3)
    try:
        keys = [k for b in shardstream.Loader("s3://data/tight/", batch_size=1, connect=ref.addr) for k in b["__key__"]]
    finally:
        assert ref.stop() == 0
    order = [shards[int(k.rsplit("/", 1)[1])].name for k in keys]
    d = start_daemon(tmp_path / "tight", s3, "--cache-size", str(capacity))
    try:
        for _ in range(2):
            p = subprocess.run(
                [SHARDSTREAM, "prefetch", "s3://data/tight/", "--connect", d.addr],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 0 and "staged 3 of 10 shards" in p.stdout, (p.stdout, p.stderr)
            assert "the node cache is full" in p.stderr, p.stderr
            cached = {f.name.split("-", 1)[1] for f in (d.cache_dir / "shards").glob("*.tar")}
            assert cached == set(order[:3]), (cached, order)
        assert "3 already cached" in p.stdout, p.stdout
    finally:
        assert d.stop() == 0


def test_daemon_killed_mid_download_never_serves_a_partial_file(tmp_path: Path, s3: S3Server) -> None:
    samples = big_dataset(s3, "sigkill", shards=4)
    d = start_daemon(tmp_path, s3, *SLOW)
    shards_dir = d.cache_dir / "shards"
    t, out = run_epoch_in_thread(d.addr, "s3://data/sigkill/")
    wait_for(lambda: any(p.name.startswith(".") for p in shards_dir.iterdir()))
    d.kill()
    t.join(timeout=60)
    assert "error" in out, "the consumer must see the daemon die, not a short epoch"
    partial = [p for p in shards_dir.iterdir() if p.name.startswith(".")]
    assert partial, "the kill should have left a partial download behind"
    d.start()
    try:
        assert not any(p.name.startswith(".") for p in shards_dir.iterdir()), "partial download not removed"
        assert epoch(d.addr, "s3://data/sigkill/") == samples
    finally:
        d.stop()


def test_a_cache_copy_damaged_while_the_daemon_was_down_is_fetched_again(tmp_path: Path, s3: S3Server) -> None:
    """A copy cut short (a disk that lost the file's tail, a hand that truncated it) or grown
    while no daemon ran was adopted as it was at the next start: every epoch then failed on that
    shard, "changed since the dataset was listed", and nothing ever fetched it again. A copy
    whose size is not the shard's is not the shard: it is fetched again, and said so."""
    samples = write_dataset(s3.bucket("data") / "damaged", n=200, per_shard=50, seed=11)
    d = start_daemon(tmp_path, s3, log=tmp_path / "daemon.log")
    assert epoch(d.addr, "s3://data/damaged/") == samples
    assert d.stop() == 0
    copies = sorted(p for p in (d.cache_dir / "shards").iterdir() if p.name.endswith(".tar"))
    assert len(copies) == 4
    size = copies[0].stat().st_size
    os.truncate(copies[0], size // 2)
    with open(copies[1], "ab") as f:
        f.write(b"\0" * 512)
    d.start()
    try:
        before = d.status()["storage_bytes"]
        assert epoch(d.addr, "s3://data/damaged/") == samples
        st = d.status()
        assert st["cache"]["misses"] == 2 and st["storage_bytes"] - before == size + copies[1].stat().st_size, st
        assert copies[0].stat().st_size == size
    finally:
        assert d.stop() == 0
    log = (tmp_path / "daemon.log").read_text()
    assert log.count("fetched again") == 2 and copies[0].name in log, log[-3000:]


def tmpfs_cache_daemon(tmp_path: Path, s3: S3Server, then: str = "") -> Daemon:
    """A daemon (not started) whose cache directory is a 3 MiB tmpfs in a mount namespace of its
    own, while it is told it may use 1 GiB; `then`: a shell command run there before it starts."""
    cache = tmp_path / "cache"
    cache.mkdir()
    mount = f"mount -t tmpfs -o size=3m tmpfs {cache}" + (f" && {then}" if then else "") + ' && exec "$@"'
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    wrap = ["unshare", *userns, "--mount", "sh", "-c", mount, "sh"]
    return Daemon(tmp_path, args=["--cache-size", "1GiB"], env=s3.env(), wrap=wrap)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_full_cache_disk_evicts_instead_of_failing(tmp_path: Path, s3: S3Server, transport: str) -> None:
    """The cache directory is a 3 MiB tmpfs (in a private mount namespace) while the daemon is
    told it may use 1 GiB: writes hit ENOSPC, the daemon lowers its capacity and evicts. The
    dataset (4 MB) does not fit; what one consumer needs at a time (a few 200 kB shards) does.
    Over shared memory the client maps every shard it reads: it must let go of the ones the
    daemon evicts (an unlinked file that is still mapped keeps its space), or the disk fills."""
    samples = big_dataset(s3, "diskfull", shards=20, per_shard=1, size=200_000)
    d = tmpfs_cache_daemon(tmp_path, s3).start()
    try:
        got = epoch(d.addr, "s3://data/diskfull/", batch_size=1, shuffle_window=1, transport=transport)
        assert got == samples
        c = d.status()["cache"]
        assert c["capacity_bytes"] < 3 << 20, c
        assert c["evictions"] > 0, c
    finally:
        d.stop()


def test_a_disk_that_frees_up_gives_the_capacity_back(tmp_path: Path, s3: S3Server) -> None:
    """A 3 MiB tmpfs holding 2 MiB of another user's file: the cache's writes hit ENOSPC and its
    capacity is lowered to the ~1 MiB left. Once that file is gone, a 1.5 MiB shard must be served
    (the disk has room again), not refused as larger than the cache."""
    small = big_dataset(s3, "regain-small", shards=10, per_shard=1, size=200_000)
    large = big_dataset(s3, "regain-large", shards=1, per_shard=1, size=1_500_000)
    ballast = tmp_path / "cache" / "other-user.bin"
    d = tmpfs_cache_daemon(tmp_path, s3, then=f"head -c 2097152 /dev/zero > {ballast}").start()
    try:
        assert epoch(d.addr, "s3://data/regain-small/", batch_size=1, shuffle_window=1) == small
        lowered = d.status()["cache"]["capacity_bytes"]
        assert lowered < 1 << 20, lowered
        # Said as lowered, and why: "node cache 0.9 of 0.9 MB" alone read as a cache too small.
        assert d.status()["cache"]["configured_capacity_bytes"] == 1 << 30
        said = subprocess.run(
            [SHARDSTREAM, "status", "--connect", d.addr], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert "lowered from 1073.7 MB: its file system is full" in said, said
        # The tmpfs is mounted in the daemon's own mount namespace: reach it through its root.
        assert d.proc is not None
        Path(f"/proc/{d.proc.pid}/root{ballast}").unlink()
        assert epoch(d.addr, "s3://data/regain-large/", batch_size=1, shuffle_window=1) == large
        regained = d.status()["cache"]["capacity_bytes"]
        assert 1_500_000 < regained < 3 << 20, regained
    finally:
        d.stop()


def test_prometheus_metrics(tmp_path: Path, s3: S3Server, small: Samples) -> None:
    port = free_port()
    d = start_daemon(tmp_path, s3, "--metrics-addr", f"127.0.0.1:{port}")
    try:
        epoch(d.addr, "s3://data/small/")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for name in (
            "shardstream_storage_bytes_total",
            "shardstream_storage_requests_total",
            "shardstream_cache_misses_total",
            "shardstream_cache_bytes",
            "shardstream_prefetch_horizon_seconds",
            "shardstream_samples_served_total",
        ):
            assert name in text, name
    finally:
        d.stop()


def refused_after_open_url(s3: S3Server, mode: str) -> str:
    """The dataset a stream loop of `mode` reads (see `refused_after_open_opts`): the indexed TAR
    shards, or three small Parquet files written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not mode.startswith("parquet"):
        return "s3://data/indexed/"
    root = s3.bucket("data") / "pqrefused"
    if not root.exists():
        root.mkdir(parents=True)
        for k in range(3):
            t = pa.table({"id": pa.array(range(k * 100, (k + 1) * 100), pa.int64()), "blob": [b"x" * 500] * 100})
            pq.write_table(t, root / f"p{k}.parquet", row_group_size=25)
    return "s3://data/pqrefused/"


@contextlib.contextmanager
def refused_after_open(
    tmp_path: Path, s3: S3Server, mode: str, *args: str, hold: float = 0.0
) -> Iterator[tuple[str, dict[str, object], FaultProxy]]:
    """A daemon (two retries per request, `args` more) behind a proxy that answers every request
    503 SlowDown (after `hold` s) once the dataset of `mode` is open. Yields the dataset's URL,
    Loader options that take `mode`'s stream loop (TAR views `tar`, packed TAR batches
    `tar-stack`, Parquet files through the node cache `parquet-files`, Parquet column-chunk
    copies `parquet-columns`), and the proxy (its object GETs counted from the refusals on)."""
    url = refused_after_open_url(s3, mode)
    proxy = FaultProxy(s3.port, rate=0.0, kinds=("slowdown",), hold=hold).start()
    env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    d = Daemon(tmp_path, args=["--s3-max-retries", "2", *args], env=env).start()
    try:
        shardstream._native.Connection(d.addr).open(url)
        proxy.object_gets.clear()
        proxy.rate = 1.0
        opts: dict[str, object] = {"batch_size": 16, "connect": d.addr}
        if mode == "tar-stack":
            opts["collate"] = "stack"
        elif mode == "parquet-columns":
            opts["fields"] = ["id"]
        yield url, opts, proxy
    finally:
        assert d.stop() == 0
        proxy.stop()


@pytest.mark.parametrize("mode", ["tar", "tar-stack", "parquet-files", "parquet-columns"])
def test_a_wait_for_storage_that_ends_in_an_error_counts_as_the_consumers_wait(
    tmp_path: Path, s3: S3Server, indexed: Samples, mode: str
) -> None:
    """The consumer-wait metric (the GPU stall an operator watches) counted a stream's waits for
    shard copies only when the batch was then served: a stream that waited for storage until the
    storage failed it showed no wait at all. Once the dataset is open, the proxy answers every
    request with 503 SlowDown, so the first batch waits through two retries (at least 0.05 + 0.1 s
    of backoff) and the stream fails, in each of the daemon's stream loops."""
    port = free_port()
    with refused_after_open(tmp_path, s3, mode, "--metrics-addr", f"127.0.0.1:{port}") as (url, opts, _):
        started = time.monotonic()
        with pytest.raises((OSError, shardstream.ShardstreamError), match="SlowDown|503") as got:
            next(iter(shardstream.Loader(url, **opts)))
        took = time.monotonic() - started
        waited = scrape(port).get("shardstream_consumer_wait_seconds_total", 0.0)
        assert 0.15 <= waited <= took, (waited, took, got.value)


@pytest.mark.parametrize("mode", ["tar", "tar-stack", "parquet-files", "parquet-columns"])
def test_a_stream_that_joins_a_failing_download_fails_with_it_instead_of_downloading_again(
    tmp_path: Path, s3: S3Server, indexed: Samples, mode: str
) -> None:
    """A stream that found its shard being downloaded (by the prefetcher, or by the batch before
    it) waited for that download, and when it failed after its retries, began its own with the
    same retries; each batch built ahead did so again: the stream reported the error after two to
    four times the retry policy's time (41 s with the default retries for a Parquet file that one
    download gave up on after 20 s). Once the dataset is open, every request gets 503 SlowDown
    after 0.2 s (so the prefetcher's downloads are still trying when the stream asks for the same
    shards): every object (every column chunk's range, for a stream of some columns) is downloaded
    once, with its three tries (two retries), and the stream fails, in each stream loop."""
    with refused_after_open(tmp_path, s3, mode, hold=0.2) as (url, opts, proxy):
        with pytest.raises((OSError, shardstream.ShardstreamError), match="SlowDown"):
            next(iter(shardstream.Loader(url, **opts)))
        gets = dict(proxy.object_gets)
        assert gets, "no object was downloaded"
        assert max(gets.values()) <= 3, sorted(gets.items())


def test_objects_encrypted_with_sse_kms_are_read(tmp_path: Path, s3: S3Server) -> None:
    """S3 gives an object encrypted with SSE-KMS or SSE-C an ETag of 32 hex digits that is not
    the MD5 of its bytes. The daemon took it for one: every shard was downloaded three times and
    refused ("did not match the object's ETag (MD5) in 3 downloads"), a manifest retried for 20 s
    and failed, so no dataset in a bucket with KMS default encryption could be read. The proxy
    answers as S3 does for such objects; the bytes are the server's."""
    samples = write_dataset(s3.bucket("data") / "kms", n=120, per_shard=40, seed=4)
    proxy = FaultProxy(s3.port, rate=0.0, kms=True).start()
    env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        for indexed in (False, True):
            if indexed:
                p = subprocess.run(
                    [SHARDSTREAM, "index", "s3://data/kms/"], env={**os.environ, **env}, capture_output=True, text=True
                )
                assert p.returncode == 0, p.stderr
            d = Daemon(tmp_path / f"d{indexed}", env=env).start()
            try:
                assert epoch(d.addr, "s3://data/kms/") == samples
            finally:
                d.stop()
    finally:
        proxy.stop()


def test_an_indexed_object_that_shrank_is_a_shard_error(tmp_path: Path, s3: S3Server) -> None:
    """A TAR object cut short after `shardstream index` answered the ranged GET past its new end
    with 416, which reached the trainer as ConnectionError ("S3 answered 416 ... InvalidRange"):
    the class that reconnect logic retries. An object that changed is a ShardError naming it."""
    write_dataset(s3.bucket("data") / "shrank", n=100, per_shard=50, seed=5)
    index_s3(s3, "s3://data/shrank/")
    victim = s3.root / "data/shrank/train-000001.tar"
    victim.write_bytes(victim.read_bytes()[:4096])
    d = start_daemon(tmp_path, s3)
    try:
        with pytest.raises(shardstream.ShardError) as err:
            epoch(d.addr, "s3://data/shrank/")
        assert err.value.shard == "s3://data/shrank/train-000001.tar", err.value
    finally:
        d.stop()


def test_a_request_the_store_refuses_is_a_value_error(tmp_path: Path, s3: S3Server) -> None:
    """A bucket name the store refuses (400 InvalidBucketName) reached the trainer as
    ConnectionError, the class its reconnect logic retries for good."""
    d = start_daemon(tmp_path, s3)
    try:
        with pytest.raises(ValueError, match="InvalidBucketName|400"):
            shardstream.Loader("s3://bk/x/", batch_size=4, connect=d.addr)
    finally:
        d.stop()


def test_missing_credentials_or_a_malformed_endpoint_fail_at_once_saying_so(tmp_path: Path, s3: S3Server) -> None:
    """No credentials anywhere, or AWS_ENDPOINT_URL without its scheme: nothing a retry can mend,
    yet every request was retried ten times (20 s) and ended as ConnectionError, the class a
    trainer's reconnect logic retries again."""
    write_dataset(s3.bucket("data") / "creds", n=20, per_shard=10)
    no_keys = {k: v for k, v in s3.env().items() if not k.startswith("AWS_ACCESS_KEY") and "SECRET" not in k}
    host_port = s3.endpoint.removeprefix("http://")
    for name, env, kind, words in (
        ("nokeys", no_keys, PermissionError, "credentials"),
        ("noscheme", {**s3.env(), "AWS_ENDPOINT_URL": host_port}, ValueError, "AWS_ENDPOINT_URL"),
    ):
        clean = {**env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""} if name == "nokeys" else env
        d = Daemon(tmp_path / name, env=clean).start()
        try:
            with pytest.raises(kind) as e:
                epoch(d.addr, "s3://data/creds/")
            message = str(e.value)
            assert words in message and "retries" not in message, message
        finally:
            d.stop()


def test_an_object_rewritten_at_its_size_on_a_store_that_lists_no_etags_is_fetched_again(
    tmp_path: Path, s3: S3Server
) -> None:
    """Some S3-compatible stores (s3s-fs here) list objects without ETags. A shard's node-cache
    copy was then known by its size alone: an object rewritten at the same size while no daemon
    ran was served from the old copy, its old bytes, after a restart. The listing's LastModified
    now names the version too."""
    root = s3.bucket("data") / "noetag"
    samples = write_dataset(root, n=60, per_shard=30, seed=6)
    d = start_daemon(tmp_path, s3)
    try:
        assert epoch(d.addr, "s3://data/noetag/") == samples
    finally:
        d.stop()
    victim = root / "train-000000.tar"
    with tarfile.open(victim) as tar:
        hit = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    key, field = hit.name.rsplit(".", 1)
    raw = bytearray(victim.read_bytes())
    raw[hit.offset_data] ^= 0xFF  # a payload byte: same size, other bytes
    now = bytes(raw[hit.offset_data : hit.offset_data + hit.size])
    time.sleep(1.1)  # a listing's LastModified may count whole seconds
    victim.write_bytes(bytes(raw))
    assert now != samples[key][field]
    d = start_daemon(tmp_path, s3)  # the same cache directory: its copies are adopted
    try:
        got = epoch(d.addr, "s3://data/noetag/")
        assert got[key][field] == now, "the old copy's bytes were served"
    finally:
        d.stop()


def test_a_new_loader_after_an_object_changed_reads_the_dataset_as_it_is_now(tmp_path: Path, s3: S3Server) -> None:
    """The daemon reuses an S3 dataset's listing for a minute (every rank and worker opens it
    every epoch). An object that changed under a listing failed its stream, as it must, but the
    next Loader got the same listing and failed the same way until the minute was up, though
    the error said to open the dataset again. A shard found changed now ends the reuse."""
    root = s3.bucket("data") / "changing"
    samples = write_dataset(root, n=2400, per_shard=600, seed=7)  # 4 shards of ~3.2 MB
    # A cache of two shards and a bit: the first epoch's copy of shard 0 is gone by its end.
    d = start_daemon(tmp_path, s3, "--cache-size", "7500000")
    try:
        assert epoch(d.addr, "s3://data/changing/", shuffle=False) == samples
        replaced = write_dataset(tmp_path / "new", n=700, per_shard=700, seed=8)  # another size
        shutil.copy(tmp_path / "new" / "train-000000.tar", root / "train-000000.tar")
        with pytest.raises(shardstream.ShardError, match="train-000000.tar"):
            epoch(d.addr, "s3://data/changing/", shuffle=False)
        got = epoch(d.addr, "s3://data/changing/", shuffle=False)
        assert {k for k in got if k.startswith("s8/")} == set(replaced), "the new object's samples"
    finally:
        d.stop()


def test_a_new_loader_after_a_parquet_object_changed_reads_its_columns_as_they_are_now(
    tmp_path: Path, s3: S3Server
) -> None:
    """The same for a projection of S3 Parquet files, whose column chunks are fetched apart from
    whole files: a file replaced under the listing failed its stream, and every new Loader of the
    next minute got the same listing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = s3.bucket("data") / "pqchanging"
    root.mkdir(parents=True)
    for f in range(2):
        ids = list(range(f * 100, f * 100 + 100))
        pq.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}), root / f"f-{f}.parquet")
    d = start_daemon(tmp_path, s3)
    try:
        url = "s3://data/pqchanging/"
        first = shardstream.Loader(url, batch_size=10, shuffle=False, fields=["id"], connect=d.addr)
        # Replaced after the listing, with more rows (another size, another footer).
        pq.write_table(pa.table({"id": list(range(1000, 1150)), "x": [0.0] * 150}), root / "f-0.parquet")
        with pytest.raises(shardstream.ShardError, match="f-0.parquet"):
            for _ in first:
                pass
        loader = shardstream.Loader(url, batch_size=10, shuffle=False, fields=["id"], connect=d.addr)
        got = sorted(int(i) for b in loader for i in b["id"])
        assert got == list(range(100, 200)) + list(range(1000, 1150))
    finally:
        d.stop()


def test_an_object_rewritten_at_its_size_after_the_listing_is_a_shard_error_not_served(
    tmp_path: Path, s3: S3Server
) -> None:
    """A store that lists no ETags (s3s-fs) gives the GETs nothing to pin (If-Match): a shard
    rewritten at its size between the listing and its download was served with its new bytes
    (another shard's samples, delivered twice), and a Parquet file's column chunks read apart
    the same. Each GET's Last-Modified is now held to the listed one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = s3.bucket("data") / "rewritten"
    samples = write_dataset(root, n=2400, per_shard=600, seed=9)  # 4 shards of ~3.2 MB
    pqroot = s3.bucket("data") / "pqrewritten"
    pqroot.mkdir(parents=True)
    for f in range(2):
        ids = list(range(f * 50, f * 50 + 50))
        pq.write_table(pa.table({"id": ids, "x": [float(i) for i in ids]}), pqroot / f"f-{f}.parquet")
    # A cache of two shards and a bit: opening indexes all four, and shard 0's copy is gone by then.
    d = start_daemon(tmp_path, s3, "--cache-size", "7500000")
    try:
        tar_loader = shardstream.Loader("s3://data/rewritten/", batch_size=100, shuffle=False, connect=d.addr)
        pq_loader = shardstream.Loader(
            "s3://data/pqrewritten/", batch_size=10, shuffle=False, fields=["x"], connect=d.addr
        )
        # Rewritten a few seconds later (Last-Modified holds whole seconds, and one either way is
        # taken for a store's rounding): the file's time is the object's there.
        later = time.time() + 5
        # Every shard: which two copies the open left in the cache is the eviction's choice, and
        # the epoch fetches the other two again.
        for victim in sorted(root.glob("*.tar")):
            with tarfile.open(victim) as tar:
                hit = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
            raw = bytearray(victim.read_bytes())
            raw[hit.offset_data] ^= 0xFF  # same size, other bytes: the GET's own ETag (MD5) agrees
            victim.write_bytes(bytes(raw))
            os.utime(victim, (later, later))
        got: list[str] = []
        with pytest.raises(shardstream.ShardError, match="modified on the server .* after it was listed") as err:
            for b in tar_loader:
                got += b["__key__"]
                b.release()  # the traceback keeps the last batch, and its lease, alive
        assert re.fullmatch(r"s3://data/rewritten/train-00000[0-3]\.tar", err.value.shard or ""), err.value
        assert not set(got) - set(samples) and len(got) == len(set(got))

        pq_victim = pqroot / "f-1.parquet"
        pq_victim.write_bytes(pq_victim.read_bytes())  # the same bytes, a new version
        os.utime(pq_victim, (later, later))
        with pytest.raises(shardstream.ShardError, match="f-1.parquet.*modified on the server"):
            for batch in pq_loader:
                batch.release()
        # A new Loader lists the dataset as it is now, and reads it (the failed ones closed, their
        # batches released: none holds a copy the small cache needs).
        tar_loader.close()
        pq_loader.close()
        assert len(epoch(d.addr, "s3://data/rewritten/", shuffle=False)) == len(samples)
    finally:
        d.stop()


def test_an_indexed_object_that_grew_is_a_shard_error_not_cut_to_its_indexed_bytes(
    tmp_path: Path, s3: S3Server
) -> None:
    """The manifest's CRC covers the bytes it indexed: a shard rewritten with more samples after
    `shardstream index` was read to its indexed length, its CRC matched, and the rest was lost
    unsaid. A GET's answer names the object's size (Content-Range)."""
    write_dataset(s3.bucket("data") / "grew", n=100, per_shard=50, seed=5)
    index_s3(s3, "s3://data/grew/")
    victim = s3.root / "data/grew/train-000001.tar"
    victim.write_bytes(victim.read_bytes() + bytes(10240))
    d = start_daemon(tmp_path, s3)
    try:
        with pytest.raises(shardstream.ShardError, match="bytes on the server, not the .*shardstream index") as err:
            epoch(d.addr, "s3://data/grew/")
        assert err.value.shard == "s3://data/grew/train-000001.tar", err.value
    finally:
        d.stop()


def test_an_unreachable_s3_endpoint_is_named_as_such_not_as_the_daemon(tmp_path: Path, s3: S3Server) -> None:
    # The daemon answers; S3 does not. The error must say that, once and readably: the URL and
    # the OS's reason, not "shardstream daemon unavailable" and not the SDK's Debug dump.
    closed = free_port()
    env = {**s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}"}
    d = Daemon(tmp_path, args=["--s3-max-retries", "1"], env=env).start()
    try:
        with pytest.raises(ConnectionError) as e:
            next(iter(shardstream.Loader("s3://data/nowhere/", batch_size=4, connect=d.addr)))
        message = str(e.value)
        assert "s3://data/nowhere/" in message and "Connection refused" in message, message
        assert "daemon unavailable" not in message and "DispatchFailure(" not in message, message
        assert d.alive() and "datasets" in d.status()  # the daemon still answers
    finally:
        assert d.stop() == 0


def test_a_store_behind_a_private_ca_is_read_over_https_with_aws_ca_bundle_and_a_bad_bundle_is_named(
    tmp_path: Path, s3: S3Server
) -> None:
    """S3-compatible stores on premises often answer HTTPS with a certificate of the site's own CA,
    which the AWS CLI and boto3 trust through AWS_CA_BUNDLE: the daemon ignored it (only
    SSL_CERT_FILE, which replaces the system's roots, reached it). Read over HTTPS with the bundle
    (a certificate in it that cannot be a root left out); a bundle that cannot be read or holds no
    certificate fails the open naming AWS_CA_BUNDLE (the SDK panics on a certificate it cannot
    parse); a store whose certificate no trusted CA signed fails at once, saying so, not after
    every retry."""
    if why := tlsutil.available():
        pytest.fail(why)
    pki = tlsutil.make_pki(tmp_path / "pki")
    written = write_dataset(s3.bucket("data") / "overtls", n=60, per_shard=20)
    proxy = FaultProxy(s3.port, rate=0.0, tls=(pki / "daemon.pem", pki / "daemon.key")).start()
    https = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    assert proxy.endpoint.startswith("https://")
    try:
        # A system bundle with the site's CA appended may hold roots rustls refuses: left out.
        bundle = tmp_path / "bundle.pem"
        bundle.write_bytes(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n" + (pki / "ca.pem").read_bytes()
        )
        trusted = {**https, "AWS_CA_BUNDLE": str(bundle)}
        # The command-line tools connect as the daemon does.
        indexed = subprocess.run(
            [SHARDSTREAM, "index", "s3://data/overtls/"],
            env={**os.environ, **trusted},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert indexed.returncode == 0 and "indexed 3 shards, 60 samples" in indexed.stdout, indexed.stderr
        d = Daemon(tmp_path / "ok", env=trusted).start()
        try:
            assert epoch(d.addr, "s3://data/overtls/") == written
        finally:
            assert d.stop() == 0
        for name, bundle, kind, words in (
            ("missing", tmp_path / "nowhere.pem", ValueError, ["AWS_CA_BUNDLE", "nowhere.pem", "cannot be read"]),
            ("keyonly", pki / "daemon.key", ValueError, ["AWS_CA_BUNDLE", "daemon.key", "no PEM certificate"]),
            ("otherca", pki / "other-ca.pem", ValueError, ["s3://data/overtls/", "not trusted", "UnknownIssuer"]),
        ):
            d = Daemon(tmp_path / name, env={**https, "AWS_CA_BUNDLE": str(bundle)}).start()
            try:
                started = time.monotonic()
                with pytest.raises(kind) as e:
                    epoch(d.addr, "s3://data/overtls/")
                message = str(e.value)
                assert all(w in message for w in words), (name, message)
                assert time.monotonic() - started < 10, (name, "retried", message)
                assert d.alive()
            finally:
                assert d.stop() == 0
    finally:
        proxy.stop()


def test_over_https_reset_cut_and_throttled_answers_are_retried_and_every_byte_arrives(
    tmp_path: Path, s3: S3Server
) -> None:
    """The S3 client's TLS path under the faults the plain one is tested with: a connection reset
    before the answer, a body cut halfway (over TLS, a close without close_notify), 503 SlowDown.
    Each is retried or resumed as over plain HTTP, and every sample arrives as written."""
    if why := tlsutil.available():
        pytest.fail(why)
    pki = tlsutil.make_pki(tmp_path / "pki")
    written = write_dataset(s3.bucket("data") / "tlsfaults", n=600, per_shard=15, seed=5)
    tls = (pki / "daemon.pem", pki / "daemon.key")
    proxy = FaultProxy(s3.port, rate=0.3, seed=3, kinds=("reset", "truncate", "slowdown"), tls=tls).start()
    env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_CA_BUNDLE": str(pki / "ca.pem")}
    d = Daemon(tmp_path / "d", env=env).start()
    try:
        assert epoch(d.addr, "s3://data/tlsfaults/") == written
    finally:
        assert d.stop() == 0
        proxy.stop()
    faults = proxy.faults()
    assert faults["reset"] and faults["truncate"] and faults["slowdown"], faults
