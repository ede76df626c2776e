"""Memory and metadata bounds end to end, on a real `shardstream serve` process and datasets
written by webdataset, read through the daemon's Prometheus endpoint: concurrent opens of one
dataset build one index, later opens do not list or stat the shards again, and packed streams
share a daemon-wide ring budget (`--packed-budget`), inline batches queued for clients a
daemon-wide byte budget (`--inline-budget`)."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import shardstream
from conftest import BIG_SAMPLES, SHARDSTREAM, Daemon, hold_streams, wait_for, write_big, write_dataset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The daemon's metrics, summed over labels: {name: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def test_counters_a_dashboard_divides_by_are_exported_at_zero_from_the_start(tmp_path: Path) -> None:
    """A fresh daemon's scrape lacked the eviction and retry counters until their first increment:
    Grafana's eviction and retry-ratio panels read "No data" on a healthy node."""
    port = free_port()
    d = Daemon(tmp_path, args=["--metrics-addr", f"127.0.0.1:{port}"]).start()
    try:
        assert wait_for(lambda: "shardstream_cache_bytes" in scrape(port), timeout=10)
        m = scrape(port)
        for name in (
            "shardstream_cache_evictions_total",
            "shardstream_cache_hits_total",
            "shardstream_storage_retries_total",
            "shardstream_samples_served_total",
        ):
            assert m.get(name) == 0, (name, m)
    finally:
        d.stop()


def test_concurrent_opens_build_one_index_and_reopens_do_not_stat_every_shard(tmp_path: Path) -> None:
    root = tmp_path / "wds"
    write_dataset(root, n=2000, per_shard=20)  # 100 shards
    port = free_port()
    d = Daemon(tmp_path / "d", args=["--metrics-addr", f"127.0.0.1:{port}"]).start()
    try:
        barrier = threading.Barrier(16)

        def open_once(_: int) -> dict:
            conn = shardstream._native.Connection(d.addr)
            barrier.wait()
            return conn.open(str(root))

        with ThreadPoolExecutor(16) as pool:
            infos = list(pool.map(open_once, range(16)))
        assert {(i["num_samples"], i["num_shards"], i["fingerprint"]) for i in infos} == {
            (2000, 100, infos[0]["fingerprint"])
        }
        m = scrape(port)
        assert m["shardstream_dataset_opens_total"] == 16
        assert m["shardstream_dataset_builds_total"] == 1, "16 concurrent opens, one index build"
        assert m["shardstream_local_lists_total"] == 1
        # The one full discovery stats every shard once; every other open costs at most the
        # two-stat revalidation (directory and manifest) and 8 spot checks of shards (a dataset
        # rewritten in place leaves its directory's time as it was), not 100 stats.
        assert m["shardstream_local_stats_total"] <= 1 + 100 + (2 + 8) * 16, m
        assert m["shardstream_datasets_registered"] == 1

        # An epoch later every rank and worker opens again: no listing, ten stats each.
        conn = shardstream._native.Connection(d.addr)
        for _ in range(10):
            conn.open(str(root))
        after = scrape(port)
        assert after["shardstream_local_lists_total"] == 1
        assert after["shardstream_local_stats_total"] - m["shardstream_local_stats_total"] == (2 + 8) * 10
        assert after["shardstream_dataset_builds_total"] == 1
    finally:
        assert d.stop() == 0


def open_counting_metadata(tmp_path: Path, others: str, pattern: str) -> tuple[dict, dict[str, float]]:
    """Opens `pattern` over 40 shards (train-000000.tar ...) beside 300 other files named `others`
    % i, on a daemon of its own; returns the open's answer and the daemon's metrics after it."""
    root = tmp_path / "wds"
    write_dataset(root, n=400, per_shard=10)
    for i in range(300):
        (root / (others % i)).write_bytes(b"x")
    port = free_port()
    d = Daemon(tmp_path / "d", args=["--metrics-addr", f"127.0.0.1:{port}"]).start()
    try:
        info = shardstream._native.Connection(d.addr).open(str(root / pattern))
        return info, scrape(port)
    finally:
        assert d.stop() == 0


def test_a_brace_pattern_does_not_stat_the_directory(tmp_path: Path) -> None:
    info, m = open_counting_metadata(tmp_path, "unrelated-%d.bin", "train-{000002..000005}.tar")
    assert (info["num_shards"], info["num_samples"]) == (4, 40)
    assert m.get("shardstream_local_lists_total", 0) == 0
    assert m["shardstream_local_stats_total"] == 2 + 1 + 4, m


