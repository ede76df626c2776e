"""Packed mode (``collate="stack"``) end to end: the daemon gathers each batch's fixed-size records
into a slot of a shared-memory ring, the client gets read-only numpy arrays (torch tensors through
``shardstream.torch``) over that memory, slots are bounded by credits and reclaimed when a client
dies, and the inline transport gives the same arrays."""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import shardstream
from conftest import SHARDSTREAM, Daemon, hold_batches_until_warned, run_child_ok, wait_for, write_token_blocks

RECORD = 512


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """1,000 samples of RECORD-byte token blocks (int32) and a 4-byte label, by webdataset."""
    root = tmp_path_factory.mktemp("tokens")
    return root, write_token_blocks(root, 1000, RECORD, per_shard=150, seed=7, label_mod=10)


def test_packed_arrays_are_zero_copy_read_only_and_exactly_once(daemon, tokens) -> None:
    root, records = tokens
    loader = shardstream.Loader(
        str(root), batch_size=64, seed=3, fields=["tok", "lbl"], collate="stack", connect=daemon.addr
    )
    seen: list[str] = []
    for batch in loader:
        arr, lbl = batch["tok"], batch["lbl"]
        n = len(batch["__key__"])
        assert isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.shape == (n, RECORD)
        assert lbl.shape == (n, 4)
        assert not arr.flags.writeable
        # The array's memory is the ring: at the end of its chain of bases is a native column.
        owner = arr
        while isinstance(owner, np.ndarray):
            owner = owner.base
        owner = owner.obj if isinstance(owner, memoryview) else owner
        assert type(owner).__name__ == "Column"
        toks = arr.view(np.int32)
        for i, key in enumerate(batch["__key__"]):
            assert arr[i].tobytes() == records[key]
            assert int(toks[i, 0]) == int(key[1:])
            assert int(lbl[i].view(np.int32)[0]) == int(key[1:]) % 10
        seen.extend(batch["__key__"])
    assert sorted(seen) == sorted(records)
    stats = loader.stats()
    assert stats["transport"] == "shm" and stats["packed"] is True
    assert stats["bytes"] == len(records) * (RECORD + 4)
    with pytest.raises(ValueError):
        arr[0, 0] = 1  # read-only: a client cannot write into the daemon's ring


def test_node_cache_copies_give_the_same_arrays(daemon, tokens) -> None:
    """Through the node cache the daemon gathers from its own mapping of the cached shard."""
    root, records = tokens
    loader = shardstream.Loader(
        str(root), batch_size=128, seed=9, fields=["tok"], collate="stack", cache="copy", connect=daemon.addr
    )
    n = 0
    for batch in loader:
        for i, key in enumerate(batch["__key__"]):
            assert batch["tok"][i].tobytes() == records[key]
            n += 1
    assert n == len(records) and loader.stats()["packed"] is True


def test_large_batches_gathered_in_parallel_keep_their_order(daemon, tmp_path) -> None:
    """Batches of 1 MiB and more are gathered by several threads, each into its own records."""
    root = tmp_path / "big"
    root.mkdir()
    rng = np.random.default_rng(11)
    blocks = {f"b{i:04d}": rng.integers(0, 256, 8192, dtype=np.uint8).tobytes() for i in range(600)}
    with wds.ShardWriter(str(root / "big-%04d.tar"), maxcount=100, verbose=0) as sink:
        for key, block in blocks.items():
            sink.write({"__key__": key, "bin": block})
    kw = dict(batch_size=256, seed=2, fields=["bin"], collate="stack", connect=daemon.addr)
    for cache in ("direct", "copy"):
        packed = shardstream.Loader(str(root), cache=cache, **kw)
        inline = shardstream.Loader(str(root), cache=cache, transport="inline", **kw)
        for p, q in zip(packed, inline, strict=True):
            assert p["__key__"] == q["__key__"]
            assert np.array_equal(p["bin"], q["bin"])
            for i, key in enumerate(p["__key__"]):
                assert p["bin"][i].tobytes() == blocks[key]
        assert packed.stats()["packed"] is True and packed.stats()["samples"] == len(blocks)


