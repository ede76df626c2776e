"""A transform's large results are stacked into memory that is reused (each DataLoader worker's,
or the trainer's without workers), and never while the trainer still holds any tensor, view or
numpy array over it (`shardstream._batch_memory`)."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstream.torch as sst
from conftest import write_token_blocks
from shardstream._batch_memory import MIN_BYTES, BatchMemory

BATCH = 64
# One sample's tensor: half a batch of them (the dataset's last batch is 43 samples) is MIN_BYTES,
# the smallest the workers pool.
ROW_BYTES = 2 * MIN_BYTES // BATCH


def index_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def fill(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A row of bytes that says which sample it came from, and the sample's index."""
    i = index_of(sample["__key__"])
    return {"x": torch.full((ROW_BYTES,), i % 251, dtype=torch.uint8), "i": torch.tensor(i)}


def intact(x: torch.Tensor, i: torch.Tensor) -> bool:
    return bool((x == (i % 251).to(torch.uint8)[:, None]).all())


def loader(root: str, addr: str, workers: int, **kwargs: Any) -> sst.DataLoader:
    ds = sst.IterableDataset(root, batch_size=BATCH, seed=5, connect=addr, transform=fill)
    return sst.DataLoader(ds, num_workers=workers, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batchs_memory_is_reused_once_the_trainer_lets_go(daemon, dataset, workers: int) -> None:
    root, samples = dataset
    dl = loader(str(root), daemon.addr, workers)
    seen: collections.Counter[int] = collections.Counter()
    for batch in dl:
        assert intact(batch["x"], batch["i"]), "a batch arrived with another batch's bytes"
        seen.update(batch["i"].tolist())
    assert sorted(seen) == sorted(index_of(k) for k in samples) and set(seen.values()) == {1}
    counts = dl.batch_memory_counts()
    batches = len(dl.dataset)
    assert counts["reused"] + counts["allocated"] + counts["unpooled"] == batches, counts
    # Each worker allocates at most its slots; with the trainer dropping batches, the rest reuse.
    slots = max(workers, 1) * dl._memory.slots_per_worker
    assert counts["allocated"] <= slots, counts
    assert counts["reused"] >= batches - slots, counts
    assert counts["unpooled"] == 0, counts


@pytest.mark.parametrize("workers", [0, 2])
def test_what_the_trainer_keeps_is_never_overwritten(daemon, dataset, workers: int) -> None:
    """Whole batches, views of a few rows, numpy arrays over them: whatever still references a
    slot's memory keeps the slot, so the slots run out and batches are stacked outside them."""
    root, _ = dataset
    dl = loader(str(root), daemon.addr, workers)
    kept: list[tuple[Any, Any]] = []
    for n, batch in enumerate(dl):
        x, i = batch["x"], batch["i"].clone()
        if n % 3 == 0:
            kept.append((x, i))
        elif n % 3 == 1:
            kept.append((x[2:5], i[2:5]))  # a view: the batch tensor itself is dropped
        else:
            kept.append((x.numpy()[-2:], i[-2:]))
        del batch, x
    for x, i in kept:
        assert intact(torch.as_tensor(x), i), "a kept batch was overwritten by a later one"
    assert sum(len(i) for x, i in kept) > 0
    counts = dl.batch_memory_counts()
    assert counts["reused"] == 0, f"a slot was reused while the trainer held it: {counts}"
    assert counts["unpooled"] > 0, counts


def test_persistent_workers_keep_their_slots_across_epochs(daemon, dataset) -> None:
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2, persistent_workers=True)
    for epoch in range(2):
        dl.dataset.set_epoch(epoch)
        got = []
        for batch in dl:
            assert intact(batch["x"], batch["i"])
            got += batch["i"].tolist()
        assert sorted(got) == sorted(index_of(k) for k in samples)
    counts = dl.batch_memory_counts()
    assert counts["allocated"] <= 2 * dl._memory.slots_per_worker, counts
    assert counts["reused"] + counts["allocated"] == 2 * len(dl.dataset), counts


def test_batches_dropped_by_an_epoch_left_early_give_their_slots_back(daemon, dataset) -> None:
    """Leaving an epoch early with persistent workers: torch drops the batches still in flight
    when the next epoch starts, unseen by the trainer's loop; their slots must come free all the
    same, or every early exit costs each worker its prefetched batches' slots for good."""
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2, persistent_workers=True)
    for epoch in range(12):
        dl.dataset.set_epoch(epoch)
        for batch in dl:
            assert intact(batch["x"], batch["i"])
            break
        del batch
    before = dict(dl.batch_memory_counts())
    dl.dataset.set_epoch(12)
    got = []
    for batch in dl:
        assert intact(batch["x"], batch["i"])
        got += batch["i"].tolist()
    assert sorted(got) == sorted(index_of(k) for k in samples)
    after = dl.batch_memory_counts()
    epoch_counts = {k: after[k] - before[k] for k in after}
    assert epoch_counts["unpooled"] == 0, f"slots lost to the epochs left early: {epoch_counts}"
    assert epoch_counts["reused"] + epoch_counts["allocated"] == len(dl.dataset), epoch_counts


