"""DataLoader workers stack a transform's large results into memory they reuse, and never while
the trainer still holds any tensor, view or numpy array over it (`shardstream._batch_memory`)."""

from __future__ import annotations

import collections
import multiprocessing
from typing import Any

import pytest
import torch

import shardstream.torch as sst
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


def test_a_worker_reuses_a_batchs_memory_once_the_trainer_lets_go(daemon, dataset) -> None:
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2)
    seen: collections.Counter[int] = collections.Counter()
    for batch in dl:
        assert intact(batch["x"], batch["i"]), "a batch arrived with another batch's bytes"
        seen.update(batch["i"].tolist())
    assert sorted(seen) == sorted(index_of(k) for k in samples) and set(seen.values()) == {1}
    counts = dl.batch_memory_counts()
    batches = len(dl.dataset)
    assert counts["reused"] + counts["allocated"] + counts["unpooled"] == batches, counts
    # Each worker allocates at most its slots; with the trainer dropping batches, the rest reuse.
    assert counts["allocated"] <= 2 * dl._memory.slots_per_worker, counts
    assert counts["reused"] >= batches - 2 * dl._memory.slots_per_worker, counts
    assert counts["unpooled"] == 0, counts


def test_what_the_trainer_keeps_is_never_overwritten(daemon, dataset) -> None:
    """Whole batches, views of a few rows, numpy arrays over them: whatever still references a
    slot's memory keeps the slot, so the workers run out of slots and allocate outside them."""
    root, samples = dataset
    dl = loader(str(root), daemon.addr, 2)
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


def test_a_failed_stack_gives_its_slot_back() -> None:
    memory = BatchMemory(multiprocessing, workers=1, prefetch_factor=1)
    collate = memory.collate_fn(0)
    rows = [torch.zeros(ROW_BYTES, dtype=torch.uint8) for _ in range(BATCH - 1)]
    with pytest.raises(RuntimeError):
        collate([*rows, torch.zeros(ROW_BYTES + 1, dtype=torch.uint8)])
    assert not any(memory._flags.get_obj()), "a stack that failed kept its slot"
    # A stack that succeeds holds its slot until the trainer lets go (which the DataLoader tests
    # watch: in one process the slot's own storage keeps the memory alive).
    out = collate([*rows, torch.ones(ROW_BYTES, dtype=torch.uint8)])
    # (into the segment the failed stack allocated)
    assert sum(memory._flags.get_obj()) == 1 and (out.reused, out.allocated) == (1, 0)
    assert bool((out.data[-1] == 1).all()) and not bool(out.data[:-1].any())


def test_small_tensors_stay_with_default_collate() -> None:
    memory = BatchMemory(multiprocessing, workers=1, prefetch_factor=1)
    row = MIN_BYTES // BATCH - 1
    out = memory.collate_fn(0)([torch.zeros(row, dtype=torch.uint8)] * BATCH)
    assert out.tensors == [] and (out.reused, out.allocated, out.unpooled) == (0, 0, 0)
    assert out.data.shape == (BATCH, row)
