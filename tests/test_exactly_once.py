"""Exactly once across ranks and DataLoader workers, bytes identical to what webdataset wrote."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch.utils.data

import shardstream
import shardstream.torch as sst


def check_batch(batch: dict, samples: dict[str, dict[str, bytes]]) -> None:
    for i, key in enumerate(batch["__key__"]):
        src = samples[key]
        for field in ("jpg", "cls", "json"):
            got = batch[field][i]
            if field in src:
                assert bytes(got) == src[field], f"{key}.{field} differs"
            else:
                assert got is None, f"{key} has no {field} but got {got!r}"


@pytest.mark.parametrize("drop_last", [False, True])
def test_four_ranks_two_workers_exactly_once(daemon, dataset, drop_last: bool) -> None:
    root, samples = dataset
    world, batch_size = 4, 32
    seen: collections.Counter[str] = collections.Counter()
    batches_per_rank = []
    padded = dropped = None
    for rank in range(world):
        ds = sst.IterableDataset(
            str(root),
            batch_size=batch_size,
            seed=7,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            connect=daemon.addr,
        )
        ds.set_epoch(3)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        n = 0
        for batch in dl:
            check_batch(batch, samples)
            assert all(isinstance(v, bytes) for v in batch["jpg"]), "workers must hand over picklable bytes"
            seen.update(batch["__key__"])
            n += 1
        assert n == len(ds)
        batches_per_rank.append(n)
        probe = shardstream.Loader(
            str(root),
            batch_size=batch_size,
            seed=7,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            connect=daemon.addr,
        )
        next(iter(probe))
        padded, dropped = probe._header["padded_samples"], probe._header["dropped_samples"]
    assert len(set(batches_per_rank)) == 1, f"ranks got different batch counts: {batches_per_rank}"
    total = len(samples)
    if drop_last:
        assert max(seen.values()) == 1
        assert sum(seen.values()) == total - dropped
        assert len(seen) == total - dropped
    else:
        assert set(seen) == set(samples), "some samples were never delivered"
        assert sum(seen.values()) == total + padded
        assert padded == (-total) % world
        assert sum(c - 1 for c in seen.values()) == padded


def test_workers_reproduce_the_single_loader_order(daemon, dataset) -> None:
    root, _ = dataset
    single = shardstream.Loader(str(root), batch_size=16, seed=3, connect=daemon.addr)
    single.set_epoch(1)
    expected = [k for b in single for k in b["__key__"]]
    ds = sst.IterableDataset(str(root), batch_size=16, seed=3, connect=daemon.addr)
    ds.set_epoch(1)
    got = [k for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=3) for k in b["__key__"]]
    assert got == expected


def test_determinism_and_epochs_differ(daemon, dataset) -> None:
    root, samples = dataset

    def order(seed: int, epoch: int) -> list[str]:
        loader = shardstream.Loader(str(root), batch_size=50, seed=seed, connect=daemon.addr)
        loader.set_epoch(epoch)
        return [k for b in loader for k in b["__key__"]]

    a = order(1, 0)
    assert a == order(1, 0)
    assert sorted(a) == sorted(samples)
    assert a != order(1, 1)
    assert a != order(2, 0)
    assert a != sorted(a), "shuffle=True must not deliver the sorted order"


def test_no_shuffle_is_dataset_order_and_fields_filter(daemon, dataset) -> None:
    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=100, shuffle=False, fields=["cls"], connect=daemon.addr)
    keys = []
    for b in loader:
        assert set(b) == {"__key__", "cls"}
        for k, v in zip(b["__key__"], b["cls"], strict=True):
            assert bytes(v) == samples[k]["cls"]
        keys += b["__key__"]
    assert keys == list(samples), "without shuffle the order is the shards' order"
    s = loader.stats()
    assert s["samples"] == len(samples) and s["transport"] == "shm"
    assert s["bytes"] == sum(len(v["cls"]) for v in samples.values())


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("fields", [["jpg", "cls"], ["json", "cls"], ["json", "jpg", "cls"], ["cls", "json"]])
def test_fields_in_any_order_deliver_their_own_bytes(daemon, dataset, transport: str, fields: list[str]) -> None:
    # webdataset writes a sample's members in sorted order (cls, jpg, json): asking for fields in
    # another order, some of them only, makes the inline gather move payloads against the shard's
    # order, over bytes another wanted field has not yet been taken from.
    root, samples = dataset
    loader = shardstream.Loader(
        str(root), batch_size=100, shuffle=False, fields=fields, transport=transport, connect=daemon.addr
    )
    seen = 0
    for b in loader:
        assert set(b) == {"__key__", *fields}
        for i, key in enumerate(b["__key__"]):
            for field in fields:
                want = samples[key].get(field)
                got = b[field][i]
                assert (None if got is None else bytes(got)) == want, f"{key}.{field} differs ({transport})"
        seen += len(b["__key__"])
    assert seen == len(samples)
    assert loader.stats()["transport"] == transport


def test_zero_copy_views(daemon, dataset) -> None:
    root, samples = dataset
    import numpy as np

    loader = shardstream.Loader(str(root), batch_size=64, connect=daemon.addr)
    batch = next(iter(loader))
    views = batch["jpg"]
    assert all(isinstance(v, memoryview) and v.readonly for v in views)
    arr = np.frombuffer(views[0], np.uint8)
    assert arr.tobytes() == samples[batch["__key__"][0]]["jpg"]
    # Views point into shared buffers (the shard's mapping with shm, the message with inline):
    # the batch's bytes were not copied per sample.
    assert len({id(v.obj) for v in views}) < len(views)
    del loader, batch
    assert arr.sum() >= 0  # the view keeps its buffer alive after the batch is gone


def test_embedded_server_with_forked_workers(dataset, monkeypatch) -> None:
    root, samples = dataset
    monkeypatch.setattr(shardstream._native, "DEFAULT_SOCKET", "/nonexistent/shardstream.sock")
    ds = sst.IterableDataset(str(root), batch_size=64, seed=5)
    assert ds._kwargs["connect"].startswith("unix://")
    keys = [k for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2) for k in b["__key__"]]
    assert sorted(keys) == sorted(samples)


def test_env_address_and_rank_defaults(daemon, dataset, monkeypatch) -> None:
    root, samples = dataset
    monkeypatch.setenv("SHARDSTREAM_ADDR", daemon.addr)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = shardstream.Loader(str(root), batch_size=100)
    assert loader.address == daemon.addr and (loader.rank, loader.world_size) == (1, 2)
    n = sum(len(b["__key__"]) for b in loader)
    assert n == -(-len(samples) // 2)


def _in_fresh_python(code: str, env: dict[str, str]) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_loader_does_not_import_torch(daemon, dataset) -> None:
    # Asking torch.distributed for the rank imported torch (1.5-2 s and ~2 CPU-s here) in every
    # process that had not: a JAX or plain-numpy trainer, or a consumer timing its first batch.
    root, _ = dataset
    code = (
        "import sys, shardstream\n"
        f"loader = shardstream.Loader({str(root)!r}, batch_size=100, connect={daemon.addr!r})\n"
        "print(loader.rank, loader.world_size, 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    assert _in_fresh_python(code, env) == "0 1 False"


def test_rank_defaults_come_from_an_initialized_process_group(daemon, dataset, tmp_path) -> None:
    # torch.distributed, once the trainer has initialized it, wins over RANK / WORLD_SIZE.
    root, _ = dataset
    code = (
        "import torch.distributed as dist, shardstream\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/pg', rank=0, world_size=1)\n"
        f"loader = shardstream.Loader({str(root)!r}, batch_size=100, connect={daemon.addr!r})\n"
        "print(loader.rank, loader.world_size)\n"
    )
    assert _in_fresh_python(code, {**os.environ, "RANK": "3", "WORLD_SIZE": "5"}) == "0 1"


def test_brace_pattern_and_file_url(daemon, dataset) -> None:
    root, samples = dataset
    loader = shardstream.Loader(f"file://{root}/train-{{000000..000001}}.tar", batch_size=64, connect=daemon.addr)
    assert loader.info["num_shards"] == 2
    n = sum(len(b["__key__"]) for b in loader)
    assert n == 2 * 97


def test_status_and_cli(daemon, dataset) -> None:
    import json
    import subprocess

    from conftest import SHARDSTREAM

    root, _ = dataset
    out = subprocess.run(
        [SHARDSTREAM, "status", "--connect", daemon.addr, "--json"], check=True, capture_output=True, text=True
    ).stdout
    status = json.loads(out)
    assert status["samples_served"] > 0
    assert any(d["url"] == str(root) for d in status["datasets"])
    helptext = subprocess.run([SHARDSTREAM, "--help"], check=True, capture_output=True, text=True).stdout
    for cmd in ("serve", "index", "status"):
        assert cmd in helptext


@pytest.mark.parametrize("cache", ["direct", "copy"])
def test_a_shard_the_manifest_lists_but_the_disk_lacks_says_so(daemon, tmp_path: Path, cache: str) -> None:
    """Opening from a manifest reads no shard, so a shard deleted since is found at its first use;
    the error said only "path not found", as if the dataset had been listed."""
    import subprocess

    from conftest import SHARDSTREAM, write_dataset

    root = tmp_path / "ds"
    write_dataset(root, n=200, per_shard=100, seed=4)
    subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True)
    (root / "train-000001.tar").unlink()
    loader = shardstream.Loader(str(root), batch_size=50, shuffle=False, cache=cache, connect=daemon.addr)
    gone = r"shard listed in manifest.json \(restore it, or run `shardstream index` again\) not found: .*train-000001"
    with pytest.raises(FileNotFoundError, match=gone):
        for _ in loader:
            pass


def test_index_writes_manifest_and_is_verified(daemon, tmp_path: Path) -> None:
    import json
    import subprocess

    from conftest import SHARDSTREAM, write_dataset

    root = tmp_path / "ds"
    samples = write_dataset(root, n=300, per_shard=100, seed=11)
    out = subprocess.run([SHARDSTREAM, "index", str(root)], check=True, capture_output=True, text=True).stdout
    assert "indexed 3 shards, 300 samples" in out
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["version"] == 1 and [s["samples"] for s in manifest["shards"]] == [100, 100, 100]
    loader = shardstream.Loader(str(root), batch_size=50, connect=daemon.addr)
    assert loader.info["from_manifest"]
    assert sorted(k for b in loader for k in b["__key__"]) == sorted(samples)

    # Flip one payload byte in place (same size): the shard no longer matches its checksum.
    shard = root / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = tmp_path / "ds-copy"
    fresh.mkdir()
    for p in root.iterdir():
        if p.is_file():
            (fresh / p.name).write_bytes(p.read_bytes())
    (fresh / "_shardstream").mkdir()
    for p in (root / "_shardstream").iterdir():
        (fresh / "_shardstream" / p.name).write_bytes(p.read_bytes())
    loader = shardstream.Loader(str(fresh), batch_size=50, shuffle=False, connect=daemon.addr)
    delivered = []
    with pytest.raises(shardstream.ShardError) as err:
        for b in loader:
            delivered += b["__key__"]
    assert "train-000001.tar" in str(err.value) and "crc32c" in str(err.value)
    assert err.value.shard.endswith("train-000001.tar")
    # A new Loader reads the same manifest: the way out is the manifest's (it said "open the
    # dataset again (a new Loader)", which fails the same way).
    assert "restore it, or describe it as it is now with `shardstream index`" in str(err.value)
    assert "new Loader" not in str(err.value)
    assert not any(k.startswith("s11/0001") for k in delivered), "no sample of the corrupt shard was delivered"
