"""The worker-side fast path of `shardstream.torch`: a transform runs in each DataLoader worker on
the zero-copy views, and only its result reaches the trainer process."""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
import torch
import torch.utils.data

import shardstream.torch as sst

BAD_KEY = "s0/000500"


def index_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def probe(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Records where it ran and what it was given; returns tensors only."""
    jpg = sample["jpg"]
    return {
        "pid": torch.tensor(os.getpid()),
        "view": torch.tensor(isinstance(jpg, memoryview) and jpg.readonly),
        "index": torch.tensor(index_of(sample["__key__"])),
        "len": torch.tensor(len(jpg)),
        "first": torch.tensor(jpg[0]),
        "label": torch.tensor(int(bytes(sample["cls"]))),
    }


def probe_batch(batch: dict[str, Any]) -> tuple[int, list[int], bool]:
    views = all(isinstance(v, memoryview) and v.readonly for v in batch["jpg"])
    return os.getpid(), [index_of(k) for k in batch["__key__"]], views


def fails_on_one(sample: dict[str, Any]) -> torch.Tensor:
    if sample["__key__"] == BAD_KEY:
        raise ValueError(f"cannot decode {len(sample['jpg'])} bytes")
    return torch.tensor(0)


def loader(root: str, addr: str, workers: int, **kwargs: Any) -> sst.DataLoader:
    ds = sst.IterableDataset(root, batch_size=64, seed=3, connect=addr, **kwargs)
    return sst.DataLoader(ds, num_workers=workers)


def test_transform_runs_in_the_workers_on_views_and_only_its_output_crosses(daemon, dataset) -> None:
    root, samples = dataset
    by_index = {index_of(k): v for k, v in samples.items()}
    seen: collections.Counter[int] = collections.Counter()
    pids: set[int] = set()
    dl = loader(str(root), daemon.addr, 2, transform=probe)
    for batch in dl:
        # default_collate of the transform's dicts: nothing of the raw batch comes along.
        assert set(batch) == {"pid", "view", "index", "len", "first", "label"}
        assert all(isinstance(v, torch.Tensor) for v in batch.values())
        assert bool(batch["view"].all()), "the transform must get read-only memoryviews, not copies"
        pids.update(batch["pid"].tolist())
        for i, n, first, label in zip(*(batch[k].tolist() for k in ("index", "len", "first", "label")), strict=True):
            src = by_index[i]
            assert (n, first, label) == (len(src["jpg"]), src["jpg"][0], int(src["cls"]))
            seen[i] += 1
    assert os.getpid() not in pids, "the transform ran in the trainer process"
    assert len(pids) == 2, f"expected both workers to transform batches, saw pids {pids}"
    assert sorted(seen) == sorted(by_index) and set(seen.values()) == {1}, "not exactly once"
    assert dl.state_dict()["batches_consumed"] == len(dl.dataset)


def test_batch_transform_gets_the_whole_batch_of_views_in_each_worker(daemon, dataset) -> None:
    root, samples = dataset
    got: list[int] = []
    pids = set()
    for pid, indices, views in loader(str(root), daemon.addr, 2, batch_transform=probe_batch):
        assert views, "batch_transform must get read-only memoryviews"
        pids.add(pid)
        got += indices
    assert os.getpid() not in pids and len(pids) == 2
    assert sorted(got) == sorted(index_of(k) for k in samples)


def test_transform_without_workers_runs_in_place(daemon, dataset) -> None:
    root, samples = dataset
    n = 0
    for batch in loader(str(root), daemon.addr, 0, transform=probe):
        assert set(batch["pid"].tolist()) == {os.getpid()}
        assert bool(batch["view"].all())
        n += len(batch["index"])
    assert n == len(samples)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_the_transform_surfaces_as_itself_with_the_key(daemon, dataset, workers: int) -> None:
    root, _ = dataset
    with pytest.raises(ValueError, match="cannot decode") as info:
        for _ in loader(str(root), daemon.addr, workers, transform=fails_on_one):
            pass
    # In a worker, torch re-raises the type with the worker's traceback (notes included) as text.
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert BAD_KEY in text, text


def test_transform_arguments_are_checked(daemon, dataset) -> None:
    root, _ = dataset
    with pytest.raises(ValueError, match="not both"):
        sst.IterableDataset(str(root), connect=daemon.addr, transform=probe, batch_transform=probe_batch)
    with pytest.raises(ValueError, match="needs transform"):
        sst.IterableDataset(str(root), connect=daemon.addr, collate_fn=list)
    with pytest.raises(TypeError, match="callable"):
        sst.IterableDataset(str(root), connect=daemon.addr, transform="decode")  # type: ignore[arg-type]


def test_dataloader_without_workers_keeps_the_views(daemon, dataset) -> None:
    # torch's default_convert (the DataLoader's collate with batch_size=None) treats a memoryview as
    # a sequence and turned each field into a list of ints: the documented zero-copy views of
    # num_workers=0 must arrive as they are.
    root, samples = dataset
    n = 0
    for batch in loader(str(root), daemon.addr, 0):
        assert all(isinstance(v, memoryview) for v in batch["jpg"]), type(batch["jpg"][0])
        assert [bytes(v) for v in batch["jpg"]] == [samples[k]["jpg"] for k in batch["__key__"]]
        n += len(batch["__key__"])
    assert n == len(samples)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batching", [{}, {"batch_size": 4}])
def test_a_plain_dataloader_that_would_batch_the_batches_again_is_refused(
    daemon, dataset, workers: int, batching: dict[str, int]
) -> None:
    # torch's DataLoader batches by default (batch_size=1): given the dataset's batches, it wrapped
    # each one in a batch of one (a leading dimension of 1 on every tensor, keys as lists of
    # lists), or merged several (batch_size=4), without a word. The dataset sees it from the
    # DataLoader's fetcher and says what to do.
    root, _ = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr, fields=["cls"])
    with pytest.raises(ValueError, match=r"batch_size=None.*shardstream\.torch\.DataLoader"):
        next(iter(torch.utils.data.DataLoader(ds, num_workers=workers, **batching)))
    # batch_size=None is the way, and works.
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)))
    assert len(batch["__key__"]) == 64
