"""Resume mid-epoch after the consumer is killed: the same sequence as an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shardstream

CONSUMER = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch.utils.data
    import shardstream, shardstream.torch as sst

    root, addr, out, mode, stop_after, state_path = sys.argv[1:7]
    stop_after = int(stop_after)
    if mode == "loader":
        loader = shardstream.Loader(root, batch_size=24, seed=9, rank=1, world_size=3, connect=addr)
        if os.path.exists(state_path):
            loader.load_state_dict(json.load(open(state_path)))
        else:
            loader.set_epoch(2)
        it, state_of = loader, loader.state_dict
    else:
        ds = sst.IterableDataset(root, batch_size=24, seed=9, rank=1, world_size=3, connect=addr)
        ds.set_epoch(2)
        dl = sst.DataLoader(ds, num_workers=2)
        if os.path.exists(state_path):
            dl.load_state_dict(json.load(open(state_path)))
        it, state_of = dl, dl.state_dict
    with open(out, "a") as f:
        for n, batch in enumerate(it, 1):
            f.write(json.dumps(batch["__key__"]) + "\\n")
            f.flush()
            if n == stop_after:
                with open(state_path + ".tmp", "w") as s:
                    json.dump(state_of(), s)
                os.replace(state_path + ".tmp", state_path)
                os.kill(os.getpid(), signal.SIGKILL)
    """
)


