"""The worker-side fast path of `shardstream.torch`: a transform runs in each DataLoader worker on
the zero-copy views, and only its result reaches the trainer process."""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import shardstream
import shardstream.torch as sst
from conftest import Daemon, mapped_memfds, write_token_blocks

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


def test_dataloader_without_workers_gives_bytes_when_it_pins(daemon, dataset) -> None:
    """torch's pin_memory (what DataLoader(pin_memory=True) applies to each batch where an
    accelerator is) takes a memoryview for a sequence and rebuilt every field of a zero-copy batch
    as a list of Python ints, one per byte, on every GPU machine. A pinning loader gets bytes."""
    from torch.utils.data._utils.pin_memory import pin_memory

    root, samples = dataset
    n = 0
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr)
    for batch in sst.DataLoader(ds, num_workers=0, pin_memory=True):
        # What the pin step makes of it; here, with no accelerator, torch skips the step itself.
        pinned = pin_memory(batch)
        assert all(type(v) is bytes for v in pinned["jpg"]), type(pinned["jpg"][0])
        assert list(pinned["jpg"]) == [samples[k]["jpg"] for k in batch["__key__"]]
        n += len(batch["__key__"])
    assert n == len(samples)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_iteration_of_a_dataloader_ends_the_first(daemon, dataset, workers: int) -> None:
    """Two live iterations of one shardstream.torch.DataLoader both counted into its one position:
    after zip(dl, dl), state_dict() said 61 batches of a 31-batch epoch (a checkpoint that could
    not be loaded); interleaved, a count neither iteration stood at. As with a Loader, a newer
    iteration ends the older one, whose next batch raises."""
    root, _ = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr)
    # Persistent workers serve every iteration from one torch iterator: the older iteration must
    # not take the newer one's batch as it ends.
    dl = sst.DataLoader(ds, num_workers=workers, persistent_workers=workers > 0)
    with pytest.raises(RuntimeError, match="a newer iteration"):
        for _ in zip(dl, dl, strict=False):
            pass
    first = iter(dl)
    next(first)
    next(first)
    second = iter(dl)
    taken = [next(second)["__key__"] for _ in range(3)]
    with pytest.raises(RuntimeError, match="a newer iteration"):
        next(first)
    assert dl.state_dict()["batches_consumed"] == 3
    taken.extend(b["__key__"] for b in second)
    assert dl.state_dict()["batches_consumed"] == len(taken) == len(ds)


@pytest.mark.parametrize("name", ["drop_last", "shuffle"])
def test_batching_options_given_to_the_dataloader_name_the_dataset(daemon, dataset, name: str) -> None:
    # torch's refusal said "batch_size=None option disables auto-batching and is mutually exclusive
    # with drop_last", though the caller never gave batch_size.
    root, _ = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, connect=daemon.addr, fields=["cls"])
    with pytest.raises(ValueError, match=rf"{name} is the dataset's.*IterableDataset\(\.\.\., {name}=True\)"):
        sst.DataLoader(ds, **{name: True})
    sst.DataLoader(ds, **{name: False})  # the default, said: accepted


