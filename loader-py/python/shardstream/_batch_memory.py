"""Memory reused for the batches a transform's results are stacked into, and for stacked fields
(``collate="stack"``) copied out of the daemon's ring in DataLoader workers (``shardstream.torch``).

``default_collate`` stacks each batch's tensors into memory of its own: in a DataLoader worker a
new shared-memory segment, in the trainer (no workers) a new ``malloc`` block, which at tens of MiB
is a fresh mapping too. Fresh pages cost zeroing and mapping them, and freeing them once the batch
is dropped: for 224x224 images in batches of 256 (38.5 MB) ~29 ms of a worker's CPU a batch, more
than everything else the loader did with 2 workers (``bench/DECODE_RESULTS.md``). Here a few slots
are kept (per worker) and a batch's large tensors are stacked into a free one: its pages stay
mapped, so the stack is a plain copy, and dropping the batch frees nothing.

A slot is free again once the trainer holds no reference to its memory. The trainer watches every
pooled tensor it receives with torch's ``StorageWeakRef`` on the tensor's storage, which expires
when the last tensor, view or numpy array over that storage is gone, and then clears the slot's
flag; a slot is only taken while its flag is clear. With workers the flags are a small array
shared with them (under its lock) and the storage watched is the trainer's own mapping of the
slot. Without workers the slot's storage stays in the pool, so the batch is handed out through
DLPack (``torch.utils.dlpack.from_dlpack``): a storage of its own over the same memory, which is
what is watched. With ``pin_memory=True`` the trainer gets the pinned copy, and the slot comes
free once it is made. Batches the trainer keeps keep their slots, and with no slot free a batch is
stacked into new memory, as ``default_collate`` would: the slots never hold more than
prefetch_factor + 3 batches' large tensors per worker (3 batches without workers), whatever the
trainer keeps. The trainer starts watching a batch's slots as the batch arrives from its worker,
before torch hands it on: torch drops the batches still in flight when an epoch of persistent
workers is left early (``break``), and their slots come free as those batches are gone.

What the trainer cannot see: with workers, a batch's tensor sent on to a third process (a
``torch.multiprocessing`` queue, say) maps the same segment, and once the trainer drops its own
reference the worker may reuse it. ``.clone()`` what is sent on, or build the DataLoader with
``reuse_batch_memory=False``. (Without workers the slot is private memory, which torch copies into
a new segment to send.)
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map
from torch.utils.dlpack import from_dlpack

# Below this a batch tensor comes from malloc's arenas or a small segment, and reusing it saves
# little; labels, ids and other per-sample scalars stay with default_collate.
MIN_BYTES = 1 << 20
# Slots a worker keeps beyond its prefetched batches (and all a trainer without workers keeps): the
# one being built, the one the trainer holds while asking for the next, and the one before it,
# dropped by then but only found free once the next batch arrives (see `DataLoader.__iter__`).
SPARE_SLOTS = 3
# How long the trainer waits for the flags' lock before it leaves the slots it found free for its
# next batch. Workers hold the lock for microseconds; one killed while holding it (the OOM killer)
# leaves it held for good, and the trainer must not hang on it: torch reports the dead worker.
COLLECT_WAIT_S = 0.5
# Large tensors a batch may have (images and masks, say) each take a slot of their own; slots are
# only allocated when no free one fits, so a batch of one large tensor never uses the others.
TENSORS_PER_BATCH = 4

# The slots of batches that reached this process from a worker, by the memory they came from
# (`BatchMemory.id`): registered as each batch is unpickled (in the trainer's thread, or torch's
# pin-memory thread), so that `collect` sees them even when torch drops a batch before the loop
# does, and taken over by that memory's next `collect`.
_arrived: dict[str, list[tuple[int, StorageWeakRef]]] = {}
_arrived_lock = threading.Lock()


def _refs(tensors: list[tuple[int, torch.Tensor]]) -> list[tuple[int, StorageWeakRef]]:
    return [(slot, StorageWeakRef(t.untyped_storage())) for slot, t in tensors]  # type: ignore[no-untyped-call]


def _arrivals(memory: str) -> list[tuple[int, StorageWeakRef]]:
    with _arrived_lock:
        return _arrived.pop(memory, [])


def _copy_of(src: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    return lambda dst: dst.copy_(src)


class _LocalFlags:
    """The flags of a trainer without workers: one process, no shared memory (the interface of
    ``multiprocessing.Array`` that `BatchMemory` uses)."""

    def __init__(self, size: int) -> None:
        self._flags = bytearray(size)
        self._lock = threading.Lock()

    def get_lock(self) -> threading.Lock:
        return self._lock

    def get_obj(self) -> bytearray:
        return self._flags


class Pooled:
    """A collated batch whose large tensors lie in slots, on its way to the trainer's loop;
    ``shardstream.torch.DataLoader`` unwraps it (`BatchMemory.receive`) before the user sees it.
    While it is being built it also carries the bytes of its large tensors so far."""

    __slots__ = ("data", "tensors", "reused", "allocated", "unpooled", "worker", "memory", "large_bytes", "arrived")

    def __init__(self, worker: int, memory: str) -> None:
        self.data: Any = None
        # (slot, tensor): pickled with `data` in one pickle, so in the trainer each tensor here is
        # the very object inside `data`, over the same storage.
        self.tensors: list[tuple[int, torch.Tensor]] = []
        self.reused = self.allocated = self.unpooled = 0
        self.worker = worker
        self.memory = memory
        self.large_bytes = 0
        # Unpickled from a worker, and so watched since (made in this process: once received).
        self.arrived = False

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        # Watched from now on, whether or not torch hands it on.
        self.arrived = True
        refs = _refs(self.tensors)
        with _arrived_lock:
            _arrived.setdefault(self.memory, []).extend(refs)

    def pin_memory(self, device: Any = None) -> Pooled:
        """What torch's pin-memory thread calls, in the trainer (``DataLoader(pin_memory=True)``):
        the data copied into pinned memory, which is what the trainer gets. The slots' tensors
        ride along so that the trainer still watches them; nothing but this object holds them any
        more, so their slots come free as soon as the batch is unwrapped."""
        from torch.utils.data._utils import pin_memory as pinning

        # (torch leaves pin_memory untyped)
        pin: Callable[..., Any] = pinning.pin_memory
        self.data = pin(self.data) if device is None else pin(self.data, device)
        return self


class BatchMemory:
    """Slots of ``slots_per_worker`` per worker, with their flags (1 = holds a batch the trainer
    may still use). ``context`` is the DataLoader's multiprocessing context, whose shared array
    holds the flags, or None for a DataLoader without workers (``workers`` 1, the trainer).

    The storages live only in the process that fills them (dropped when pickled to a spawned
    worker); what the trainer tracks lives only in the trainer."""

    def __init__(self, context: Any, workers: int, prefetch_factor: int) -> None:
        if workers < 1:
            raise ValueError(f"batch memory needs a process that collates, got {workers} workers")
        self.id = uuid.uuid4().hex
        self.batches_kept = prefetch_factor + SPARE_SLOTS
        self.slots_per_worker = self.batches_kept * TENSORS_PER_BATCH
        self._shared = context is not None
        # With workers, a lock of their own: the flags are written by one process and read by
        # another, and the lock's acquire and release order those accesses with the tensors'.
        size = workers * self.slots_per_worker
        self._flags = context.Array("b", size) if self._shared else _LocalFlags(size)
        self._local_state()

    def _local_state(self) -> None:
        # Where batches are collated: the slots' storages, their bytes, and the most bytes of
        # large tensors one batch has had (the slots hold at most `batches_kept` such batches,
        # whatever the trainer keeps).
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._pooled_bytes = 0
        self._largest_batch = 0
        # In the trainer.
        self._held: list[tuple[int, StorageWeakRef]] = []
        self.reused = self.allocated = self.unpooled = 0

    def __getstate__(self) -> dict[str, Any]:
        keep = ("id", "batches_kept", "slots_per_worker", "_shared", "_flags")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_state()

    # --- where batches are collated: a worker, or the trainer without workers ---

    def collate_fn(self, worker: int) -> Callable[[list[Any]], Pooled]:
        """``default_collate`` for worker ``worker`` (0 without workers), with large tensors
        stacked into its slots."""

        def collate_pooled(samples: list[Any]) -> Pooled:
            def build(one: Pooled) -> Any:
                def stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
                    return self._fill(batch, (len(batch),), one, lambda dst: torch.stack(batch, 0, out=dst))

                return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: stack})

            return self._build(worker, build)

        return collate_pooled

    def adopt(self, batch: dict[str, Any], worker: int) -> Pooled:
        """A batch of stacked fields (``collate="stack"``, tensors over the daemon's ring) copied
        out of the ring in a worker, large tensors into slots, the rest into new memory; the
        caller then returns the batch's lease (the copies are what crosses to the trainer)."""

        def build(one: Pooled) -> dict[str, Any]:
            return {
                name: self._fill([value], (), one, _copy_of(value)) if isinstance(value, torch.Tensor) else value
                for name, value in batch.items()
            }

        return self._build(worker, build)

    def _build(self, worker: int, build: Callable[[Pooled], Any]) -> Pooled:
        """A batch made by ``build`` (which fills its slots through `_fill`); on failure the
        slots it took are given back."""
        one = Pooled(worker, self.id)
        try:
            one.data = build(one)
        except BaseException:
            self._release([slot for slot, _ in one.tensors])
            raise
        self._largest_batch = max(self._largest_batch, one.large_bytes)
        return one

    def _fill(
        self,
        parts: list[torch.Tensor],
        outer: tuple[int, ...],
        one: Pooled,
        write: Callable[[torch.Tensor], Any],
    ) -> torch.Tensor:
        """A tensor of shape ``outer + parts[0].shape`` written by ``write``: into a slot when it
        is large enough to be worth one and a slot is free, else into new memory (a stack of
        ``parts``, as default_collate makes it, or a copy of the one part)."""
        elem = parts[0]
        nbytes = math.prod(outer) * elem.numel() * elem.element_size()
        poolable = (
            nbytes >= MIN_BYTES
            and elem.device.type == "cpu"
            and elem.layout == torch.strided
            and not elem.is_nested
            and not any(x.requires_grad for x in parts)
        )
        if poolable:
            one.large_bytes += nbytes
        got = self._take(one.worker, nbytes, one.large_bytes) if poolable else None
        if got is None:
            one.unpooled += poolable
            fresh: torch.Tensor = collate_tensor_fn(parts) if outer else elem.clone()
            return fresh
        slot, storage, reused = got
        try:
            out = torch.empty(0, dtype=elem.dtype)
            # torch's stubs type set_'s source as a TypedStorage; an UntypedStorage is what
            # Tensor.untyped_storage() itself returns and set_ takes it (the tests run this path).
            out.set_(storage, 0, (*outer, *elem.shape))  # type: ignore[call-overload]
            write(out)
            if not self._shared:
                # A storage of its own over the slot's memory, alive exactly as long as the
                # trainer's tensors, views and arrays over it (the slot's own storage stays here).
                out = from_dlpack(out)
        except BaseException:
            self._release([slot])
            raise
        one.tensors.append((slot, out))
        if reused:
            one.reused += 1
        else:
            one.allocated += 1
        return out

    def _take(self, worker: int, nbytes: int, batch_bytes: int) -> tuple[int, torch.UntypedStorage, bool] | None:
        """A free slot of this worker, flagged as taken: the smallest whose memory is large
        enough, else one to (re)allocate; None if the trainer holds them all, or allocating would
        take the slots past `batches_kept` batches of ``batch_bytes`` (this one's large tensors so
        far) or of the largest batch before."""
        base = worker * self.slots_per_worker
        with self._flags.get_lock():
            flags = self._flags.get_obj()
            free = [s for s in range(base, base + self.slots_per_worker) if not flags[s]]
            if not free:
                return None
            fits = [s for s in free if s in self._storages and self._storages[s].nbytes() >= nbytes]
            # The smallest that fits; else an unused slot; else the smallest free one grows (a
            # larger one may fit the batch's other tensors).
            empty = [s for s in free if s not in self._storages]
            old = 0
            if fits:
                slot = min(fits, key=lambda s: self._storages[s].nbytes())
            else:
                slot = empty[0] if empty else min(free, key=lambda s: self._storages[s].nbytes())
                old = self._storages[slot].nbytes() if slot in self._storages else 0
                limit = self.batches_kept * max(self._largest_batch, batch_bytes)
                if self._pooled_bytes - old + nbytes > limit:
                    return None
            flags[slot] = 1
        if not fits:
            self._storages.pop(slot, None)
            self._pooled_bytes -= old
            self._storages[slot] = (
                torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
                if self._shared
                else torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]
            )
            self._pooled_bytes += nbytes
        return slot, self._storages[slot], bool(fits)

    def _release(self, slots: list[int], timeout: float | None = None) -> bool:
        """Clears the slots' flags; False if the lock could not be had within ``timeout``
        seconds (None waits as long as it takes). Not ``timeout=-1``: ``threading.Lock`` reads
        it as no limit, a multiprocessing lock as no wait at all."""
        if not slots:
            return True
        lock = self._flags.get_lock()
        if not (lock.acquire() if timeout is None else lock.acquire(timeout=timeout)):
            return False
        try:
            flags = self._flags.get_obj()
            for slot in slots:
                flags[slot] = 0
        finally:
            lock.release()
        return True

    # --- in the trainer ---

    def receive(self, batch: Pooled) -> Any:
        """The batch for the user; its slots are watched until the trainer lets go of them (from
        its arrival, for a batch from a worker)."""
        self.reused += batch.reused
        self.allocated += batch.allocated
        self.unpooled += batch.unpooled
        if not batch.arrived:
            self._held += _refs(batch.tensors)
        return batch.data

    def collect(self) -> None:
        """Frees the slots whose memory the trainer no longer references; if the flags' lock
        cannot be had within COLLECT_WAIT_S, leaves them for the next call."""
        # One pass: a reference that expires after it was looked at stays for the next call.
        self._held += _arrivals(self.id)
        free: list[int] = []
        held: list[tuple[int, StorageWeakRef]] = []
        for slot, ref in self._held:
            if ref.expired():  # type: ignore[no-untyped-call]
                free.append(slot)
            else:
                held.append((slot, ref))
        if self._release(free, timeout=COLLECT_WAIT_S):
            self._held = held

    def forget(self) -> None:
        """Stops watching this memory's batches (the DataLoader replaces it: its workers are gone)."""
        _arrivals(self.id)
        self._held = []

    def counts(self) -> dict[str, int]:
        return {"reused": self.reused, "allocated": self.allocated, "unpooled": self.unpooled}