def run(root: Path, addr: str, out: Path, mode: str, stop_after: int, state: Path) -> int:
    """The consumer in a session of its own, whose process group is killed once it has ended: a
    trainer SIGKILLed leaves its DataLoader workers running for good (torch's: each joins a
    result queue nobody reads), and CI machines collected two per run."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, str(root), addr, str(out), mode, str(stop_after), str(state)],
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["loader", "dataloader"])
def test_resume_after_kill(daemon, dataset, tmp_path: Path, mode: str) -> None:
    root, _ = dataset
    full = tmp_path / "full.jsonl"
    assert run(root, daemon.addr, full, mode, -1, tmp_path / "unused.json") == 0
    expected = [json.loads(line) for line in full.read_text().splitlines()]
    assert len(expected) > 8

    resumed, state = tmp_path / "resumed.jsonl", tmp_path / "state.json"
    assert run(root, daemon.addr, resumed, mode, 5, state) == -9, "first run must be SIGKILLed"
    assert json.loads(state.read_text())["batches_consumed"] == 5
    assert run(root, daemon.addr, resumed, mode, -1, state) == 0
    got = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert got == expected, "resumed sequence differs from the uninterrupted one"


def test_state_dict_follows_a_copy_but_not_a_content_change(daemon, tmp_path: Path) -> None:
    # Issue #13 defect 8: without a manifest the fingerprint was built from mtimes, so a plain
    # `cp -r` of the dataset to another node refused the state saved on the first.
    import os
    import shutil
    import tarfile

    import shardstream
    from conftest import write_dataset

    src = tmp_path / "orig"
    write_dataset(src, n=300, per_shard=50, seed=3)
    kw = dict(batch_size=16, seed=1, connect=daemon.addr)
    loader = shardstream.Loader(str(src), **kw)
    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    rest = [k for batch in it for k in batch["__key__"]]
    assert rest

    copy = tmp_path / "copy"
    shutil.copytree(src, copy, copy_function=shutil.copyfile)  # as `cp -r`: new mtimes
    for shard in copy.glob("*.tar"):
        os.utime(shard, ns=(1_000_000_000, 1_000_000_000))
    resumed = shardstream.Loader(str(copy), **kw)
    resumed.load_state_dict(state)
    assert [k for batch in resumed for k in batch["__key__"]] == rest

    # Same names, sizes and sample boundaries, one payload byte different: refused.
    changed = tmp_path / "changed"
    shutil.copytree(src, changed, copy_function=shutil.copyfile)
    shard = sorted(changed.glob("*.tar"))[0]
    with tarfile.open(shard) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".jpg"))
    data = bytearray(shard.read_bytes())
    data[member.offset_data] ^= 0xFF
    shard.write_bytes(bytes(data))
    other = shardstream.Loader(str(changed), **kw)
    with pytest.raises(ValueError, match=f"saved for {src} .* reads {changed} .* a copy of it whose shards differ"):
        other.load_state_dict(state)


@pytest.mark.parametrize("mode", ["loader", "dataloader"])
def test_resume_after_last_batch_does_not_replay(daemon, dataset, mode: str) -> None:
    """A state saved after the epoch's last batch resumes at the end of that epoch: iterating it
    again yields nothing (the epoch is done), and the next epoch is whole."""
    import shardstream
    import shardstream.torch as sst

    root, samples = dataset
    kw = dict(batch_size=64, seed=3, rank=0, world_size=1, connect=daemon.addr)

    def make():
        if mode == "loader":
            loader = shardstream.Loader(str(root), **kw)
            return loader, loader
        ds = sst.IterableDataset(str(root), **kw)
        return ds, sst.DataLoader(ds, num_workers=2)

    epochs, it = make()
    epochs.set_epoch(1)
    first = [k for b in it for k in b["__key__"]]
    assert sorted(first) == sorted(samples)
    state = it.state_dict()
    assert state["epoch"] == 1 and state["batches_consumed"] == len(it)

    epochs, it = make()
    it.load_state_dict(state)
    epochs.set_epoch(state["epoch"])  # what a training loop does before iterating
    replay = [k for b in it for k in b["__key__"]]
    assert replay == [], f"a finished epoch was replayed ({len(replay)} samples)"
    assert it.state_dict()["batches_consumed"] == len(it)
    epochs.set_epoch(2)
    nxt = [k for b in it for k in b["__key__"]]
    assert sorted(nxt) == sorted(samples) and nxt != first


def test_a_state_that_is_not_a_loaders_is_a_value_error_naming_what_is_wrong(daemon, dataset) -> None:
    # A checkpoint's state from another loader, a truncated dict, or a value of the wrong type
    # must be refused by name before any batch, never a KeyError or a resume at a wrong place.
    import shardstream

    root, _ = dataset
    loader = shardstream.Loader(str(root), batch_size=64, connect=daemon.addr)
    good = loader.state_dict()
    cases = [
        ({"version": good["version"]}, "missing.*batch_size"),
        ({k: v for k, v in good.items() if k != "fingerprint"}, "missing.*fingerprint"),
        ({**good, "batches_consumed": -3}, "batches_consumed"),
        ({**good, "epoch": "one"}, "epoch"),
        ({**good, "epoch": 1 << 64}, "epoch"),
        # No state_dict() says more than the epoch's batches: such a state skipped the whole
        # epoch without a word.
        ({**good, "batches_consumed": len(loader) + 1}, f"batches_consumed.*{len(loader)}"),
        ([1, 2], "a dict"),
    ]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            loader.load_state_dict(state)  # type: ignore[arg-type]
    loader.load_state_dict(good)
    assert sum(len(b["__key__"]) for b in loader) == len(dataset[1])


def test_a_state_loads_where_the_order_is_the_same_and_names_the_dataset_it_is_for(daemon, dataset, tmp_path) -> None:
    """shuffle_window=0 is the daemon's default window: a state saved with it was refused by a
    loader given that window by number ("the order would differ"; it does not). A state of
    another dataset said that dataset's shards had changed."""
    import shardstream
    from conftest import write_dataset

    root, _ = dataset
    default = shardstream._native.DEFAULT_SHUFFLE_WINDOW
    kw = dict(batch_size=64, seed=2, connect=daemon.addr)
    first = shardstream.Loader(str(root), shuffle_window=0, **kw)
    it = iter(first)
    next(it)
    state = first.state_dict()
    rest = [k for b in it for k in b["__key__"]]
    resumed = shardstream.Loader(str(root), shuffle_window=default, **kw)
    resumed.load_state_dict(state)
    assert [k for b in resumed for k in b["__key__"]] == rest
    shardstream.Loader(str(root), shuffle_window=0, **kw).load_state_dict(resumed.state_dict())
    with pytest.raises(ValueError, match="shuffle_window=0 but this loader has 4"):
        shardstream.Loader(str(root), shuffle_window=4, **kw).load_state_dict(state)

    other = tmp_path / "other"
    write_dataset(other, n=50, per_shard=25, seed=9)
    with pytest.raises(ValueError, match=f"saved for {root}.* but this loader reads {other}.*another dataset"):
        shardstream.Loader(str(other), **kw).load_state_dict(state)


