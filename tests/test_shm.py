"""The shared-memory transport end to end: zero-copy views into the shards, leases that end when
views are dropped, released, or the client is killed, and the checks on the side channel."""

from __future__ import annotations

import gc
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shardstream
from conftest import SHARDSTREAM, Daemon, wait_for


def status(addr: str) -> dict:
    return shardstream._native.Connection(addr).status()


@pytest.mark.parametrize("cache", ["auto", "copy"])
def test_default_is_shm_with_identical_bytes(daemon, dataset, cache: str) -> None:
    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=64, seed=4, cache=cache, connect=daemon.addr)
    n = 0
    for batch in loader:
        assert isinstance(batch, shardstream.Batch)
        for i, key in enumerate(batch["__key__"]):
            v = batch["jpg"][i]
            assert isinstance(v, memoryview) and v.readonly
            # Node-cache copies are immutable: mapped, zero-copy. Shards read in place may be
            # truncated by others (SIGBUS in a mapping): read into the batch's own buffer.
            assert type(v.obj).__name__ == ("Region" if cache == "copy" else "Buffer")
            assert np.frombuffer(v, np.uint8).tobytes() == samples[key]["jpg"]
            extra = batch["json"][i]
            assert (extra is None) == ("json" not in samples[key])
            n += 1
    assert n == len(samples)
    assert loader.stats()["transport"] == "shm"
    with pytest.raises((TypeError, BufferError)):
        batch["jpg"][0][0] = 1  # read-only: a client can never write into a shard


def test_read_buffers_are_reused_only_after_their_views_are_gone(daemon, dataset) -> None:
    """Shards read in place are read into buffers from a process-wide pool: a batch whose views
    are kept must keep its bytes while later batches are read; dropped batches' buffers are
    reused, and their new contents are the new batches' bytes."""
    root, samples = dataset
    for _ in range(2):  # the second epoch runs on buffers the first gave back to the pool
        loader = shardstream.Loader(str(root), batch_size=16, seed=9, connect=daemon.addr)
        kept = []
        for k, batch in enumerate(loader):
            views = list(zip(batch["__key__"], batch["jpg"], strict=True))
            assert all(type(v.obj).__name__ == "Buffer" for _, v in views)
            if k % 2 == 0:
                kept.extend(views)  # held across the following batches
            batch.release()  # the lease (a credit); views keep their buffer, not the lease
            for key, v in views:
                assert bytes(v) == samples[key]["jpg"]
            del batch, views
            gc.collect()
        assert len(kept) > 16
        for key, v in kept:
            assert bytes(v) == samples[key]["jpg"], f"the bytes of {key} changed after later batches"


def test_samples_located_by_the_index_and_parsed_ones_agree(daemon, tmp_path) -> None:
    """Shards whose index records where each key and field lies are sliced without parsing; a
    shard whose keys are split over a ustar `prefix` (paths over 100 bytes, as Python's tarfile
    writes them in USTAR format) has no such record and is parsed. Both give the same batches."""
    import io
    import tarfile

    root = tmp_path / "ds"
    root.mkdir()
    expected = {}
    long_dir = "d" * 60 + "/" + "e" * 60
    for shard, (prefix, fmt) in enumerate([(long_dir + "/", tarfile.USTAR_FORMAT), ("", tarfile.PAX_FORMAT)]):
        with tarfile.open(root / f"part-{shard}.tar", "w", format=fmt) as tf:
            for i in range(8):
                key = f"{prefix}s{shard}_{i:02d}"
                fields = {"cls": str(i % 3).encode(), "jpg": bytes([shard, i]) * (50 + 40 * i)}
                if i % 2:
                    fields["txt"] = f"caption {i}".encode()
                for field, data in fields.items():
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
                expected[key] = fields
    for cache in ["auto", "copy"]:
        loader = shardstream.Loader(str(root), batch_size=4, shuffle=False, cache=cache, connect=daemon.addr)
        seen = {}
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                seen[key] = {f: bytes(batch[f][i]) for f in ("cls", "jpg", "txt") if batch[f][i] is not None}
        assert loader.stats()["transport"] == "shm"
        assert seen == expected, cache


