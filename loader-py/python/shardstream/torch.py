"""PyTorch integration: a ``torch.utils.data.IterableDataset`` that splits a rank's batches among
the DataLoader's workers, still exactly once per epoch, and a ``DataLoader`` that can save and
restore its position.

Worker ``w`` of ``K`` streams the rank's batches ``w, w+K, w+2K, ...``; torch collects workers'
results round-robin, so the DataLoader yields the rank's batches in exactly the order a single
``Loader`` would. Use ``batch_size=None`` (batches are already formed by the daemon)::

    ds = shardstream.torch.IterableDataset("/data/train/", batch_size=256, seed=0)
    dl = shardstream.torch.DataLoader(ds, num_workers=2)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in dl:
            ...
    state = dl.state_dict()

**The fast way with workers: transform in the worker.** Decoding and augmenting belong in the
DataLoader workers, on the zero-copy views, so that only their output (decoded tensors) crosses to
the trainer process::

    def decode(sample):             # runs in a worker; sample["jpg"] is a read-only memoryview
        img = PIL.Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        return to_tensor(augment(img)), int(bytes(sample["cls"]))

    ds = shardstream.torch.IterableDataset("/data/train/", batch_size=256, transform=decode)
    dl = shardstream.torch.DataLoader(ds, num_workers=4)
    for images, labels in dl:       # default_collate of the transform's outputs
        ...

``transform`` is called once per sample with a dict ``{"__key__": str, field: memoryview or None}``
and the batch's results are combined by ``collate_fn`` (default
``torch.utils.data.default_collate``); ``batch_transform`` is called once per batch with the whole
batch (``"__key__"`` -> list of str, field -> list of memoryviews; with ``format="arrow"`` the
``pyarrow.RecordBatch``, where ``transform`` is refused) and its result is yielded as it is (numpy
arrays become tensors, as a plain ``DataLoader(batch_size=None)`` makes them).
Either runs where the batch is read: in each worker, or in the trainer with ``num_workers=0``.
Nothing a transform returns is ever overwritten. A batch of WebDataset shards returns its lease
on them as soon as the transform returns (its memoryviews stay readable: the daemon at most
unlinks a shard's cache copy). A batch that lies in a slot of the stream's ring (Parquet
datasets, ``collate="stack"``) keeps its slot until nothing refers to it any more: a result that
holds a view of it (a tensor over a column, a memoryview of a binary value, a 0-d tensor of a
sample's value with a ``collate_fn`` that does not stack) keeps the slot, and the ring has 8 by
default; so a trainer that keeps such results of that many batches stalls its own stream (a
``RuntimeWarning`` says so after 5 s, where the batches are read). Copy
what you keep (``.clone()``, ``bytes(view)``); ``default_collate`` copies as it stacks. An
exception raised by the transform reaches the trainer as the DataLoader re-raises it (its type,
with the sample's key in the worker's traceback).

With the default collate, a batch's large tensors (1 MiB and up, such as a batch of decoded
images) are stacked into memory reused once the trainer holds no tensor, view or numpy array over
that batch any more (each worker's shared memory; the trainer's own without workers), instead of
new memory per batch, whose fresh pages cost zeroing and freeing: it halved the loader's CPU with
2 workers in ``bench/decode_bench.py``. Batches the trainer keeps are never overwritten. With
workers, a batch tensor sent on to another process must be ``.clone()``d first (that process's
mapping is not seen), or build the DataLoader with ``reuse_batch_memory=False``.

Without a transform, in worker processes fields arrive as ``bytes`` (batches cross a process
boundary by pickling, which memoryviews cannot: every byte is copied twice, into the pickle and
out of it); with ``num_workers=0`` they are zero-copy memoryviews, but ``bytes`` when the
DataLoader pins (``pin_memory=True``: torch's ``pin_memory`` takes a memoryview for a sequence and
would rebuild each as a list of Python ints). A batch's ``to(...)`` moves its tensors and keeps
its views: frameworks that move batches by calling ``to`` (Lightning, accelerate) take it.

With ``collate="stack"`` each field is one ``uint8`` tensor of shape ``(samples, record_bytes)``
(``.view(torch.int32)`` etc. for typed records). With ``num_workers=0`` and shared memory it lies
in the daemon's ring, without a copy (mapped copy-on-write: an in-place write such as ``x.mul_(2)``
copies the page for this process alone, never reaching the daemon or later batches;
``pin_memory`` copies it out); in workers each field is copied out of the ring once, large ones (1 MiB a batch
and up) into shared memory the worker reuses as described above, and crosses to the trainer as
torch shared memory. Without a transform the rank's batches are fastest with ``num_workers=0``.

Parquet datasets: every numeric column that holds no null anywhere in the dataset (and
``"__row__"``) becomes a tensor over the record batch's memory (``torch.from_numpy``, no copy with
``num_workers=0``), timestamps and durations an ``int64`` one of the counts of the column's unit
Arrow stores (since the epoch, in UTC for zoned timestamps); a column that may hold one stays a
``numpy.ma.MaskedArray`` in every batch (torch has no null; which columns may: the README),
binary columns stay lists of memoryviews / bytes, strings lists of str. ``collate="stack"`` gives
2-D tensors for ``fixed_size_list`` columns and for equal-length lists, ``(rows, *shape)`` ones for
lists of lists of equal shape (Hugging Face ``Array2D``/``Array3D``). ``format="arrow"`` yields
``pyarrow.RecordBatch`` objects untouched.
"""