def test_inline_transport_stacks_the_same_arrays(daemon, tokens) -> None:
    root, _ = tokens
    kw = dict(batch_size=100, seed=5, fields=["tok"], collate="stack", connect=daemon.addr)
    packed = [(b["__key__"], b["tok"].copy()) for b in shardstream.Loader(str(root), **kw)]
    inline_loader = shardstream.Loader(str(root), transport="inline", **kw)
    inline = [(b["__key__"], b["tok"]) for b in inline_loader]
    assert inline_loader.stats()["packed"] is False and inline_loader.stats()["transport"] == "inline"
    assert len(packed) == len(inline)
    for (k1, a1), (k2, a2) in zip(packed, inline, strict=True):
        assert k1 == k2 and np.array_equal(a1, a2)


def test_fields_that_cannot_be_stacked_are_refused_naming_the_sample(daemon, dataset) -> None:
    root, samples = dataset
    for transport in ("shm", "inline"):
        with pytest.raises(ValueError, match=r"equal-length .jpg. within a batch: sample .s0/"):
            for _ in shardstream.Loader(
                str(root), fields=["jpg"], collate="stack", transport=transport, connect=daemon.addr
            ):
                pass
        with pytest.raises(ValueError, match="in every sample"):
            for _ in shardstream.Loader(
                str(root), fields=["json"], collate="stack", transport=transport, connect=daemon.addr
            ):
                pass
    with pytest.raises(ValueError, match="collate"):
        shardstream.Loader(str(root), collate="pad", connect=daemon.addr)
    # The daemon still serves everyone.
    assert sum(len(b["__key__"]) for b in shardstream.Loader(str(root), connect=daemon.addr)) == len(samples)


def test_release_and_dropped_arrays_return_slots(daemon, tokens) -> None:
    root, _ = tokens
    gc.collect()
    loader = shardstream.Loader(str(root), batch_size=10, fields=["tok"], collate="stack", connect=daemon.addr)
    # Holding arrays (not the batches) keeps their slots; with 8 slots, a consumer that keeps
    # every array would stall, one that keeps a few does not.
    kept = []
    for i, batch in enumerate(loader):
        if i < 3:
            kept.append(batch["tok"])
        elif i % 2:
            batch.release()
    assert len(kept) == 3 and all(a.shape == (10, RECORD) for a in kept)
    del batch
    gc.collect()
    # The stream is over, but the kept arrays still hold their slots: the ring stays.
    assert daemon.status()["ring_bytes"] > 0
    del kept
    gc.collect()
    assert wait_for(lambda: daemon.status()["ring_bytes"] == 0)


HOLDER = textwrap.dedent(
    """
    import sys, shardstream
    loader = shardstream.Loader(sys.argv[1], batch_size=4, fields=["tok"], collate="stack", connect=sys.argv[2])
    held = []
    for batch in loader:
        held.append(batch)
        print("got", len(held), flush=True)
    """
)


def test_a_client_that_never_releases_is_bounded_and_reclaimed_after_sigkill(tokens, tmp_path) -> None:
    root, _ = tokens
    slots = 5
    d = Daemon(tmp_path, args=["--ring-slots", str(slots)]).start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), d.addr], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(slots)]
        assert lines[-1] == f"got {slots}", lines
        ring = d.status()["ring_bytes"]
        assert 0 < ring <= 4096 * (slots + 1), ring
        # Its slots are all held: the daemon sends nothing more, and its memory does not grow.
        time.sleep(1.0)
        assert proc.poll() is None
        assert d.status()["ring_bytes"] == ring
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert wait_for(lambda: d.status()["ring_bytes"] == 0 and d.status()["shm_sessions"] == 0)
        assert time.monotonic() - t0 < 5
        # Its ring waits for this user's next stream, which writes over the dead client's batches.
        assert d.status()["kept_rings"] == 1
        loader = shardstream.Loader(str(root), batch_size=4, fields=["tok"], collate="stack", connect=d.addr)
        assert sum(len(b["__key__"]) for b in loader) == 1000
        assert (d.status()["rings_made"], d.status()["rings_reused"]) == (1, 1)
    finally:
        assert d.stop() == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["view", "packed"])