def test_numpy_integers_are_integers_and_numpy_floats_are_not(daemon, dataset) -> None:
    """A seed or batch size from numpy (a config computed with numpy, a checkpoint restored with
    numpy scalars) was refused as "must be an integer ..., not np.int64(5)", while set_epoch took
    the same value. Any integer type (``operator.index``) is an integer; a float or a bool is
    not."""
    import numpy as np

    import shardstream

    root, samples = dataset
    kw = dict(batch_size=64, seed=5, rank=0, world_size=1, shuffle_window=2, connect=daemon.addr)
    want = [k for b in shardstream.Loader(str(root), **kw) for k in b["__key__"]]
    loader = shardstream.Loader(
        str(root),
        batch_size=np.int64(64),
        seed=np.uint64(5),
        rank=np.int32(0),
        world_size=np.int64(1),
        shuffle_window=np.uint8(2),
        connect=daemon.addr,
    )
    assert [type(v) for v in (loader.batch_size, loader.seed, loader.rank, loader.world_size)] == [int] * 4
    assert [k for b in loader for k in b["__key__"]] == want
    state = loader.state_dict()
    loader.load_state_dict(dict(state, epoch=np.int64(0), batches_consumed=np.int64(1)))
    assert [k for b in loader for k in b["__key__"]] == want[64:]
    for name, bad in (("seed", np.float64(5.0)), ("batch_size", np.bool_(True)), ("rank", True)):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            shardstream.Loader(str(root), **dict(kw, **{name: bad}))
    with pytest.raises(ValueError, match="batches_consumed must be an integer"):
        loader.load_state_dict(dict(state, batches_consumed=np.float64(1)))


def test_a_state_whose_integers_became_tensors_loads(daemon, dataset) -> None:
    """Checkpoint helpers (torch.distributed.checkpoint, an all-reduce of the state) hand integers
    back as 0-d tensors: such a state was refused as "saved with shuffle_window=tensor(0) but this
    loader has 0; the order would differ", which it would not."""
    import torch

    root, _ = dataset
    kw = dict(batch_size=64, seed=5, shuffle_window=0, connect=daemon.addr)
    want = [k for b in shardstream.Loader(str(root), **kw) for k in b["__key__"]]
    state = shardstream.Loader(str(root), **kw).state_dict()
    as_tensors = {k: torch.tensor(v) if isinstance(v, (int, bool)) else v for k, v in state.items()}
    as_tensors["batches_consumed"] = torch.tensor(2)
    loader = shardstream.Loader(str(root), **kw)
    loader.load_state_dict(as_tensors)
    assert [k for b in loader for k in b["__key__"]] == want[128:]
    # What would change the order is still refused, tensor or not.
    with pytest.raises(ValueError, match="seed=6"):
        loader.load_state_dict(dict(as_tensors, seed=torch.tensor(6)))
    with pytest.raises(ValueError, match="batches_consumed must be an integer"):
        loader.load_state_dict(dict(as_tensors, batches_consumed=torch.tensor(1.5)))


def test_an_epoch_out_of_range_or_not_an_integer_is_refused_when_set(daemon, dataset) -> None:
    # set_epoch(-1) was taken, its iteration then failed with an OverflowError, and the loader's
    # own state_dict() could not be loaded back; 1.7 became epoch 1 without a word.
    import shardstream
    import shardstream.torch

    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=64, connect=daemon.addr)
    ds = shardstream.torch.IterableDataset(str(root), batch_size=64, connect=daemon.addr)
    for target in (loader, ds):
        for bad in (-1, 1 << 64, 1.7, "2"):
            with pytest.raises(ValueError, match="epoch must be an integer"):
                target.set_epoch(bad)  # type: ignore[arg-type]
        target.set_epoch((1 << 64) - 1)
        assert target.epoch == (1 << 64) - 1
    loader.load_state_dict(loader.state_dict())
    assert sum(len(b["__key__"]) for b in loader) == len(samples)


def reference_keys(root: Path, kw: dict, epoch: int, start: int = 0) -> list[str]:
    """The keys a plain Loader with `kw` gives for `epoch` from batch `start` on: what any resumed
    loader must reproduce."""
    import shardstream

    loader = shardstream.Loader(str(root), **kw)
    loader.load_state_dict(dict(loader.state_dict(), epoch=epoch, batches_consumed=start))
    return [k for b in loader for k in b["__key__"]]