@pytest.mark.parametrize("how", ["Loader", "DataLoader-0", "DataLoader-2", "plain-0"])
def test_an_epoch_repeated_without_set_epoch_is_warned_once(daemon, dataset, how: str) -> None:
    # webdataset reshuffles by itself each epoch; a loop ported from it without set_epoch trained
    # every epoch in the same order, without a word.
    root, _ = dataset
    kwargs: dict[str, Any] = dict(batch_size=256, seed=3, connect=daemon.addr, fields=["cls"])
    if how == "Loader":
        it: Any = shardstream.Loader(str(root), **kwargs)
        ds: Any = it
    else:
        ds = sst.IterableDataset(str(root), **kwargs)
        workers = int(how[-1])
        if how.startswith("plain"):
            it = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        else:
            it = sst.DataLoader(ds, num_workers=workers)

    def epoch() -> list[str]:
        return [k for b in it for k in b["__key__"]]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in it:  # a break: this iteration did not finish the epoch, the next begins it
            break
        first = epoch()
    with pytest.warns(UserWarning, match=r"epoch 0 again without set_epoch\(\), in the same order"):
        assert epoch() == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert epoch() == first  # once
        ds.set_epoch(1)
        assert epoch() != first
        ds.set_epoch(1)  # the same epoch again, said: no warning
        epoch()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_taken_to_its_len_without_set_epoch_is_warned_too(daemon, dataset, workers: int) -> None:
    """Lightning (and any loop bounded by len(dl)) takes an epoch's batches without asking for one
    more, so the iteration never ended and the next epoch, without set_epoch(), repeated the order
    with no warning: Lightning calls set_epoch on a DataLoader's sampler, not on its dataset."""
    root, _ = dataset
    ds = sst.IterableDataset(str(root), batch_size=256, seed=3, connect=daemon.addr, fields=["cls"])
    dl = sst.DataLoader(ds, num_workers=workers)

    def bounded() -> list[str]:
        return [k for _, b in zip(range(len(dl)), dl, strict=False) for k in b["__key__"]]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = bounded()
    with pytest.warns(UserWarning, match=r"epoch 0 again without set_epoch\(\), in the same order"):
        assert bounded() == first


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_on_the_dataloader_s_sampler_reaches_the_dataset(daemon, dataset, workers: int) -> None:
    """Lightning's trainer calls set_epoch(epoch) on a DataLoader's sampler each epoch (as for a
    DistributedSampler); a shardstream DataLoader's was torch's, without set_epoch, and every
    epoch of a LightningModule repeated the first one's order."""
    root, _ = dataset
    ds = sst.IterableDataset(str(root), batch_size=256, seed=3, connect=daemon.addr, fields=["cls"])
    dl = sst.DataLoader(ds, num_workers=workers)
    orders = []
    for epoch in range(2):
        # What lightning.fabric.utilities.data._set_sampler_epoch does.
        for obj in {id(s): s for s in (dl.sampler, getattr(dl.batch_sampler, "sampler", None)) if s}.values():
            if callable(getattr(obj, "set_epoch", None)):
                obj.set_epoch(epoch)
        orders.append([k for b in dl for k in b["__key__"]])
        assert ds.epoch == epoch
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_a_batch_moves_to_a_device_as_frameworks_move_one(daemon, dataset, tmp_path) -> None:
    """Lightning's transfer_batch_to_device (and accelerate's send_to_device) call `to` on what has
    one and otherwise rebuild collections item by item: a batch of zero-copy views failed with
    "memoryview: a bytes-like object is required, not 'list'". A batch's `to` moves its tensors and
    keeps its views (and their lease)."""
    root, samples = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr)
    batch = next(iter(sst.DataLoader(ds, num_workers=0)))
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, shardstream.Batch) and moved["__key__"] == batch["__key__"]
    assert all(isinstance(v, memoryview) for v in moved["jpg"])
    assert [bytes(v) for v in moved["jpg"]] == [samples[k]["jpg"] for k in moved["__key__"]]
    # Stacked fields are tensors: moved as Tensor.to moves them.
    records = write_token_blocks(tmp_path, 64, 256, per_shard=32, seed=5, label_mod=3)
    stacked = sst.IterableDataset(str(tmp_path), batch_size=8, connect=daemon.addr, fields=["tok"], collate="stack")
    b = next(iter(sst.DataLoader(stacked, num_workers=0)))
    wide = b.to(torch.int32)
    assert wide["tok"].dtype == torch.int32 and wide["tok"].shape == (8, 256)
    assert [bytes(b["tok"][i].numpy()) for i in range(8)] == [records[k] for k in b["__key__"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_dataloader_gets_bytes_not_lists_of_ints(daemon, dataset, workers: int) -> None:
    # README: a plain torch DataLoader(ds, batch_size=None) works as shardstream.torch's does. In
    # the trainer's process (num_workers=0) its default_convert took each memoryview for a
    # sequence: every field came as a list of Python ints (a JPEG that PIL could not open, and
    # ~200x slower). It gets bytes there now, as its workers always gave.
    root, samples = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr, fields=["jpg", "cls"])
    n = 0
    for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers):
        assert all(type(v) is bytes for v in batch["jpg"]), type(batch["jpg"][0])
        assert list(batch["jpg"]) == [samples[k]["jpg"] for k in batch["__key__"]]
        assert list(batch["cls"]) == [samples[k]["cls"] for k in batch["__key__"]]
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


def keep_tokens(batch: dict[str, Any]) -> tuple[list[str], torch.Tensor]:
    """A batch_transform that keeps the stacked token tensor as it was given (over the ring)."""
    return batch["__key__"], batch["tok"]


def test_what_a_transform_keeps_of_a_stacked_batch_is_never_overwritten(daemon, tmp_path) -> None:
    """With collate="stack" over shared memory a TAR batch's fields are tensors over a slot of the
    stream's ring (8 slots). The transform path released the slot as soon as the transform
    returned, so a result that kept such a tensor read other batches' records once the daemon
    reused the slot: a transform's result is the trainer's and must never change."""
    records = write_token_blocks(tmp_path, 400, 256, per_shard=100, seed=5, label_mod=3)
    ds = sst.IterableDataset(
        str(tmp_path),
        batch_size=8,
        seed=4,
        connect=daemon.addr,
        fields=["tok"],
        collate="stack",
        batch_transform=keep_tokens,
    )
    it = iter(sst.DataLoader(ds))
    keys, tok = next(it)
    assert tok.shape == (8, 256)
    # Zero copy: the tensor lies in the ring (a memfd this process maps).
    assert any(lo <= tok.data_ptr() < hi for lo, hi in mapped_memfds()), "the tensor is a copy"

    def check() -> None:
        for key, row in zip(keys, tok, strict=True):
            assert row.numpy().tobytes() == records[key], f"the kept tensor's record of {key} changed"

    check()
    assert sum(1 for _ in it) == len(ds) - 1 == 49
    check()