def test_spawned_workers_get_the_flags_and_none_of_the_slots(daemon, dataset) -> None:
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2, multiprocessing_context="spawn")
    got = []
    for batch in dl:
        assert intact(batch["x"], batch["i"])
        got += batch["i"].tolist()
    assert sorted(got) == sorted(index_of(k) for k in samples)
    assert dl.batch_memory_counts()["reused"] > 0, dl.batch_memory_counts()


@pytest.mark.parametrize("options", [{"reuse_batch_memory": False}, {"collate_fn": lambda b: b}])
def test_memory_is_not_reused_when_turned_off_or_the_dataloader_collates(daemon, dataset, options) -> None:
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2, **options)
    n = 0
    for batch in dl:
        assert isinstance(batch, dict) and intact(batch["x"], batch["i"])
        n += len(batch["i"])
    assert n == len(samples)
    assert dl.batch_memory_counts() == {"reused": 0, "allocated": 0, "unpooled": 0}


@pytest.mark.parametrize("context", [multiprocessing, None], ids=["worker", "no-workers"])
def test_a_failed_stack_gives_its_slot_back(context: Any) -> None:
    memory = BatchMemory(context, workers=1, prefetch_factor=1)
    collate = memory.collate_fn(0)
    rows = [torch.zeros(ROW_BYTES, dtype=torch.uint8) for _ in range(BATCH - 1)]
    with pytest.raises(RuntimeError):
        collate([*rows, torch.zeros(ROW_BYTES + 1, dtype=torch.uint8)])
    assert not any(memory._flags.get_obj()), "a stack that failed kept its slot"
    # A stack that succeeds (into the memory the failed one allocated) holds its slot.
    out = collate([*rows, torch.ones(ROW_BYTES, dtype=torch.uint8)])
    assert sum(memory._flags.get_obj()) == 1 and (out.reused, out.allocated) == (1, 0)
    assert bool((out.data[-1] == 1).all()) and not bool(out.data[:-1].any())


def test_without_workers_the_slot_comes_free_when_the_last_view_goes() -> None:
    """In one process the slot's own storage stays in the pool; what the trainer gets is a
    storage of its own over the same memory, and that is what is watched."""
    memory = BatchMemory(None, workers=1, prefetch_factor=0)
    rows = [torch.full((ROW_BYTES,), 7, dtype=torch.uint8) for _ in range(BATCH)]
    batch = memory.receive(memory.collate_fn(0)(rows))
    view = batch[5:6].numpy()
    del batch
    memory.collect()
    assert sum(memory._flags.get_obj()) == 1, "freed while a numpy array still viewed it"
    del view
    memory.collect()
    assert not any(memory._flags.get_obj())
    again = memory.collate_fn(0)(rows)
    assert (again.reused, again.allocated) == (1, 0)


def test_small_tensors_stay_with_default_collate() -> None:
    memory = BatchMemory(multiprocessing, workers=1, prefetch_factor=1)
    row = MIN_BYTES // BATCH - 1
    out = memory.collate_fn(0)([torch.zeros(row, dtype=torch.uint8)] * BATCH)
    assert out.tensors == [] and (out.reused, out.allocated, out.unpooled) == (0, 0, 0)
    assert out.data.shape == (BATCH, row)