from __future__ import annotations

import copy
import multiprocessing
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.utils.data

from . import Batch, Loader, _checked_epoch, _native, _warn_same_order, resolve_address
from ._batch_memory import BatchMemory, Pooled


def _as_tensors(batch: dict[str, Any], handed_out: bool = True) -> dict[str, Any]:
    """Numeric numpy fields as torch tensors over the same memory (masked arrays and lists stay as
    they are); timestamps and durations as ``int64`` counts of their unit. Over shared memory
    that is the batch's ring slot, read-only to numpy; torch has no read-only tensors and warns
    about it for every batch. Writing into such a tensor in place is
    allowed: the batch tells the client (``_may_be_written``), which opens the slot for writes in
    its copy-on-write mapping of the ring, so a write stays in this process, and drops what was
    written before the slot goes back. ``handed_out=False`` when only this module reads the
    tensors (a worker copying them out): no write can happen, and the slot stays read-only."""
    import numpy as np

    over_ring = False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, value in batch.items():
            if name == "__key__" or type(value) is not np.ndarray or value.dtype.kind not in "biufMm":
                continue
            over_ring = over_ring or not value.flags.writeable
            if value.dtype.kind in "Mm":
                # torch has no datetime dtype (its default_convert raises on one): the int64
                # counts of the column's unit Arrow stores, viewed in place.
                value = value.view(np.int64)
            batch[name] = torch.from_numpy(value)
    if over_ring and handed_out and isinstance(batch, Batch):
        batch._may_be_written()
    return batch