def keep_views(batch: dict[str, Any]) -> list[tuple[str, memoryview]]:
    """A batch_transform that keeps the batch's jpg memoryviews, into the mapped shards."""
    assert all(type(v.obj).__name__ == "Region" for v in batch["jpg"])
    return list(zip(batch["__key__"], batch["jpg"], strict=True))


def test_views_a_transform_keeps_of_shards_stay_readable_after_their_eviction(dataset, tmp_path) -> None:
    """A TAR batch over shared memory hands out memoryviews into the node cache's copies of its
    shards (mapped), and the transform path returns its lease as soon as the transform returns,
    so the daemon may evict those shards: the documented promise is that the views stay readable
    (an evicted copy is unlinked, never truncated or rewritten). A cache of half the dataset
    evicts during the epoch; the first batch's views, kept to the end, read what was written."""
    root, samples = dataset
    total = sum(p.stat().st_size for p in root.glob("*.tar"))
    d = Daemon(tmp_path, args=["--cache-size", str(total // 2)]).start()
    try:
        ds = sst.IterableDataset(
            str(root),
            batch_size=16,
            seed=8,
            connect=d.addr,
            cache="copy",
            shuffle_window=2,
            batch_transform=keep_views,
        )
        # torch's conversion would turn each view into a list of ints: keep the items as they are.
        it = iter(sst.DataLoader(ds, collate_fn=lambda item: item))
        first = next(it)
        assert len(first) == 16 and all(bytes(v) == samples[k]["jpg"] for k, v in first)
        assert sum(len(b) for b in it) == len(samples) - 16
        assert d.status()["cache"]["evictions"] > 0
        # Mappings of evicted (unlinked) cache files: some kept view lies in one.
        gone = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("(deleted)")]
        at = [np.frombuffer(v, np.uint8).ctypes.data for _, v in first]
        assert any(int(lo, 16) <= a < int(hi, 16) for a in at for lo, hi in gone), "no kept view's shard was evicted"
        for key, view in first:
            assert bytes(view) == samples[key]["jpg"], f"the kept view of {key} changed after eviction"
    finally:
        assert d.stop() == 0


class Keys(list):
    """A list of its own kind, to see it kept."""


def keep_jpg_views(batch: dict[str, Any]) -> tuple[list[str], list[memoryview], np.ndarray, dict]:
    """A batch_transform that returns the batch's own views, as they are, a numpy array, a
    defaultdict and a list subclass."""
    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    counts["n"].append(len(batch["jpg"]))
    return Keys(batch["__key__"]), batch["jpg"], np.arange(len(batch["jpg"])), counts


def test_a_batch_transform_s_result_is_yielded_as_it_is(daemon, dataset) -> None:
    """The README says a batch_transform's result is yielded as is; it went through torch's
    default_convert, which took each memoryview for a sequence and made it a list of ints (a
    Python int per byte of every image) and made tuples lists. Memoryviews and tuples now stay as
    they were; numpy arrays become tensors as a plain DataLoader(batch_size=None) makes them."""
    root, samples = dataset
    got = 0
    for result in loader(str(root), daemon.addr, 0, batch_transform=keep_jpg_views):
        assert isinstance(result, tuple), type(result)
        keys, views, numbers, counts = result
        assert isinstance(keys, Keys), type(keys)
        assert isinstance(counts, collections.defaultdict) and counts["missing"] == [], type(counts)
        assert all(isinstance(v, memoryview) for v in views), type(views[0])
        assert [bytes(v) for v in views] == [samples[k]["jpg"] for k in keys]
        assert isinstance(numbers, torch.Tensor) and numbers.tolist() == list(range(len(keys)))
        got += len(keys)
    assert got == len(samples)


def big_tensor(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A per-sample transform whose batches' tensors go into reused batch memory (over 1 MiB)."""
    return torch.zeros(300, 300), len(sample["jpg"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_dataloader_after_a_shardstream_one_yields_batches(daemon, dataset, workers: int) -> None:
    """The README lets a plain torch DataLoader(ds, batch_size=None) iterate the dataset. After a
    shardstream.torch.DataLoader had, the dataset kept that loader's batch memory, stacked the
    plain one's batches into it and yielded its internal handles (Pooled) in place of batches."""
    root, samples = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr, transform=big_tensor)
    for _ in sst.DataLoader(ds, num_workers=2):
        pass
    rows = 0
    for images, lengths in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers):
        assert isinstance(images, torch.Tensor) and images.shape[1:] == (300, 300), type(images)
        rows += len(lengths)
    assert rows == len(samples)