def test_batches_of_several_large_tensors_reuse_a_slot_each() -> None:
    """Images and masks, say: each large tensor takes a slot of its own, and once the trainer
    drops the batches every one of them is reused."""
    memory = BatchMemory(None, workers=1, prefetch_factor=0)
    collate = memory.collate_fn(0)
    sample = {
        "image": torch.zeros(ROW_BYTES, dtype=torch.uint8),
        "mask": torch.zeros(ROW_BYTES // 2, dtype=torch.int16),
    }
    previous = None
    for n in range(12):
        batch = memory.receive(collate([{k: v + n for k, v in sample.items()} for _ in range(BATCH)]))
        assert bool((batch["image"] == n).all()) and bool((batch["mask"] == n).all())
        previous = batch  # held while the next one is made, as a training loop's variable is
        del batch
        memory.collect()
    del previous
    counts = memory.counts()
    assert counts["unpooled"] == 0 and counts["reused"] + counts["allocated"] == 24, counts
    assert counts["allocated"] <= 2 * memory.batches_kept, counts


def test_the_slots_hold_no_more_than_their_batches_whatever_the_trainer_keeps() -> None:
    memory = BatchMemory(None, workers=1, prefetch_factor=0)
    collate = memory.collate_fn(0)
    rows = [torch.zeros(ROW_BYTES, dtype=torch.uint8) for _ in range(BATCH)]
    kept = [memory.receive(collate(rows)) for _ in range(10)]
    counts = memory.counts()
    assert (counts["allocated"], counts["unpooled"]) == (memory.batches_kept, 10 - memory.batches_kept), counts
    assert memory._pooled_bytes == memory.batches_kept * BATCH * ROW_BYTES
    assert all(bool((b == 0).all()) for b in kept)


def test_a_pinned_batch_frees_its_slot_once_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's pin-memory thread calls the batch's ``pin_memory()`` in the trainer. Pinning
    needs an accelerator this machine lacks, so a copy stands in for it here: the trainer gets
    the copy, and the slot comes free while the trainer still holds it."""
    from torch.utils.data._utils import pin_memory as pinning

    monkeypatch.setattr(pinning, "pin_memory", lambda data, device=None: data.clone())
    memory = BatchMemory(None, workers=1, prefetch_factor=0)
    pooled = memory.collate_fn(0)([torch.full((ROW_BYTES,), 3, dtype=torch.uint8) for _ in range(BATCH)])
    batch = memory.receive(pooled.pin_memory())
    del pooled
    memory.collect()
    assert not any(memory._flags.get_obj()), "the slot stayed taken after its batch was copied"
    assert bool((batch == 3).all())


def test_pin_memory_keeps_the_reuse_and_the_bytes(daemon, dataset) -> None:
    """With an accelerator the trainer gets pinned copies; without one (this machine) torch warns
    and skips pinning. Either way the batches come through the reused memory, intact."""
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2, pin_memory=True)
    accelerator = torch.cuda.is_available()
    got = []
    with contextlib.nullcontext() if accelerator else pytest.warns(UserWarning, match="pin_memory"):
        for batch in dl:
            assert intact(batch["x"], batch["i"])
            assert batch["x"].is_pinned() == accelerator
            got += batch["i"].tolist()
    assert sorted(got) == sorted(index_of(k) for k in samples)
    assert dl.batch_memory_counts()["reused"] > 0


@pytest.fixture(scope="module")
def blocks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """3,000 token blocks of 4 KiB and a label, by webdataset: a batch of 256 is 1 MiB."""
    root = tmp_path_factory.mktemp("blocks")
    return root, write_token_blocks(root, 3000, 4096, per_shard=400, seed=11, label_mod=7)


def test_stacked_fields_cross_from_workers_in_reused_slots(daemon, blocks) -> None:
    """collate="stack" in workers: each field is copied out of the daemon's ring once, the large
    ones into slots; kept batches stay intact and every block arrives once, byte for byte."""
    root, records = blocks
    ds = sst.IterableDataset(
        str(root), batch_size=256, seed=2, fields=["tok", "lbl"], collate="stack", connect=daemon.addr
    )
    dl = sst.DataLoader(ds, num_workers=2)
    kept, seen = [], []
    for n, batch in enumerate(dl):
        tok, lbl = batch["tok"], batch["lbl"]
        assert tok.shape[1] == 4096 and lbl.shape[1] == 4
        if n % 4 == 0:
            kept.append(batch)
        seen += batch["__key__"]
        for key, row, label in zip(batch["__key__"], tok, lbl.view(torch.int32)[:, 0].tolist(), strict=True):
            assert row.numpy().tobytes() == records[key] and label == int(key[1:]) % 7
        del batch, tok, lbl
    assert sorted(seen) == sorted(records)
    for batch in kept:
        rows = batch["tok"].view(torch.int32)[:, 0].tolist()
        assert rows == [int(k[1:]) for k in batch["__key__"]], "a kept batch was overwritten"
    # The full batches' blocks are 1 MiB each, the slots' least; the last batch (184) stays out.
    counts = dl.batch_memory_counts()
    assert counts["reused"] > 0 and sum(counts.values()) == len(records) // 256, counts


def test_a_lock_left_held_never_hangs_the_trainer() -> None:
    """A worker killed (say by the OOM killer) inside its few microseconds under the flags' lock
    leaves it held for good; torch then reports the dead worker, and the trainer must get that
    far: collecting slots gives up on the lock instead of waiting for it, and retries later."""
    import threading
    import time

    memory = BatchMemory(multiprocessing, workers=1, prefetch_factor=0)
    pooled = memory.collate_fn(0)([torch.zeros(ROW_BYTES, dtype=torch.uint8) for _ in range(BATCH)])
    memory.receive(pooled)
    memory._held = [(slot, _Expired()) for slot, _ in memory._held]  # the trainer has let go
    held, done = threading.Event(), threading.Event()

    def hold() -> None:  # the dead worker: takes the lock and never gives it back
        memory._flags.get_lock().acquire()
        held.set()
        done.wait()
        memory._flags.get_lock().release()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        t0 = time.monotonic()
        memory.collect()
        assert time.monotonic() - t0 < 5, "collect waited for a lock that is never released"
        assert sum(memory._flags.get_obj()) == 1, "freed without the lock"
    finally:
        done.set()
        holder.join()
    memory.collect()
    assert not any(memory._flags.get_obj()), "the slot was not freed once the lock came back"


class _Expired:
    """A StorageWeakRef whose storage is gone."""

    def expired(self) -> bool:
        return True