def test_a_glob_lists_once_and_stats_only_its_matches(tmp_path: Path) -> None:
    # The others are shards by name, which the glob does not match.
    info, m = open_counting_metadata(tmp_path, "other-%06d.tar", "train-00000[2-5].tar")
    assert (info["num_shards"], info["num_samples"]) == (4, 40)
    assert m["shardstream_local_lists_total"] == 1, m
    # The open's fixed stats, as for the brace pattern above, and one a match: none of the
    # 336 shards the glob does not match is stat'ed.
    assert m["shardstream_local_stats_total"] == 2 + 1 + 4, m


RECORD = 512


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 samples of RECORD-byte token blocks, by webdataset."""
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(5)
    with wds.ShardWriter(str(root / "tok-%04d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(600):
            sink.write({"__key__": f"t{i:05d}", "tok": rng.integers(0, 256, RECORD, dtype=np.uint8).tobytes()})
    return root


def epoch_keys(addr: str, root: Path, batch_size: int, seed: int) -> list[str]:
    loader = shardstream.Loader(
        str(root), batch_size=batch_size, seed=seed, fields=["tok"], collate="stack", connect=addr
    )
    keys: list[str] = []
    for batch in loader:
        assert batch["tok"].shape == (len(batch["__key__"]), RECORD)
        keys.extend(batch["__key__"])
    return keys


def test_packed_streams_share_the_ring_budget(tmp_path: Path, tokens: Path) -> None:
    port = free_port()
    d = Daemon(tmp_path / "d", args=["--packed-budget", "1MiB", "--metrics-addr", f"127.0.0.1:{port}"]).start()
    try:
        # Batches of 512 x 512 bytes: a ring of 8 such slots (~2 MiB) can never fit: a named
        # error at once, not a hang, and the daemon keeps serving.
        with pytest.raises(shardstream.ShardstreamError, match="packed ring budget exhausted"):
            epoch_keys(d.addr, tokens, 512, 1)
        # Batches of 128: a ~0.55 MiB ring, one fits at a time. Three loaders at once take turns
        # and each gets every sample exactly once.
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda seed: epoch_keys(d.addr, tokens, 128, seed), range(3)))
        for keys in results:
            assert len(keys) == 600 and len(set(keys)) == 600
        assert scrape(port)["shardstream_packed_budget_used_bytes"] <= 1 << 20
        assert wait_for(lambda: d.status()["ring_bytes"] == 0, timeout=10)
        # What the budget still holds is the ring kept for this user's next stream.
        assert wait_for(
            lambda: scrape(port)["shardstream_packed_budget_used_bytes"] == d.status()["kept_ring_bytes"] > 0,
            timeout=10,
        )
    finally:
        assert d.stop() == 0


def settled(read: Callable[[], int], quiet: float = 1.0, timeout: float = 30.0) -> int:
    """`read()` once it has not changed for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError(f"still changing after {timeout} s: {last}")