@pytest.mark.parametrize("mode", ["sst", "plain", "spawn"])
def test_persistent_workers_follow_set_epoch_and_a_resume(daemon, dataset, mode: str) -> None:
    """Persistent workers keep the dataset object they were started with. They served every
    epoch in the order of the epoch they started with (set_epoch in the trainer never reached
    them), and after a resume every later epoch from the resumed batch on: epochs of the same
    order, missing their first batches. Each epoch must be the one a fresh loader gives."""
    import torch.utils.data

    import shardstream.torch as sst

    root, samples = dataset
    kw = dict(batch_size=64, seed=3, rank=0, world_size=1, connect=daemon.addr)

    def reference(epoch: int, start: int = 0) -> list[str]:
        return reference_keys(root, kw, epoch, start)

    ds = sst.IterableDataset(str(root), **kw)
    plain = mode == "plain"
    if plain:
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    else:
        context = "spawn" if mode == "spawn" else None
        dl = sst.DataLoader(ds, num_workers=2, persistent_workers=True, multiprocessing_context=context)
        dl.load_state_dict(dict(dl.state_dict(), epoch=0, batches_consumed=3))
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = [k for b in dl for k in b["__key__"]]
        want = reference(epoch, 3 if (epoch == 0 and not plain) else 0)
        assert got == want, f"epoch {epoch}: {len(got)} samples, {len(want)} wanted"
    assert reference(1) != reference(2) and len(reference(2)) == len(samples)
    # A copy made outside a worker's start has the values in memory of its own.
    import copy

    fresh = sst.IterableDataset(str(root), **kw)
    fresh.set_epoch(2)
    twin = copy.deepcopy(fresh)
    twin.set_epoch(7)
    assert (twin.epoch, fresh.epoch) == (7, 2)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_iterated_again_after_a_resume_and_a_break_starts_at_its_first_batch(
    daemon, dataset, workers: int, persistent: bool
) -> None:
    """A resumed epoch left with ``break`` and iterated again (``set_epoch`` of the same epoch)
    started again at the resumed batch: the start was cleared only when an iteration ran to its
    end, so the second pass lacked the epoch's first batches and gave the ones before the break
    twice. It must be the whole epoch, as from a ``Loader`` and a plain torch DataLoader."""
    import shardstream.torch as sst

    root, _ = dataset
    kw = dict(batch_size=16, seed=5, rank=0, world_size=2, connect=daemon.addr)
    ds = sst.IterableDataset(str(root), **kw)
    dl = sst.DataLoader(ds, num_workers=workers, persistent_workers=persistent and workers > 0)
    dl.load_state_dict(dict(dl.state_dict(), epoch=1, batches_consumed=5))
    for n, _batch in enumerate(dl, 1):
        if n == 2:
            break
    assert dl.state_dict()["batches_consumed"] == 7
    ds.set_epoch(1)
    got = [k for b in dl for k in b["__key__"]]
    assert got == reference_keys(root, kw, 1, 0), f"{len(got)} keys, {len(reference_keys(root, kw, 1, 0))} wanted"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_copy_of_a_dataset_or_dataloader_after_an_epoch_iterates_the_same(daemon, dataset, workers: int) -> None:
    """Frameworks copy loaders (a deepcopy of the trainer's DataLoader, a dataset pickled to
    another process). After an epoch through shardstream.torch.DataLoader both copies failed: the
    dataset kept the DataLoader's batch memory (a lock, shared flags), which no copy can take and
    which belongs to that DataLoader's workers only."""
    import copy
    import pickle

    import shardstream.torch as sst

    root, samples = dataset
    ds = sst.IterableDataset(str(root), batch_size=64, seed=3, connect=daemon.addr)
    dl = sst.DataLoader(ds, num_workers=workers)
    ds.set_epoch(1)
    first = [k for b in dl for k in b["__key__"]]
    assert sorted(first) == sorted(samples)
    twin = copy.deepcopy(dl)
    assert [k for b in twin for k in b["__key__"]] == first
    again = pickle.loads(pickle.dumps(ds))
    assert again.epoch == 1
    assert [k for b in sst.DataLoader(again, num_workers=workers) for k in b["__key__"]] == first


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_set_epoch_is_the_start_of_that_epoch(daemon, dataset, workers: int) -> None:
    """``state_dict()`` says where the next iteration starts. The DataLoader counted the batches
    it yielded and took that count back only when an iteration began, while ``set_epoch`` (on
    the dataset) reset the dataset's start alone: a state saved after ``set_epoch(e + 1)`` named
    epoch e + 1 with epoch e's count, and a loader resumed from it yielded nothing of e + 1 (or
    skipped the batches e had got to before a ``break``). The same after ``load_state_dict``
    followed by ``set_epoch`` of another epoch. Each resumed loader must give exactly the rest of
    the epoch its state names, by key."""
    import shardstream.torch as sst

    root, samples = dataset
    kw = dict(batch_size=64, seed=3, rank=0, world_size=1, connect=daemon.addr)

    def reference(epoch: int, start: int = 0) -> list[str]:
        return reference_keys(root, kw, epoch, start)

    def resumed(state: dict) -> list[str]:
        ds = sst.IterableDataset(str(root), **kw)
        dl = sst.DataLoader(ds, num_workers=workers)
        dl.load_state_dict(state)
        ds.set_epoch(state["epoch"])  # what a training loop does before iterating
        return [k for b in dl for k in b["__key__"]]

    ds = sst.IterableDataset(str(root), **kw)
    dl = sst.DataLoader(ds, num_workers=workers)
    ds.set_epoch(0)
    assert sorted(k for b in dl for k in b["__key__"]) == sorted(samples)
    ds.set_epoch(1)
    state = dl.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 0), state
    assert resumed(state) == reference(1) and len(reference(1)) == len(samples)

    # Stopped after 3 batches of epoch 1: a state saved there resumes at the 4th; one saved
    # after set_epoch(2) at the start of epoch 2.
    got = []
    for n, batch in enumerate(dl, 1):
        got.extend(batch["__key__"])
        if n == 3:
            break
    assert got == reference(1)[: len(got)]
    state = dl.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 3), state
    assert got + resumed(state) == reference(1)
    ds.set_epoch(2)
    state = dl.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (2, 0), state
    assert resumed(state) == reference(2)

    # Restored mid-epoch, then moved to another epoch: the state is that epoch's start, and so is
    # what this loader iterates.
    dl.load_state_dict(dict(state, epoch=1, batches_consumed=5))
    assert dl.state_dict()["batches_consumed"] == 5
    ds.set_epoch(4)
    state = dl.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (4, 0), state
    assert resumed(state) == reference(4)
    assert [k for b in dl for k in b["__key__"]] == reference(4)
    assert dl.state_dict()["batches_consumed"] == len(dl)