def _samples(batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The batch's samples, one dict each (``"__key__"`` -> str, field -> its value)."""
    names = list(batch)
    columns = [batch[n] for n in names]
    for values in zip(*columns, strict=True):
        yield dict(zip(names, values, strict=True))


def _transform_batch(
    batch: Any,
    transform: Callable[[dict[str, Any]], Any] | None,
    batch_transform: Callable[[Any], Any] | None,
    collate_fn: Callable[[list[Any]], Any],
) -> Any:
    """Runs the user's transform over one batch of zero-copy views (only the result lives on: in a
    worker, it is what gets pickled to the trainer), then returns the batch's lease where what
    the result may keep outlives it (`_release_early`)."""
    try:
        if batch_transform is not None:
            return batch_transform(batch)
        assert transform is not None
        out = []
        for sample in _samples(batch):
            try:
                out.append(transform(sample))
            except Exception as e:
                # The key reaches the trainer too: torch re-raises a worker's exception with the
                # worker's formatted traceback, notes included.
                e.add_note(f"in the shardstream transform of sample {sample['__key__']!r}")
                raise
        return collate_fn(out)
    finally:
        _release_early(batch)


def _release_early(batch: Any) -> None:
    """Returns the lease of a batch its transform is done with, if the values the batch handed
    out stay valid without it: memoryviews into WebDataset shards (the daemon may then evict a
    node-cache copy, which it only ever unlinks; a shard read in place was read into the batch's
    own memory). Not a batch that lies in a ring slot (Arrow/Parquet, ``collate="stack"``): the
    daemon rewrites a released slot, so its arrays, tensors and memoryviews, which the
    transform's result may keep, hold the slot themselves until the last of them is gone (when
    the batch is dropped, if the result keeps none). A ``pyarrow.RecordBatch``
    (``format="arrow"``) has no lease of its own: its buffers hold the slot."""
    native = getattr(batch, "_native", None) if isinstance(batch, Batch) else None
    if isinstance(native, _native.Batch) and not (native.arrow or native.packed):
        native.release(False)


class IterableDataset(torch.utils.data.IterableDataset[Any]):
    """One rank's share of a dataset as batches (dicts), split among DataLoader workers.

    Takes the arguments of :class:`shardstream.Loader` but ``copy`` (each worker's loader copies
    exactly when its batches are pickled whole: without a transform), plus ``transform`` (per sample) or
    ``batch_transform`` (per batch), the worker-side fast path (see the module's docs): they run on
    the zero-copy views where the batch is read, in each DataLoader worker, and only their result
    crosses to the trainer. With ``transform`` the batch's results go through ``collate_fn``
    (default ``torch.utils.data.default_collate``). Call ``set_epoch`` before iterating a new epoch:
    workers read the epoch (and a resumed start) when each iteration begins, persistent ones too.
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 256,
        *,
        shuffle: bool = True,
        seed: int = 0,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        connect: str = "auto",
        transport: str = "auto",
        shuffle_window: int = 0,
        cache: str = "auto",
        collate: str | None = None,
        format: str = "dict",
        binary_views: bool = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        batch_transform: Callable[[Any], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        super().__init__()
        if transform is not None and batch_transform is not None:
            raise ValueError("give transform (per sample) or batch_transform (per batch), not both")
        if collate_fn is not None and transform is None:
            raise ValueError("collate_fn combines the results of transform; it needs transform")
        for name, fn in (("transform", transform), ("batch_transform", batch_transform), ("collate_fn", collate_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, not {type(fn).__name__}")
        if transform is not None and format == "arrow":
            raise ValueError(
                'transform is called on each sample of the dict form; with format="arrow" give batch_transform, '
                "which gets each pyarrow.RecordBatch"
            )
        self.transform = transform
        self.batch_transform = batch_transform
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or torch.utils.data.default_collate
        self._default_collate = collate_fn is None
        # Set by shardstream.torch.DataLoader before its workers start (see _batch_memory).
        self._memory: BatchMemory | None = None
        # Resolved here, in the parent: forked or spawned workers then reach the same daemon
        # (an embedded server, if one was started, lives in the parent).
        address = resolve_address(connect)
        self._kwargs: dict[str, Any] = dict(
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            fields=fields,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            connect=address,
            transport=transport,
            shuffle_window=shuffle_window,
            cache=cache,
            collate=collate,
            format=format,
            binary_views=binary_views,
        )
        self.url = url
        probe = Loader(url, **self._kwargs)
        self._kwargs["rank"], self._kwargs["world_size"] = probe.rank, probe.world_size
        self._state_template = probe.state_dict()
        self._batches_per_rank = len(probe)
        self._arrow = probe.arrow
        probe.close()
        # The epoch and the batch to start it at, in memory the DataLoader's workers share with
        # this process: persistent workers keep the dataset object they were started with, and
        # read these when each iteration begins (see `__getstate__`).
        self._position = _shared_position()
        # Where the trainer stands in the epoch: the rank's batches it has taken through a
        # shardstream.torch.DataLoader (what its state_dict() saves). Kept here, with the epoch,
        # so that set_epoch moves both: a count the DataLoader kept was the last epoch's until
        # its next iteration began.
        self._consumed = 0
        # The epoch an iteration in this process last read to its end (see _warn_same_order).
        self._finished_epoch: int | None = None
        self._warned_same_order = False
        # Set by a shardstream.torch.DataLoader for each iteration: whether it pins its batches.
        self._pinned = False

    @property
    def epoch(self) -> int:
        return int(self._position[0])

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._position[0] = _checked_epoch(epoch)

    @property
    def start_batch(self) -> int:
        return int(self._position[1])

    @start_batch.setter
    def start_batch(self, batch: int) -> None:
        self._position[1] = int(batch)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # To a worker being started: the shared memory itself. Any other pickle or copy (a
        # deepcopy, a spawn outside a DataLoader) gets the values, in memory of its own, and no
        # batch memory: that is the DataLoader's workers' (a copy's DataLoader sets its own).
        if _spawning() is None:
            state["_position"] = [self.epoch, self.start_batch]
            state["_memory"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        position = state.pop("_position")
        self.__dict__.update(state)
        if isinstance(position, list):
            self._position = _shared_position()
            self._position[0], self._position[1] = position
        else:
            self._position = position

    def __len__(self) -> int:
        return self._batches_per_rank

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration follows, from its start (a DataLoader's
        ``state_dict()`` then says so); the same epoch again keeps the position (a resumed one)."""
        epoch = _checked_epoch(epoch)
        if epoch != self.epoch:
            self.start_batch = 0
            self._consumed = 0
        self.epoch = epoch
        self._finished_epoch = None

    def __iter__(self) -> Iterator[Any]:
        fetcher = _fetcher(sys._getframe(1))
        _refuse_batching_again(fetcher)
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is None:
            # In the trainer's process (no workers); a shardstream.torch.DataLoader with workers
            # checks for itself, its workers' copies cannot tell.
            _warn_same_order(self, self.epoch, bool(self._kwargs["shuffle"]), self.start_batch)
        transformed = self.transform is not None or self.batch_transform is not None
        memory = self._memory if info is not None or transformed else None
        # Stacked TAR fields in a worker are copied out of the ring by the batch memory (large
        # ones into its slots) rather than by the loader and then again by torch's pickling.
        adopt = memory is not None and not transformed and self._kwargs["collate"] == "stack" and not self._arrow
        # A worker without a transform pickles whole batches, which memoryviews cannot be: copy. With
        # one, the transform reads the views in place and only its result is pickled.
        copy = info is not None and not transformed and not adopt
        # A plain DataLoader's default_convert in the trainer's process (num_workers=0) takes a
        # memoryview for a sequence and would make each a list of Python ints: it gets bytes, as
        # from its workers (tensors over the ring stay as they are).
        # So does torch's pin_memory (a DataLoader's pin_memory=True where an accelerator is), on
        # every field of every batch.
        views_to_bytes = not copy and not transformed and not adopt
        views_to_bytes &= getattr(fetcher, "collate_fn", None) is torch.utils.data.default_convert or (
            info is None and self._pinned
        )
        loader = Loader(self.url, copy=copy, _worker=(worker, num_workers), **self._kwargs)
        state = dict(self._state_template, epoch=self.epoch, batches_consumed=self.start_batch)
        loader.load_state_dict(state)
        # Stacked fields, and the numeric columns of an Arrow batch in the dict form, become tensors.
        stacked = self._kwargs["collate"] == "stack" or (loader.arrow and self._kwargs["format"] == "dict")
        collate_fn = self.collate_fn
        if memory is not None and self.transform is not None and self._default_collate:
            collate_fn = memory.collate_fn(worker)
        for batch in loader:
            if stacked:
                batch = _as_tensors(batch, handed_out=not adopt)
            if transformed:
                yield _transform_batch(batch, self.transform, self.batch_transform, collate_fn)
            elif adopt:
                assert memory is not None
                try:
                    pooled = memory.adopt(batch, worker)
                finally:
                    batch.release(at_once=False)
                yield pooled
                del pooled
            elif views_to_bytes:
                yield _views_as_bytes(batch)
            else:
                yield batch
            del batch  # not kept alive (with its lease) while the consumer holds the next one
        if info is None:
            self._finished_epoch = self.epoch


def _views_as_bytes(batch: Any) -> Any:
    """``batch`` with each list of memoryviews (TAR fields, binary columns) made a list of bytes."""
    if not isinstance(batch, dict):
        return batch
    for name, values in batch.items():
        if isinstance(values, list) and any(isinstance(v, memoryview) for v in values):
            batch[name] = [bytes(v) if isinstance(v, memoryview) else v for v in values]
    return batch


def _shared_position() -> Any:
    """Two uint64 (epoch, start batch) in shared memory that forked and spawned workers inherit
    (an epoch is any u64, as for ``Loader``)."""
    return multiprocessing.RawArray("Q", 2)


def _spawning() -> Any:
    """The process being started while this one pickles its arguments, if any (the only time
    shared memory may be pickled)."""
    from multiprocessing import context

    return context.get_spawning_popen()


def _fetcher(frame: types.FrameType | None) -> Any:
    """The DataLoader fetcher iterating this dataset, or None. The IterableDataset cannot see its
    DataLoader; the fetcher, which calls ``next`` on this generator from its ``fetch`` (in the
    trainer, or in each worker), can be seen on the stack with its ``auto_collation`` and
    ``collate_fn``. Should torch move that, nothing is found (and the documented
    ``batch_size=None`` is unaffected)."""
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher

    for _ in range(4):
        if frame is None:
            return None
        fetcher = frame.f_locals.get("self")
        if isinstance(fetcher, _IterableDatasetFetcher):
            return fetcher
        frame = frame.f_back
    return None


def _refuse_batching_again(fetcher: Any) -> None:
    """A ``ValueError`` when a DataLoader that batches (its default ``batch_size=1``, any
    ``batch_size`` or ``batch_sampler``) is asking for this dataset's items: it would wrap each
    batch in another (a leading dimension of 1 on every tensor) or merge several, without a word."""
    if getattr(fetcher, "auto_collation", False):
        raise ValueError(
            "shardstream.torch.IterableDataset yields whole batches (its batch_size); a "
            "torch DataLoader that batches (batch_size=1 by default, or a batch_size or "
            "batch_sampler) would batch them again: give the DataLoader batch_size=None, "
            "or use shardstream.torch.DataLoader, which does"
        )


def _convert(data: Any) -> Any:
    """The DataLoader's per-batch conversion (``batch_size=None``): a raw batch, or one stacked into
    reused memory (already collated), as it is; a transform's result as it is too, but for numpy
    arrays and scalars, which become tensors as a plain ``DataLoader(batch_size=None)`` makes them
    (torch's ``default_convert``). Not ``default_convert`` itself: it takes a memoryview for a
    sequence and made every field of a zero-copy batch a list of ints (a Python int per byte),
    and tuples lists."""
    if isinstance(data, (Batch, Pooled, memoryview, torch.Tensor, str, bytes)):
        return data
    if isinstance(data, Mapping):
        converted = {k: _convert(v) for k, v in data.items()}
        # As default_convert keeps a mapping's kind: a defaultdict keeps its factory, an
        # OrderedDict its order.
        try:
            if isinstance(data, MutableMapping):
                clone = copy.copy(data)
                clone.update(converted)
                return clone
            return type(data)(converted)  # type: ignore[call-arg]  # a Mapping of its own kind
        except TypeError:
            return converted
    if isinstance(data, tuple):
        items = [_convert(d) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else tuple(items)
    if isinstance(data, list):
        items = [_convert(d) for d in data]
        if type(data) is list:
            return items
        # A list of its own kind keeps it, as default_convert keeps it.
        kept = copy.copy(data)
        kept[:] = items
        return kept
    return torch.utils.data.default_convert(data)  # type: ignore[no-untyped-call]  # torch leaves it untyped


#: What ``next`` gives for a DataLoader iterator that has ended (None is a batch a transform may make).
_END = object()


class _EpochSampler(torch.utils.data.dataloader._InfiniteConstantSampler):
    """The sampler torch gives a DataLoader over an iterable dataset, with the ``set_epoch`` that
    frameworks call on a DataLoader's sampler each epoch, passed on to the dataset."""

    def __init__(self, dataset: IterableDataset) -> None:
        super().__init__()
        self._dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        self._dataset.set_epoch(epoch)


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` over a shardstream :class:`IterableDataset` that counts the
    batches it yields, so ``state_dict()`` / ``load_state_dict()`` resume exactly (also in a new
    process after a crash). ``batch_size`` is fixed to None: the daemon forms the batches.

    ``reuse_batch_memory`` (default True): with a per-sample ``transform`` whose results go through
    the default collate, a batch's large tensors (1 MiB and up) are stacked into memory reused once
    the trainer holds no reference to that batch any more (each worker's shared memory, or the
    trainer's own without workers), instead of new memory per batch (see the module's docs); so
    are stacked fields (``collate="stack"``) that workers copy out of the daemon's ring; with
    ``pin_memory=True`` the trainer gets the pinned copy and the slot comes free once it is made.
    Not with a ``collate_fn`` given to the DataLoader. With workers, a tensor of a batch sent on to
    another process must be ``.clone()``d first, or pass False. ``batch_memory_counts()`` says how
    many tensors were stacked into a reused slot, into a new one, and outside the slots (all of
    them held by the trainer)."""

    def __init__(self, dataset: IterableDataset, *, reuse_batch_memory: bool = True, **kwargs: Any) -> None:
        if not isinstance(dataset, IterableDataset):
            raise TypeError("shardstream.torch.DataLoader needs a shardstream.torch.IterableDataset")
        if kwargs.pop("batch_size", None) is not None:
            raise ValueError("batch_size is set on the dataset; the DataLoader must use batch_size=None")
        for name in ("drop_last", "shuffle"):
            # torch's own refusals name batch_size=None, which the caller never gave.
            if kwargs.get(name):
                raise ValueError(
                    f"{name} is the dataset's, which forms the batches: "
                    f"shardstream.torch.IterableDataset(..., {name}=True), not the DataLoader's"
                )
        if not kwargs.get("in_order", True):
            # state_dict() counts the batches yielded as a prefix of the rank's order: batches out
            # of order would resume with some repeated and others never seen.
            raise ValueError(
                "in_order=False is not supported: shardstream's resume state (state_dict) needs the "
                "rank's batches in order"
            )
        kwargs.setdefault("collate_fn", _convert)
        super().__init__(dataset, batch_size=None, **kwargs)
        # Where frameworks call set_epoch (Lightning's trainer, on a DataLoader's sampler, as for a
        # DistributedSampler): without it every Lightning epoch repeated the first one's order.
        # torch refuses a sampler for an iterable dataset and then guards the attribute; this one
        # iterates as torch's own does.
        object.__setattr__(self, "sampler", _EpochSampler(dataset))
        self._ss_dataset = dataset
        # Iterations begun: only the latest one yields (see __iter__).
        self._iterations = 0
        self._reuse_memory = bool(reuse_batch_memory) and self.collate_fn is _convert
        self._memory: BatchMemory | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a deepcopy of the trainer's loader) starts batch memory of its own when it
        # iterates; this one's belongs to this loader's workers.
        state = self.__dict__.copy()
        state["_memory"] = None
        return state

    def _start_memory(self) -> BatchMemory | None:
        """The batch memory of the iteration about to start: a new one each iteration (its
        workers are new), unless the workers persist (then the memory they were started with)."""
        if not self._reuse_memory:
            return None
        if self._memory is not None and not (self.persistent_workers and self.num_workers > 0):
            self._memory.forget()
        if self.num_workers == 0:
            self._memory = BatchMemory(None, 1, 0)
            return self._memory
        if self.persistent_workers and self._memory is not None:
            return self._memory
        context = self.multiprocessing_context or multiprocessing
        assert self.prefetch_factor is not None  # torch sets it whenever there are workers
        self._memory = BatchMemory(context, self.num_workers, self.prefetch_factor)
        return self._memory

    def batch_memory_counts(self) -> dict[str, int]:
        """Tensors stacked into reused memory, into newly allocated slots, and without a slot, over
        the current (or last) iteration, or since persistent workers started; all zero when the
        memory is not reused."""
        if self._memory is None:
            return {"reused": 0, "allocated": 0, "unpooled": 0}
        return self._memory.counts()

    # A generator over the parent's iterator (it counts consumed batches), not the parent's
    # iterator type: nothing calls the _BaseDataLoaderIter methods on a DataLoader's __iter__().
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self._ss_dataset
        # One iteration at a time, as a Loader: the dataset counts one position (state_dict()),
        # which two live iterations (zip(dl, dl), a new iter(dl) beside an old one) both moved,
        # to a count neither stood at, or past the epoch's batches.
        self._iterations += 1
        mine = self._iterations
        _warn_same_order(ds, ds.epoch, bool(ds._kwargs["shuffle"]), ds.start_batch)
        ds._consumed = ds.start_batch
        ds._pinned = bool(self.pin_memory)
        memory = ds._memory = self._start_memory()
        batches = super().__iter__()
        if memory is not None:
            # Persistent workers: torch has just dropped the batches the last iteration left in
            # flight; their slots are free before the workers build this epoch's batches into them.
            memory.collect()
        lost = False
        try:
            while True:
                # Checked before the next batch is taken: persistent workers serve every iteration
                # from one torch iterator, and a batch taken here would be the newer one's.
                if self._iterations != mine:
                    raise RuntimeError(
                        "a newer iteration of this shardstream.torch.DataLoader began, which ends this one: "
                        "iterate it once at a time (its state_dict() is one position), or make a DataLoader "
                        "for each consumer"
                    )
                batch = next(batches, _END)
                if batch is _END:
                    break
                ds._consumed += 1
                if ds._consumed == len(ds):
                    # Its last batch: a loop bounded by len() (Lightning's) never asks past it,
                    # and a next iteration without set_epoch() repeats the order unwarned.
                    ds._finished_epoch = ds.epoch
                if isinstance(batch, Pooled):
                    assert memory is not None
                    # The batch before this one is usually still held by the caller's loop
                    # variable; its slots come free on a later call.
                    memory.collect()
                    batch = memory.receive(batch)
                yield batch
            ds._finished_epoch = ds.epoch
        except ConnectionError:
            lost = True
            raise
        finally:
            # The start applies to this iteration alone, ended or left (a break): the next one
            # begins the epoch, as a Loader's does; but after a lost daemon (a worker's
            # ConnectionError, re-raised here), where this one stopped, as a Loader's does too.
            # The workers have read it by now, or will not (non-persistent ones end with this
            # iterator; persistent ones read it again when the next iteration starts).
            # state_dict() still says where this one stood.
            ds.start_batch = ds._consumed if lost else 0
            # This iteration's batch memory is its own (persistent workers keep their copy): a
            # plain DataLoader iterating the dataset next would stack its batches into it and
            # yield the handles that only this loader unwraps.
            if ds._memory is memory:
                ds._memory = None

    def state_dict(self) -> dict[str, Any]:
        """Where the trainer stands: a loader given this state continues after the batches yielded
        so far in the epoch, or from the start of the epoch ``set_epoch`` selected since."""
        ds = self._ss_dataset
        return dict(ds._state_template, epoch=ds.epoch, batches_consumed=ds._consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ds = self._ss_dataset
        # Validate against the dataset's parameters the same way a Loader does.
        check = Loader(ds.url, **ds._kwargs)
        check.load_state_dict(state)
        check.close()
        ds.epoch = int(state["epoch"])
        ds._finished_epoch = None
        # After the epoch's last batch: the epoch yields nothing more (as with Loader).
        ds.start_batch = min(int(state["batches_consumed"]), len(ds))
        ds._consumed = ds.start_batch