def test_a_stream_stalled_by_the_batches_its_process_holds_says_so(tokens, tmp_path, mode: str) -> None:
    # A trainer (or a transform's results) keeping every batch it was given holds every credit of
    # its stream: the daemon can make no more, and the loop waits for good. It must say why, once,
    # and go on as soon as batches are let go (another thread may well be about to).
    root, records = tokens
    flag = "--shm-credits" if mode == "view" else "--ring-slots"
    d = Daemon(tmp_path, args=[flag, "3"]).start()
    try:
        kwargs = {"fields": ["tok"], "collate": "stack"} if mode == "packed" else {"fields": ["tok"]}
        loader = shardstream.Loader(str(root), batch_size=50, cache="copy", connect=d.addr, **kwargs)
        t0 = time.monotonic()
        stalled, keys = hold_batches_until_warned(loader)
        assert len(stalled) == 1, stalled
        message = stalled[0]
        assert "all 3 of the stream's credits" in message and "not released" in message, message
        assert time.monotonic() - t0 < 30
        assert sorted(keys) == sorted(records)
        # Holding every batch of a stream to its end is no stall: the end needs no credit.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            few = shardstream.Loader(str(root), batch_size=400, cache="copy", connect=d.addr, **kwargs)
            kept = list(few)
        assert len(kept) == 3 and not caught, [str(w.message) for w in caught]
    finally:
        assert d.stop() == 0


ONE_EPOCH = textwrap.dedent(
    """
    import sys, shardstream
    loader = shardstream.Loader(sys.argv[1], batch_size=64, fields=["tok"], collate="stack", connect=sys.argv[2])
    print(sum(len(b["__key__"]) for b in loader), flush=True)
    """
)