def write_big_parquet(tmp_path: Path, same: bool) -> Path:
    """BIG_SAMPLES rows of 512 KiB written by pyarrow, keyed as `write_big`'s samples. `same`:
    every row holds the same bytes, which pyarrow stores once (a dictionary page): files of 2 MB
    whose batches are as large as the others'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "big-parquet"
    root.mkdir()
    blob = np.random.default_rng(0).integers(0, 256, 512 << 10, dtype=np.uint8).tobytes()
    per_file = BIG_SAMPLES // 4
    for k in range(4):
        ids = range(k * per_file, (k + 1) * per_file)
        rows = [blob if same else i.to_bytes(8, "little") + blob[8:] for i in ids]
        t = pa.table({"__key__": [f"{i:05d}" for i in ids], "bin": pa.array(rows, pa.binary())})
        pq.write_table(t, root / f"big-{k}.parquet", row_group_size=25, compression="none", use_dictionary=same)
    return root


# TAR batches are built on the stream's own thread; Arrow batches this large on the general loop,
# unless their files are small (dictionary-encoded), which gives them a thread of their own too.
@pytest.mark.parametrize("fmt", ["tar", "parquet", "parquet-dictionary"])
def test_inline_streams_that_stop_reading_keep_a_batch_each_past_the_inline_budget(tmp_path: Path, fmt: str) -> None:
    """A client that stops reading inline batches leaves them queued in the daemon: each such
    stream kept four (two in its queue, one waiting for room there, one being sent), 8 MiB each
    here, and 768 streams may be served at once. Past --inline-budget a stream with batches still
    queued builds no more until they are read; one with none builds its next: a client that reads
    is served whole meanwhile, and the stopped ones, read again, get every sample exactly once."""
    root = write_big(tmp_path) if fmt == "tar" else write_big_parquet(tmp_path, same=fmt == "parquet-dictionary")
    everything = sorted(f"{i:05d}" for i in range(BIG_SAMPLES))
    batch = 16
    batch_bytes = batch * (512 << 10)
    d = Daemon(tmp_path / "d", args=["--inline-budget", "1MiB"]).start()
    try:
        stopped = []
        for seed in range(4):
            loader = shardstream.Loader(str(root), batch_size=batch, seed=seed, connect=d.addr, transport="inline")
            it = iter(loader)
            stopped.append((list(next(it)["__key__"]), it))
        # Each client's flow-control window (64 MiB) takes eight batches; then the daemon queues.
        queued = settled(lambda: d.status()["inline_queued_bytes"])
        assert d.status()["inline_budget_bytes"] == 1 << 20
        assert 4 * batch_bytes <= queued <= 4 * batch_bytes * 1.1, queued / batch_bytes
        # What an operator reads: `shardstream status` says it too.
        shown = subprocess.run(
            [SHARDSTREAM, "status", "--connect", d.addr], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        assert re.search(
            r"^inline +[\d.]+ of 1\.0 MB of batches queued for clients \(--inline-budget\)$", shown, re.M
        ), shown
        reader = shardstream.Loader(str(root), batch_size=batch, seed=99, connect=d.addr, transport="inline")
        assert sorted(k for b in reader for k in b["__key__"]) == everything
        for keys, it in stopped:
            keys.extend(k for b in it for k in b["__key__"])
            assert sorted(keys) == everything
        assert wait_for(lambda: d.status()["inline_queued_bytes"] == 0, timeout=10)
    finally:
        assert d.stop() == 0


def test_side_channel_connections_past_the_open_file_limit_leave_it_serving(tmp_path: Path) -> None:
    # A burst of connections to the shared-memory side channel (many trainers starting, or one
    # peer opening them on purpose) can exhaust the daemon's descriptors for a moment. Accepting
    # must resume once they are gone: the zero-copy path of every client of the node hangs on it.
    root = tmp_path / "data"
    samples = write_dataset(root, n=40, per_shard=10)
    limit = 64
    d = Daemon(tmp_path / "d", wrap=["prlimit", f"--nofile={limit}:{limit}"]).start()
    try:
        side = str(tmp_path / "d" / "sock.shm")
        held = []
        # More than the daemon has descriptors for: its backlog (128) alone holds more than 64.
        # A connect the full backlog refuses (EAGAIN) is skipped.
        for _ in range(400):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(2)
            try:
                s.connect(side)
            except OSError:
                s.close()
                continue
            held.append(s)
        assert len(held) > limit, len(held)
        for s in held:
            s.close()

        def epoch() -> set[str]:
            try:
                loader = shardstream.Loader(str(root), batch_size=8, transport="shm", connect=d.addr)
                return {k for b in loader for k in b["__key__"]}
            except ConnectionError:
                return set()

        assert wait_for(lambda: epoch() == set(samples), timeout=20)
    finally:
        assert d.stop() == 0


def test_streams_past_max_streams_are_refused_and_leave_opens_served(dataset, tmp_path: Path) -> None:
    """Each stream whose client does not read holds a thread of the daemon's blocking pool,
    which tokio caps at 512: 512 such streams (8 ranks of 64 idle DataLoader workers come
    close) left no thread to open any other client's dataset, which then waited for good. The
    daemon now serves --max-streams at once, refuses the next by name, and sizes the pool so
    opens always have threads of their own."""
    root, samples = dataset
    d = Daemon(tmp_path, args=["--max-streams", "3"]).start()
    try:
        held = hold_streams(str(root), 3, connect=d.addr)
        with pytest.raises(Exception, match=r"at most 3 streams at once \(--max-streams\)"):
            next(iter(shardstream.Loader(str(root), batch_size=1, connect=d.addr)))
        assert shardstream._native.Connection(d.addr).open(str(root))  # an open is still served
        for it in held[:1]:
            it.close()  # type: ignore[attr-defined]
        del held[:1]
        assert wait_for(lambda: d.status()["active_streams"] < 3)
        got = sum(len(b["__key__"]) for b in shardstream.Loader(str(root), batch_size=64, connect=d.addr))
        assert got == len(samples)
    finally:
        d.stop()