def test_out_of_order_delivery_and_epochs_past_int64_are_refused_not_resumed_wrong(daemon, dataset) -> None:
    """``state_dict()`` counts batches as a prefix of the rank's order. torch's ``in_order=False``
    yields a worker's batches as they come (rank batches 1, 3, 5, 7 first): a state of 4 batches
    then resumed into 20 repeated and 20 lost samples. And the epoch, a u64 everywhere else, was
    kept in a signed int64: 2**63 came back from a DataLoader's state as -2**63."""
    import shardstream.torch as sst

    root, _ = dataset
    kw = dict(batch_size=64, seed=3, rank=0, world_size=1, connect=daemon.addr)
    with pytest.raises(ValueError, match="in_order"):
        sst.DataLoader(sst.IterableDataset(str(root), **kw), num_workers=2, in_order=False)
    ds = sst.IterableDataset(str(root), **kw)
    dl = sst.DataLoader(ds)
    ds.set_epoch(2**63)
    state = dl.state_dict()
    assert state["epoch"] == 2**63, state
    again = sst.IterableDataset(str(root), **kw)
    sst.DataLoader(again).load_state_dict(state)
    assert again.epoch == 2**63
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="epoch"):
            ds.set_epoch(bad)


def test_a_dataset_that_changes_between_epochs_is_refused_not_streamed(daemon, tmp_path: Path) -> None:
    """Ranks agree on the dataset's fingerprint when their loaders are made. A shard added (or
    replaced) later was streamed at the next epoch by whichever rank opened it after the change:
    ranks of one epoch then had different batch counts (a hang under DDP), samples went twice,
    and the state saved named the old fingerprint. Every stream is now held to the fingerprint
    the loader was made with."""
    from conftest import write_dataset

    root = tmp_path / "data"
    samples = write_dataset(root, n=30, per_shard=10)
    loader = shardstream.Loader(str(root), batch_size=8, seed=1, connect=daemon.addr)
    assert sorted(k for b in loader for k in b["__key__"]) == sorted(samples)
    write_dataset(tmp_path / "more", n=10, per_shard=10, seed=9)
    (tmp_path / "more" / "train-000000.tar").rename(root / "train-000009.tar")
    loader.set_epoch(1)
    with pytest.raises(ValueError, match="changed"):
        for _ in loader:
            pass
    # A loader made now sees the new shards, and streams them.
    fresh = shardstream.Loader(str(root), batch_size=8, seed=1, connect=daemon.addr)
    assert sum(len(b["__key__"]) for b in fresh) == 40