def test_each_epoch_reuses_the_ring_of_the_one_before_in_this_process_or_another(tokens, tmp_path) -> None:
    root, records = tokens
    d = Daemon(tmp_path).start()
    try:

        def epoch(seed: int) -> None:
            loader = shardstream.Loader(
                str(root), batch_size=64, seed=seed, fields=["tok"], collate="stack", connect=d.addr
            )
            seen = []
            for batch in loader:
                for i, key in enumerate(batch["__key__"]):
                    assert batch["tok"][i].tobytes() == records[key], key
                seen.extend(batch["__key__"])
            assert sorted(seen) == sorted(records)

        epoch(1)
        gc.collect()
        # The stream's side channel closed: its ring waits for this user's next stream.
        assert wait_for(lambda: d.status()["kept_rings"] == 1, timeout=10)
        st = d.status()
        assert st["ring_bytes"] == 0 and st["kept_ring_bytes"] > 0 and st["rings_made"] == 1, st
        # The next epoch writes over the earlier one's batches in the same ring: every record is
        # still the right one, exactly once.
        epoch(2)
        gc.collect()
        st = d.status()
        assert (st["rings_made"], st["rings_reused"]) == (1, 1), st
        assert wait_for(lambda: d.status()["kept_rings"] == 1, timeout=10)
        # A new process of the same user (the next epoch's DataLoader worker, say) gets it too.
        out = subprocess.run(
            [sys.executable, "-c", ONE_EPOCH, str(root), d.addr], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == str(len(records))
        st = d.status()
        assert (st["rings_made"], st["rings_reused"]) == (1, 2), st
        assert wait_for(lambda: d.status()["kept_rings"] == 1, timeout=10)
        # `shardstream status` shows the same figures (README points there for them).
        cli = [SHARDSTREAM, "status", "--connect", d.addr]
        shown = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
        assert (shown["kept_rings"], shown["rings_made"], shown["rings_reused"]) == (1, 1, 2), shown
        text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "1 kept" in text and "1 made, 2 reused" in text, text
    finally:
        assert d.stop() == 0


def test_ring_keep_zero_keeps_no_ring(tokens, tmp_path) -> None:
    root, records = tokens
    d = Daemon(tmp_path, args=["--ring-keep", "0"]).start()
    try:
        for seed in (1, 2):
            loader = shardstream.Loader(
                str(root), batch_size=64, seed=seed, fields=["tok"], collate="stack", connect=d.addr
            )
            assert sum(len(b["__key__"]) for b in loader) == len(records)
            del loader
            gc.collect()
            assert wait_for(lambda: d.status()["shm_sessions"] == 0, timeout=10)
            assert d.status()["kept_rings"] == 0
        assert (d.status()["rings_made"], d.status()["rings_reused"]) == (2, 0)
        assert d.status()["ring_bytes"] == 0
    finally:
        assert d.stop() == 0


def test_torch_dataloader_gets_tensors_exactly_once(daemon, tokens) -> None:
    import torch

    import shardstream.torch as sst

    root, records = tokens
    for workers in (0, 2):
        ds = sst.IterableDataset(str(root), batch_size=50, seed=1, fields=["tok"], collate="stack", connect=daemon.addr)
        dl = sst.DataLoader(ds, num_workers=workers)
        keys = []
        for batch in dl:
            t = batch["tok"]
            assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape[1] == RECORD
            ids = t.view(torch.int32)[:, 0].tolist()
            assert ids == [int(k[1:]) for k in batch["__key__"]]
            keys.extend(batch["__key__"])
        assert sorted(keys) == sorted(records), f"num_workers={workers}"


WRITE_TOKENS_IN_PLACE = """
import sys, torch, shardstream.torch as sst
from conftest import mapped_memfds
root, addr = sys.argv[1], sys.argv[2]
ds = sst.IterableDataset(root, batch_size=20, seed=2, fields=["tok"], collate="stack", connect=addr)
n = 0
for batch in sst.DataLoader(ds, num_workers=0):
    t = batch["tok"]
    assert any(lo <= t.data_ptr() < hi for lo, hi in mapped_memfds()), "the tensor is a copy"
    ids = t.view(torch.int32)[:, 0].tolist()
    assert ids == [int(k[1:]) for k in batch["__key__"]], n   # never what an earlier batch wrote
    t.fill_(255)
    n += len(ids)
assert n == 1000, n
print("ok")
"""


def test_a_packed_tensor_can_be_written_in_place(daemon, tokens) -> None:
    """A packed batch's tensors lie in the ring (50 batches through 8 slots): writing into one
    in place must neither kill the trainer (SIGSEGV in a read-only mapping) nor show in the
    batches that reuse its slot."""
    root, _ = tokens
    run_child_ok(WRITE_TOKENS_IN_PLACE, str(root), daemon.addr)


def test_ring_slots_out_of_range_are_refused_at_start(tmp_path) -> None:
    # One credit (or slot) was accepted, and a plain `for b in loader:` then stopped for good after
    # one batch: the loop variable holds the last batch, and its credit, while the next is asked for.
    for flag in ("--ring-slots", "--shm-credits"):
        cmd = [SHARDSTREAM, "serve", "--listen", f"unix://{tmp_path / 'sock'}", "--cache-dir", str(tmp_path / "c")]
        for value in ("0", "1"):
            r = subprocess.run(
                [*cmd, flag, value],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode != 0 and f"{flag} must be from 2 to 1024, not {value}" in r.stderr, r.stderr