MAP_IN_PLACE_TRAINER = textwrap.dedent(
    """
    import hashlib, json, sys, shardstream
    loader = shardstream.Loader(sys.argv[1], batch_size=64, seed=4, connect=sys.argv[2])
    kinds, digests = set(), {}
    for batch in loader:
        for key, v in zip(batch["__key__"], batch["jpg"]):
            kinds.add(type(v.obj).__name__)
            digests[key] = hashlib.sha256(v).hexdigest()
    print(json.dumps({"kinds": sorted(kinds), "digests": digests}))
    """
)


@pytest.mark.parametrize("value", ["1", "0"])
def test_map_in_place_when_the_trainer_vouches(daemon, dataset, value: str) -> None:
    """SHARDSTREAM_MAP_IN_PLACE=1 (read once per process, hence a subprocess): shards read in place
    are mapped, zero-copy, like node-cache copies; any other value keeps the safe buffered reads."""
    import hashlib
    import json

    root, samples = dataset
    r = subprocess.run(
        [sys.executable, "-c", MAP_IN_PLACE_TRAINER, str(root), daemon.addr],
        env={**os.environ, "SHARDSTREAM_MAP_IN_PLACE": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kinds"] == (["Region"] if value == "1" else ["Buffer"])
    assert out["digests"] == {k: hashlib.sha256(f["jpg"]).hexdigest() for k, f in samples.items()}


KEPT_MAPPINGS_TRAINER = textwrap.dedent(
    """
    import collections, gc, hashlib, json, os, sys, time, shardstream

    def shard_mappings():
        # Mappings of node-cache copies (mapped shards), by file: each should appear once.
        with open("/proc/self/maps") as f:
            paths = [line.split(maxsplit=5)[-1].strip() for line in f if line.rstrip().endswith(".tar")]
        return collections.Counter(paths)

    epochs = []
    for epoch in range(2):
        loader = shardstream.Loader(sys.argv[1], batch_size=64, seed=epoch, cache="copy", connect=sys.argv[2])
        digests = {}
        for batch in loader:
            for key, v in zip(batch["__key__"], batch["jpg"]):
                digests[key] = hashlib.sha256(v).hexdigest()
        del batch, loader, v
        gc.collect()
        # A stream's mappings go when its receiver thread ends, just after the stream.
        deadline = time.monotonic() + 10
        while (mapped := shard_mappings()) and os.environ.get("SHARDSTREAM_KEEP_MAPPED_BYTES") == "0":
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        epochs.append({"digests": digests, "mapped": mapped})
    print(json.dumps(epochs))
    """
)


@pytest.mark.parametrize("limit", [None, "0", "64MiB"])
def test_a_process_keeps_its_shard_mappings_for_the_next_epoch(daemon, dataset, limit: str | None) -> None:
    """The shards a stream mapped stay mapped after it (the next epoch's stream uses them: each
    shard is mapped once in the process, not once per epoch), within SHARDSTREAM_KEEP_MAPPED_BYTES
    (a size as the daemon's flags take one); 0 keeps none, and every mapping goes with its stream
    (read once per process: a subprocess)."""
    import hashlib
    import json

    root, samples = dataset
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTREAM_KEEP_MAPPED_BYTES"}
    if limit is not None:
        env["SHARDSTREAM_KEEP_MAPPED_BYTES"] = limit
    r = subprocess.run(
        [sys.executable, "-c", KEPT_MAPPINGS_TRAINER, str(root), daemon.addr],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    want = {k: hashlib.sha256(f["jpg"]).hexdigest() for k, f in samples.items()}
    shards = len(list(root.glob("*.tar")))
    for epoch in json.loads(r.stdout):
        assert epoch["digests"] == want
        if limit == "0":
            assert epoch["mapped"] == {}, "nothing kept: every mapping goes with its stream"
        else:
            assert len(epoch["mapped"]) == shards, epoch["mapped"]
            assert set(epoch["mapped"].values()) == {1}, f"a shard mapped twice: {epoch['mapped']}"


def test_a_bad_keep_mapped_bytes_fails_the_stream_naming_it(daemon, dataset) -> None:
    root, _ = dataset
    r = subprocess.run(
        [sys.executable, "-c", KEPT_MAPPINGS_TRAINER, str(root), daemon.addr],
        env={**os.environ, "SHARDSTREAM_KEEP_MAPPED_BYTES": "8 gigs"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert 'SHARDSTREAM_KEEP_MAPPED_BYTES: unknown size unit "gigs" in "8 gigs"' in r.stderr, r.stderr


MANY_SHARDS_TRAINER = textwrap.dedent(
    """
    import json, resource, sys, shardstream
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), hard))
    keys = []
    for batch in shardstream.Loader(sys.argv[1], batch_size=16, seed=3, connect=sys.argv[2]):
        keys.extend(batch["__key__"])
    print(json.dumps(keys))
    """
)


def test_an_epoch_over_more_shards_than_open_files_allowed(daemon, tmp_path) -> None:
    """A stream holds a descriptor (or a mapping) of a shard only while it uses it: an epoch of
    600 shards runs in a process allowed 256 open files. A client used to keep every shard of
    its stream until the stream ended, and a dataset of more shards than `ulimit -n` failed
    mid-epoch with "SHARD_FD frame without a descriptor"."""
    import json

    from conftest import write_dataset

    root = tmp_path / "many"
    samples = write_dataset(root, n=1200, per_shard=2, seed=11)
    assert len(list(root.glob("*.tar"))) == 600
    r = subprocess.run(
        [sys.executable, "-c", MANY_SHARDS_TRAINER, str(root), daemon.addr, "256"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    keys = json.loads(r.stdout)
    assert sorted(keys) == sorted(samples) and len(keys) == len(set(keys))


@pytest.mark.parametrize("fields", [None, ["cls"]])
def test_bytes_served_counts_the_payload_delivered_on_every_transport(own_daemon, dataset, fields) -> None:
    # status's bytes_served and shardstream_bytes_served_total ("payload bytes delivered") counted
    # a shm batch's whole sample ranges: TAR headers and every field, 3.6x the payload here, and
    # 5,000x it with fields=["cls"]. Inline counted the payload.
    root, _ = dataset
    got = {}
    for transport in ("shm", "inline"):
        before = own_daemon.status()["bytes_served"]
        kw = {"fields": fields, "transport": transport, "connect": own_daemon.addr}
        loader = shardstream.Loader(str(root), batch_size=64, **kw)
        payload = sum(len(v) for b in loader for k, vs in b.items() if k != "__key__" for v in vs if v is not None)
        assert loader.stats()["transport"] == transport
        got[transport] = (payload, own_daemon.status()["bytes_served"] - before)
    assert got["shm"] == got["inline"] and got["shm"][0] == got["shm"][1], got


def test_inline_on_request(daemon, dataset) -> None:
    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=64, transport="inline", connect=daemon.addr)
    keys = [k for b in loader for k in b["__key__"]]
    assert sorted(keys) == sorted(samples) and loader.stats()["transport"] == "inline"


def test_leases_follow_views_and_release(own_daemon, dataset) -> None:
    daemon = own_daemon
    root, _ = dataset
    gc.collect()
    assert wait_for(lambda: status(daemon.addr)["leased_shards"] == 0)
    loader = shardstream.Loader(str(root), batch_size=16, connect=daemon.addr)
    it = iter(loader)
    batch = next(it)
    view = batch["jpg"][0]
    held = bytes(view)
    assert status(daemon.addr)["leased_shards"] >= 1
    batch.release()  # explicit release: the lease ends, the view stays readable
    del batch
    it.close()
    assert wait_for(lambda: status(daemon.addr)["leased_shards"] == 0)
    assert bytes(view) == held

    it = iter(loader)
    batch = next(it)
    views = batch["jpg"]
    del batch
    it.close()
    gc.collect()
    assert status(daemon.addr)["leased_shards"] >= 1, "live views keep their batch leased"
    del views
    gc.collect()
    assert wait_for(lambda: status(daemon.addr)["leased_shards"] == 0)


HOLDER = textwrap.dedent(
    """
    import sys, time, shardstream
    loader = shardstream.Loader(sys.argv[1], batch_size=8, connect=sys.argv[2])
    it = iter(loader)
    held = [next(it) for _ in range(3)]
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_client_is_reclaimed(dataset, tmp_path) -> None:
    root, _ = dataset
    d = Daemon(tmp_path).start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), d.addr], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        s = status(d.addr)
        assert s["leased_shards"] >= 1 and s["shm_sessions"] >= 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert wait_for(lambda: status(d.addr)["leased_shards"] == 0 and status(d.addr)["shm_sessions"] == 0)
        assert time.monotonic() - t0 < 5
        # The daemon still serves.
        loader = shardstream.Loader(str(root), batch_size=256, connect=d.addr)
        assert sum(len(b["__key__"]) for b in loader) > 0
    finally:
        assert d.stop() == 0


def test_ended_streams_a_client_keeps_attached_are_bounded_per_client(dataset, tmp_path) -> None:
    """A client that ends its streams and keeps their side channels held a session each (a
    thread, descriptors, leases) without bound: a trial's thousands took every descriptor of the
    daemon and every other client hung. They count against --max-streams-per-client now."""
    root, _ = dataset
    d = Daemon(tmp_path, args=["--max-streams-per-client", "2"]).start()
    try:
        held = []
        for seed in range(2):
            it = iter(shardstream.Loader(str(root), batch_size=8, seed=seed, connect=d.addr))
            held.append(next(it))  # a batch kept past the stream's end keeps its session
            it.close()
        assert wait_for(lambda: status(d.addr)["active_streams"] == 0)
        with pytest.raises(shardstream.ShardstreamError, match=r"keeps 2 shared-memory streams that ended attached"):
            next(iter(shardstream.Loader(str(root), batch_size=8, connect=d.addr)))
        # Inline streams hold no session; and a batch let go of makes room.
        assert next(iter(shardstream.Loader(str(root), batch_size=8, connect=d.addr, transport="inline")))
        held.pop().release()
        gc.collect()
        assert wait_for(lambda: status(d.addr)["shm_sessions"] <= 1)
        assert sum(len(b["__key__"]) for b in shardstream.Loader(str(root), batch_size=256, connect=d.addr)) > 0
    finally:
        assert d.stop() == 0


def frame(version: int, kind: int, token: bytes = b"\0" * 16) -> bytes:
    return struct.pack("<IHHQQ", int.from_bytes(b"SSHM", "little"), version, kind, 0, 0) + token + b"\0" * 24


def side_channel(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(addr.removeprefix("unix://") + ".shm")
    return s


def test_side_channel_refuses_other_layouts_and_unknown_tokens(daemon, dataset) -> None:
    s = side_channel(daemon.addr)
    s.send(frame(99, 1))
    reply = s.recv(128)
    assert struct.unpack("<H", reply[6:8])[0] == 5  # ERROR
    msg = reply[24:].rstrip(b"\0").decode()
    assert "version 99" in msg and "version 1" in msg, msg
    s = side_channel(daemon.addr)
    s.send(frame(1, 1, os.urandom(16)))
    assert b"unknown" in s.recv(128)
    assert_still_serves = shardstream.Loader(str(dataset[0]), batch_size=512, connect=daemon.addr)
    assert sum(len(b["__key__"]) for b in assert_still_serves) == len(dataset[1])


def test_side_channel_socket_is_private(daemon) -> None:
    path = daemon.addr.removeprefix("unix://")
    for p in (path, path + ".shm"):
        assert os.stat(p).st_mode & 0o077 == 0, f"{p} is accessible to others"


def test_the_node_cache_is_private_and_a_shared_one_is_warned_of(dataset, tmp_path) -> None:
    # The cache was made 0755 with copies 0644: any local user could read the cached copy of a
    # dataset the allow list refused them. Clients get descriptors, never paths, so the daemon's
    # user alone needs it.
    root, samples = dataset
    d = Daemon(tmp_path / "own", log=tmp_path / "own.log")
    d.tmp.mkdir()
    d.start()
    assert sum(len(b["__key__"]) for b in shardstream.Loader(str(root), cache="copy", connect=d.addr)) == len(samples)
    assert d.stop() == 0
    assert d.cache_dir.stat().st_mode & 0o777 == 0o700
    assert "readable" not in (tmp_path / "own.log").read_text()
    shared = Daemon(tmp_path / "shared", log=tmp_path / "shared.log")
    shared.cache_dir.mkdir(parents=True, mode=0o755)
    shared.cache_dir.chmod(0o755)
    shared.start()
    assert shared.stop() == 0
    log = (tmp_path / "shared.log").read_text()
    assert f"{shared.cache_dir}" in log and "0755" in log and "chmod 0700" in log, log


def test_tcp_gets_inline_and_refuses_shm(dataset, tmp_path) -> None:
    root, samples = dataset
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [SHARDSTREAM, "serve", "--listen", addr, "--insecure", "--cache-dir", str(tmp_path / "c"), "--log", "warn"]
    )
    try:
        assert wait_for(lambda: shardstream._native.probe(addr), 30)
        loader = shardstream.Loader(str(root), batch_size=128, connect=addr)
        assert sum(len(b["__key__"]) for b in loader) == len(samples)
        assert loader.stats()["transport"] == "inline"
        with pytest.raises(ValueError, match="shm"):
            next(iter(shardstream.Loader(str(root), transport="shm", connect=addr)))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("kind", ["webdataset", "parquet", "packed"])
def test_a_rank_without_a_batch_gets_an_empty_epoch(daemon, tmp_path, transport: str, kind: str) -> None:
    # drop_last with more ranks (or a larger batch) than the data fills: a rank's stream has no
    # batch at all. Its epoch is empty, as torch's DataLoader makes it; not an attach error.
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch.utils.data
    import webdataset as wds

    import shardstream.torch as sst

    if kind == "parquet":
        pq.write_table(pa.table({"id": list(range(20))}), tmp_path / "a.parquet")
    else:
        with wds.TarWriter(str(tmp_path / "a-000000.tar")) as sink:
            for i in range(20):
                sink.write({"__key__": f"k{i:02d}", "cls": b"%d" % i})
    extra = {"collate": "stack", "fields": ["cls"]} if kind == "packed" else {}
    for kw in ({"batch_size": 64}, {"batch_size": 8, "rank": 2, "world_size": 3}):
        loader = shardstream.Loader(
            str(tmp_path), connect=daemon.addr, transport=transport, drop_last=True, **kw, **extra
        )
        assert len(loader) == 0 and list(loader) == [], kw
        loader.set_epoch(1)
        assert list(loader) == [], kw
        ds = sst.IterableDataset(str(tmp_path), connect=daemon.addr, transport=transport, drop_last=True, **kw, **extra)
        assert list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)) == [], kw
    # The daemon serves on: the ranks with batches get theirs.
    got = shardstream.Loader(str(tmp_path), connect=daemon.addr, transport=transport, batch_size=8, drop_last=True)
    assert sum(len(b["__key__"]) for b in got) == 16


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_views_of_many_epochs_leave_no_python_objects_behind(daemon, dataset, transport: str) -> None:
    """Each zero-copy field value was cut from its batch's memoryview with a slice whose two
    ints were never freed (pyo3's PySlice::new hands PySlice_New new references it keeps): two
    objects per field of every sample, 80 MB an epoch of ImageNet. Epochs after the first must
    leave the interpreter's allocated blocks where they were."""
    import gc
    import sys

    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=32, connect=daemon.addr, transport=transport)
    for _ in loader:
        pass
    gc.collect()
    before = sys.getallocatedblocks()
    epochs = 5
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    gc.collect()
    grown = (sys.getallocatedblocks() - before) / epochs
    # Two fields per sample leaked ~4 blocks a sample; what may remain is noise.
    assert grown < len(samples) / 10, f"{grown:.0f} blocks more per epoch of {len(samples)} samples"
    loader.close()


def test_copies_kept_do_not_hold_the_stream(daemon, dataset) -> None:
    """With copy=True every value is bytes of its own, yet each batch kept its ring credit until
    it was dropped: keeping 16 batches (list(loader), a validation set in memory) stalled the
    stream for good, with a warning to "keep copies". A copied batch gives its credit back."""
    import subprocess
    import sys
    import textwrap

    root, samples = dataset
    code = textwrap.dedent(
        """
        import sys, shardstream
        loader = shardstream.Loader(sys.argv[1], batch_size=16, copy=True, connect=sys.argv[2])
        kept = list(loader)
        assert len(kept) == len(loader), (len(kept), len(loader))
        assert all(isinstance(v, bytes) for b in kept for v in b["jpg"])
        print(sum(len(b["__key__"]) for b in kept))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), daemon.addr], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) == len(samples)
